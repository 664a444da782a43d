#!/usr/bin/env bash
# The checks that need a GPU: NCCL, FSDP2 offload to pinned memory, FSDP1 CPUOffload, rank-0 loading on GPU, sharded
# saves that leave no copy on the GPU, and every single-node GPU accelerate config launched on the GPUs present, a
# sharded checkpoint saved, and a CPU config kept off them (tests/test_sharding_gpu.py); CUDA peak memory
# and MFU in the logged metrics (tests/test_metrics_gpu.py); then the plan tests with the CUDA build. Not run yet
# (no GPU so far). Usage: bench/gpu_sharding_check.sh [python]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${1:-${PYTHON:-python}}"
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name(0), torch.cuda.device_count(), 'GPU(s)')"
# FSDP_RECIPES_GPU_TESTS=1: the test harness leaves the GPUs visible (tests/conftest.py hides them otherwise).
# Bounded for a short lease of a GPU machine: a hung NCCL test fails after 2 minutes, and the whole check stops
# after 5 and a half, so that the time left still runs bench/gpu_mfu.py.
FSDP_RECIPES_GPU_TESTS=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 330 "$PYTHON" -m pytest -v -rs \
    -o timeout=120 tests/test_sharding_gpu.py tests/test_metrics_gpu.py tests/test_sharding_plan.py
