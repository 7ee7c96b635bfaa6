#!/usr/bin/env bash
# Every GPU check in one go, for a CUDA machine: the acceptance test's CUDA cases, the kernel tests on the
# GPU (compiled Triton), the fused-vs-sorted CUDA tests, the MoE benchmark (bf16 and fp32) and the
# training-throughput benchmark. Everything goes to one file: $OUT/gpu_check.txt (OUT defaults to
# ./gpu_check_results). Exit status: 1 if any test script failed (the benchmarks still run).
#
#     bash scripts/gpu_check.sh                 # ~5-8 minutes on an H100/H200
#     OUT=/tmp/res QUICK=1 bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-gpu_check_results}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.txt"
: > "$LOG"
SHARED_DIR=${MINIMIND_SHARED:-../shared}
status=0

section() { echo -e "\n===== $* =====" | tee -a "$LOG"; }
step() {  # run a test script, keep going on failure
    section "$*"
    "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || status=1
}

section "machine"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpu', torch.cuda.get_device_name())"
} 2>&1 | tee -a "$LOG"

if [ -f "$SHARED_DIR/acceptance/test_moe_sorted.py" ]; then
    step env PYTHONPATH=. $PY "$SHARED_DIR/acceptance/test_moe_sorted.py"
else
    section "acceptance test: $SHARED_DIR/acceptance/test_moe_sorted.py not found, skipped" 
fi
step env TRITON_INTERPRET=0 $PY scripts/test_kernels.py
step $PY scripts/test_moe_sorted.py
step $PY scripts/test_moe_fused.py

if [ -n "${QUICK:-}" ]; then BENCH_ARGS="--quick"; else BENCH_ARGS=""; fi
section "bench_moe bf16"
$PY scripts/bench/bench_moe.py --device cuda --dtype bfloat16 $BENCH_ARGS 2>&1 | tee -a "$LOG"
section "bench_moe fp32"
$PY scripts/bench/bench_moe.py --device cuda --dtype float32 --impls dense,masked,sorted,fused,hf-grouped_mm $BENCH_ARGS 2>&1 | tee -a "$LOG"
section "bench_train bf16"
$PY scripts/bench/bench_train.py --device cuda --dtype bfloat16 --batch_size 32 --seq_len 256 2>&1 | tee -a "$LOG"
$PY scripts/bench/bench_train.py --device cuda --dtype bfloat16 --num_experts 64 --top_k 8 --moe_intermediate_size 128 --batch_size 32 --seq_len 256 2>&1 | tee -a "$LOG"

section "done: status $status (results in $LOG)"
exit $status
