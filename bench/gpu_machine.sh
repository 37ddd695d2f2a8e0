#!/usr/bin/env bash
# The GPU check as one command on the GPU check machine (../shared/gpu/README.md): install the
# wheels sent along in .whl, run the CUDA-marked tests, then bench/gpu.py; everything lands in $OUT
# (gpu.md, gpu.json, and logs.tar.gz with the test log and the bench's stderr).
#   usage: bash bench/gpu_machine.sh [TEST_TIMEOUT_S] [BENCH_BUDGET_S] [SECTIONS]
set -u
TEST_S=${1:-120}
BUDGET_S=${2:-420}
SECTIONS=${3:-mfu,stages,scale,recipes,throughput}
OUT=${OUT:-runs/gpu_machine}
mkdir -p "$OUT" /tmp/gpu_logs
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OPTIMIZE_TEST_TOKENIZER=$PWD/.gl/smollm2_tokenizer
nvidia-smi -L; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
# the files that hold CUDA-marked tests (the export tests need executorch, which is not there)
timeout "$TEST_S" python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 100 --continue-on-collection-errors \
  $(grep -l "mark.gpu" -r tests --include='test_*.py' | grep -v '^tests/export') >/tmp/gpu_logs/tests.log 2>&1
echo "gpu tests: exit $?"; tail -25 /tmp/gpu_logs/tests.log
python3 bench/gpu.py --tokenizer .gl/smollm2_tokenizer --out "$OUT" --budget-s "$BUDGET_S" --sections "$SECTIONS" \
  2>/tmp/gpu_logs/bench.log
echo "bench: exit $?"
tar czf "$OUT/logs.tar.gz" -C /tmp gpu_logs
