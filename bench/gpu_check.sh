#!/usr/bin/env bash
# The device check, run on the lent GPU machine from the repo root:
#   carry .gpu/ (gguf, exllamav2 and its converter's fastparquet + cramjam wheels, llama.cpp's libggml-base.so
#   built here); results land in $OUT.  Making .gpu/ here (about a minute; the device cannot reach PyPI):
#     echo /.gpu/ >> .git/info/exclude; mkdir -p .gpu
#     cp -L "$(python -c 'import llama_cpp, os; print(os.path.dirname(llama_cpp.__file__))')/lib/libggml-base.so" .gpu/
#     python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .gpu gguf==0.19.0 exllamav2==0.3.2 fastparquet cramjam
#   Then one `run` of `bash bench/gpu_check.sh 2>&1` with carry [".gpu"] and timeout_s 590: the device's 15
#   minutes hold one such run and the machine's start, not two.
# exllamav2 is a pure-Python wheel that JIT-compiles its CUDA extension on first import: that build starts in
# the background (for this GPU's architecture only) while the CUDA path is checked, and the exllamav2 step
# at the end waits for it (torch's extension lock).
set -euo pipefail
OUT="${OUT:-/tmp/out}"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/*.whl
# QUANTKIT_COMPILE=0: the CPU side runs the eager code (byte-identical to the fused kernels, tested in CI)
# rather than building Inductor kernels for the device's torch on its CPU
export QUANTKIT_COMPILE=0 PYTHONPATH="/tmp/site:$PWD" QUANTKIT_GGML_LIB_DIR="$PWD/.gpu" QUANTKIT_CACHE=/tmp/qkcache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
# exllamav2's JIT build and every later import must see the same arch list: ninja rebuilds the whole extension
# when a compile command changes (on 2026-12-04 the check's own import started a second build and ran out of time)
export TORCH_CUDA_ARCH_LIST="$(python3 -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')" MAX_JOBS=12
if ls .gpu/exllamav2-*.whl >/dev/null 2>&1; then
  (t0=$(date +%s); rc=0; timeout 420 python3 -c "import exllamav2.ext" >"$OUT/exllamav2_build.log" 2>&1 || rc=$?
   echo "exllamav2 extension build: rc=$rc in $(( $(date +%s) - t0 )) s" >>"$OUT/exllamav2_build.log") &
fi
# the work folder (models, artifacts) stays off $OUT: only the report and logs come back
timeout 520 python3 bench/gpu_check.py /tmp/gpu_check 2>&1 | tee "$OUT/gpu_check.log" || true
cp /tmp/gpu_check/gpu_check.json /tmp/gpu_check/exllamav2_convert.log "$OUT/" 2>/dev/null || true
wait || true
