#!/usr/bin/env bash
# The device check, run on the lent GPU machine from the repo root:
#   carry .gpu/ (gguf + exllamav2 wheels, llama.cpp's libggml-base.so built here); results land in $OUT.
# exllamav2 is a pure-Python wheel that JIT-compiles its CUDA extension on first import: that build starts in
# the background (for this GPU's architecture only) while the CUDA path is checked, and the exllamav2 step
# at the end waits for it (torch's extension lock).
set -euo pipefail
OUT="${OUT:-/tmp/out}"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/*.whl
export PYTHONPATH="/tmp/site:$PWD" QUANTKIT_GGML_LIB_DIR="$PWD/.gpu" QUANTKIT_CACHE=/tmp/qkcache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
if ls .gpu/exllamav2-*.whl >/dev/null 2>&1; then
  (export TORCH_CUDA_ARCH_LIST="$(python3 -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')" MAX_JOBS=12
   t0=$(date +%s); rc=0; timeout 420 python3 -c "import exllamav2.ext" >"$OUT/exllamav2_build.log" 2>&1 || rc=$?
   echo "exllamav2 extension build: rc=$rc in $(( $(date +%s) - t0 )) s" >>"$OUT/exllamav2_build.log") &
fi
# the work folder (models, artifacts) stays off $OUT: only the report and logs come back
timeout 480 python3 bench/gpu_check.py /tmp/gpu_check 2>&1 | tee "$OUT/gpu_check.log" || true
cp /tmp/gpu_check/gpu_check.json "$OUT/" 2>/dev/null || true
wait || true
# the compiled CPU kernels on another CPU: still bit-identical to llama.cpp?
QUANTKIT_COMPILE=1 timeout 150 python3 -m pytest -q -x tests/test_gguf_fused.py -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/fused_cpu.log" || true
