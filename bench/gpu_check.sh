#!/usr/bin/env bash
# The device check, run on the lent GPU machine from the repo root:
#   carry .gpu/ (gguf wheel + llama.cpp's libggml-base.so built here), results land in $OUT.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/*.whl
export PYTHONPATH="/tmp/site:$PWD" QUANTKIT_GGML_LIB_DIR="$PWD/.gpu" QUANTKIT_CACHE=/tmp/qkcache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 bench/gpu_check.py "${OUT:-/tmp/out}/gpu" 2>&1 | tee "${OUT:-/tmp/out}/gpu_check.log"
