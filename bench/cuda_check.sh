#!/usr/bin/env bash
# The GPU checks of CUDA staging (pccl.staging), as one bounded run on a GPU host:
#   bench/cuda_check.sh            (from the repository root, pccl importable, torch+CUDA)
# 1. the CUDA tests (tests/system/test_cuda.py; skipped elsewhere), at most 3 minutes;
# 2. bench/cuda_allreduce.py at k=2: 64/128/256 MiB float32, host vs staged CUDA vs copy
#    by hand, bit-identity, and a SIGKILLed peer (JSON under bench/results/), at most 6.
# Exit status: non-zero when a test or a check failed (the speed targets are reported,
# not enforced).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')" || exit 2
"$PY" -c "import torch; print('card:', torch.cuda.get_device_name(0), '| torch', torch.__version__)"
status=0
timeout -k 10 180 "$PY" -m pytest -q -p no:randomly -p no:cacheprovider tests/system/test_cuda.py \
    tests/unit/test_staging.py || status=1
timeout -k 10 360 "$PY" bench/cuda_allreduce.py --sizes-mib 64 128 256 --iters 5 --warmup 1 \
    || status=1
exit $status
