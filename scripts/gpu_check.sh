#!/usr/bin/env bash
# Every GPU check and figure in one run, sized for a short slot on one CUDA machine (about 6 minutes on an
# H200 with its own packages: torch 2.11, transformers 5.17, no datasets / wandb, no network):
#   1. the CUDA cases of the test scripts (name filters: their CPU cases are CI's) and the acceptance test,
#      side by side while the race's corpus is built;
#   2. the MoE layer, fwd+bwd, against the dense FFN of equal FLOPs and transformers' grouped_mm block at
#      N=32,768 (bench_moe.py), with a kernel profile of the fused layer and the dense FFN;
#   3. whole training steps, MoE vs dense of equal active width vs transformers' Qwen3-MoE, with MFU
#      (bench_train.py): D=1024 L=8 E=8 k=2 F=1024 and E=64 k=8 F=256 at 16 x 1024, the main job's model at 16 x 128
#      (also under torch.compile, dense vs fused: whether compiling should be the GPU default);
#   4. an iso-time race on the main job's shape and corpus, dense vs MoE (bench_quality.py; RACE_ROWS);
#   5. one table of every figure beside its target (scripts/bench/gpu_table.py);
#   6. with more than one GPU: the sharded-training tests over NCCL, one GPU per rank (test_sharded.py), and
#      what each rank holds at ep_size 1 / G with and without --fsdp (bench_parallel.py).
# Results in $OUT (default ./gpu_check_results): gpu_check.txt (the whole log), table.md, profile.txt, and
# details.tar.gz (the JSON files and per-run logs). Exit status 1 if a test script failed (the rest still runs).
#
#     bash scripts/gpu_check.sh
#     OUT=/tmp/res QUICK=1 bash scripts/gpu_check.sh   # fewer timed rounds, 20 s race rows, no compiled step
#     DEVICE=cpu bash scripts/gpu_check.sh             # the script itself on a CPU machine, at toy sizes
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-gpu_check_results}
DEVICE=${DEVICE:-cuda}
RACE_ROWS=${RACE_ROWS:-dense,wide}  # bench_quality.py's rows: dense and E=16 top-2 (the best MoE row so far)
SHARED_DIR=${MINIMIND_SHARED:-../shared}
DETAILS="$OUT/details"
mkdir -p "$DETAILS"
LOG="$OUT/gpu_check.txt"
: > "$LOG"
: > "$DETAILS/tests.txt"
status=0

section() { echo -e "\n===== $* =====" | tee -a "$LOG"; }
TESTS=()
start_test() {  # start_test NAME COMMAND...: a test script in the background (they share the GPU lightly)
    local name=$1; shift
    ( "$@" > "$DETAILS/$name.log" 2>&1; echo $? > "$DETAILS/$name.rc" ) &
    TESTS+=("$name:$!")
}
bench() { section "$1"; shift; "$@" 2>&1 | tee -a "$LOG"; }

if [ "$DEVICE" = cuda ]; then  # the issue's shapes; bf16 autocast as the trainer runs on a GPU
    DTYPE=bfloat16 TOKENS=32768 BUDGET=40 ROUNDS=(--steps 5 --rounds 4)
    [ -n "${QUICK:-}" ] && BUDGET=20 ROUNDS=(--steps 5 --rounds 2)
    BIG=(--hidden_size 1024 --num_layers 8 --num_heads 16 --num_kv_heads 4 --batch_size 16 --seq_len 1024)
    MAIN=(--batch_size 16 --seq_len 128)
    RACE=()
else  # toy sizes: only that every step runs and the table fills
    DTYPE=float32 TOKENS=256 BUDGET=4
    ROUNDS=(--steps 1 --rounds 1)
    BIG=(--hidden_size 64 --num_layers 2 --num_heads 4 --num_kv_heads 2 --batch_size 2 --seq_len 64)
    MAIN=(--hidden_size 64 --num_layers 2 --batch_size 2 --seq_len 64)
    RACE=(--hidden_size 64 --num_hidden_layers 2 --moe_intermediate_size 64 --batch_size 4 --seq_len 64 --eval_tokens 1024)
fi

section "machine"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
  $PY -c "import triton; print('triton', triton.__version__)"; $PY -c "import transformers; print('transformers', transformers.__version__)"
} 2>&1 | tee -a "$LOG"

# the default corpus for the race, built on the CPU cores while the tests run
$PY -c "from data.prepare import prepare_data; from model.config import MiniMindConfig; prepare_data(vocab_size=MiniMindConfig.vocab_size)" > "$DETAILS/corpus.log" 2>&1 &
CORPUS=$!
if [ -f "$SHARED_DIR/acceptance/test_moe_sorted.py" ]; then
    start_test acceptance env PYTHONPATH=. $PY "$SHARED_DIR/acceptance/test_moe_sorted.py"
else
    section "acceptance test: $SHARED_DIR/acceptance/test_moe_sorted.py not found, skipped"
fi
start_test test_kernels env TRITON_INTERPRET=0 $PY scripts/test_kernels.py rows_bitwise permute_combine grouped_ops \
    grouped_swiglu  # (compiled Triton on CUDA)
start_test test_moe_sorted $PY scripts/test_moe_sorted.py cuda
start_test test_moe_fused $PY scripts/test_moe_fused.py cuda
start_test test_compile $PY scripts/test_compile.py cuda
for entry in "${TESTS[@]}"; do
    name=${entry%%:*}
    wait "${entry##*:}"
    section "test: $name"
    tee -a "$LOG" < "$DETAILS/$name.log"
    rc=$(cat "$DETAILS/$name.rc")
    echo "$rc $name" >> "$DETAILS/tests.txt"
    [ "$rc" -eq 0 ] || status=1
done

bench "MoE layer vs dense FFN and transformers, $DTYPE, N=$TOKENS" $PY scripts/bench/bench_moe.py --device "$DEVICE" \
    --dtype $DTYPE --shapes minimind,many-experts --tokens $TOKENS --impls dense,fused,hf-grouped_mm ${QUICK:+--quick} \
    --json "$DETAILS/layer.json" --profile "$OUT/profile.txt"
bench "training step, D=1024 L=8 E=8 k=2 F=1024" $PY scripts/bench/bench_train.py --device "$DEVICE" --dtype $DTYPE \
    --rows dense,fused,hf "${BIG[@]}" --num_experts 8 --top_k 2 --moe_intermediate_size 1024 "${ROUNDS[@]}" \
    --json "$DETAILS/step_d1024_e8.json"
bench "training step, D=1024 L=8 E=64 k=8 F=256" $PY scripts/bench/bench_train.py --device "$DEVICE" --dtype $DTYPE \
    --rows dense,fused,hf "${BIG[@]}" --num_experts 64 --top_k 8 --moe_intermediate_size 256 "${ROUNDS[@]}" \
    --json "$DETAILS/step_d1024_e64.json"
bench "training step, the main job's model" $PY scripts/bench/bench_train.py --device "$DEVICE" --dtype $DTYPE \
    --rows dense,fused,hf "${MAIN[@]}" "${ROUNDS[@]}" --json "$DETAILS/step_main.json"
[ -z "${QUICK:-}" ] && bench "training step, the main job's model, torch.compile" $PY scripts/bench/bench_train.py \
    --device "$DEVICE" --dtype $DTYPE --rows dense,fused "${MAIN[@]}" "${ROUNDS[@]}" --compile \
    --json "$DETAILS/step_main_compiled.json"
wait $CORPUS || { section "corpus build failed"; tail -5 "$DETAILS/corpus.log" | tee -a "$LOG"; }
bench "iso-time race, ${BUDGET} s per row" $PY scripts/bench/bench_quality.py --rows "$RACE_ROWS" --budget_s "$BUDGET" \
    "${RACE[@]}" --out_dir "$DETAILS/quality" --extra "--device $DEVICE"

GPUS=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$DEVICE" = cuda ] && [ "$GPUS" -gt 1 ]; then
    section "test: test_sharded.py over NCCL, $GPUS GPUs"
    TEST_DEVICE=cuda $PY scripts/test_sharded.py 2>&1 | tee "$DETAILS/test_sharded_nccl.log" | tee -a "$LOG"
    rc=${PIPESTATUS[0]}; echo "$rc test_sharded_nccl" >> "$DETAILS/tests.txt"; [ "$rc" -eq 0 ] || status=1
    bench "what each rank holds, $GPUS GPUs (NCCL)" $PY scripts/bench/bench_parallel.py --device cuda \
        --layouts "1:1,$GPUS:1,$GPUS:$GPUS,$GPUS:1:fsdp,$GPUS:$GPUS:fsdp" --json "$DETAILS/parallel.json"
else
    section "multi-GPU checks skipped: $GPUS GPU(s)"
fi

section "table"
$PY scripts/bench/gpu_table.py "$DETAILS" 2>&1 | tee "$OUT/table.md" | tee -a "$LOG"
tar czf "$OUT/details.tar.gz" -C "$OUT" details && rm -rf "$DETAILS"
section "done: status $status (results in $OUT)"
exit $status
