#!/usr/bin/env bash
# The GPU checks in one prepared call, one JSON file per arm (docs/benchmarks.md records them; the MFU each arm
# is expected to reach, and the arithmetic behind it, is in bench/gpu/expected_mfu.json):
#
#   bash bench/gpu/run_all.sh [OUT_DIR]            # one H200 (nvidia-h200): at most RUN_BUDGET_S (480 s) in all
#   bash bench/gpu/run_all.sh OUT_DIR --tiny       # CPU smoke run of the same arms (tests/unit/test_bench_scripts.py)
#
#   probe.json              versions (torch, CUDA, transformers), the device, torch's varlen_attn parameters, the
#                           attention path of bf16 and of fp32-under-autocast weights, fused AdamW (probe.py)
#   sft_varlen_4k.json      SFT at Qwen2.5-VL-7B's shape (sft_mfu.py): varlen attention, no checkpointing, fused
#                           AdamW, 4,096-token rows (the H200 run's 9.1% row, loops then); one step's loss and
#                           gradients compared with the SDPA loops first (--check-varlen)
#   sft_selckpt_8k.json     the same with every second block checkpointed (train.checkpoint_every_n_layers: 2),
#                           8,192-token rows
#   sft_ckpt_16k.json       every block checkpointed, 16,384-token rows
#   sft_compiled_4k.json    each LM layer and ViT block through torch.compile, 4,096-token rows, under its own
#                           COMPILE_TIMEOUT_S (240 s): a compile that runs long cannot eat the other arms (not in
#                           --tiny: the CPU compile takes minutes; tests/unit/test_bench_scripts.py runs it alone)
#   rl_step.json            one RL step's time split and rollout tokens/s (rl_step.py)
#
# ARMS="probe sft_varlen_4k ..." picks arms (dali_decode is one more: GPU decode, bench/gpu/dali_decode.py).
# An arm that fails writes its log beside the JSON files and the others still run; an arm that would start with
# less than MIN_ARM_S (60 s) of the budget left is skipped and said. Exit status: the number of failed arms.
# Environment: PYTHON (default python3), RUN_BUDGET_S (480), CHECK_TIMEOUT_S (240, each arm at most).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-bench/gpu/results}
MODE=${2:-}
PYTHON=${PYTHON:-python3}
RUN_BUDGET_S=${RUN_BUDGET_S:-480}
CHECK_TIMEOUT_S=${CHECK_TIMEOUT_S:-240}
COMPILE_TIMEOUT_S=${COMPILE_TIMEOUT_S:-240}
MIN_ARM_S=${MIN_ARM_S:-60}
mkdir -p "$OUT"
SFT=(bench/gpu/sft_mfu.py --steps 6 --warmup 2 --optim adamw-fused)
if [[ "$MODE" == "--tiny" ]]; then
  ARMS=${ARMS:-probe sft_varlen_4k sft_selckpt_8k sft_ckpt_16k rl_step dali_decode}
  SFT=(bench/gpu/sft_mfu.py --tiny --steps 2 --optim adamw-fused)
  declare -A FLAGS=(
    [sft_varlen_4k]="--data-workers 1"
    [sft_selckpt_8k]="--grad-ckpt --ckpt-every 2"
    [sft_ckpt_16k]="--grad-ckpt"
    [sft_compiled_4k]="--compile"
  )
  RL=(--tiny --steps 1 --prompts 2 --samples 2 --max-new-tokens 4)
  DALI=(--tiny)
else
  ARMS=${ARMS:-probe sft_varlen_4k sft_selckpt_8k sft_ckpt_16k sft_compiled_4k rl_step}
  declare -A FLAGS=(
    [sft_varlen_4k]="--budget 4096 --check-varlen"
    [sft_selckpt_8k]="--budget 8192 --grad-ckpt --ckpt-every 2"
    [sft_ckpt_16k]="--budget 16384 --grad-ckpt"
    [sft_compiled_4k]="--budget 4096 --compile"
  )
  RL=(--steps 3 --prompts 32 --samples 2)
  DALI=()
fi
failed=0
started_all=$SECONDS
run() {
  local name=$1 limit=$2
  shift 2
  local left=$((RUN_BUDGET_S - (SECONDS - started_all)))
  if ((left < MIN_ARM_S)); then
    echo "== $name: SKIPPED, ${left} s of the ${RUN_BUDGET_S} s budget left"
    return
  fi
  ((limit > left)) && limit=$left
  echo "== $name (at most ${limit} s): $PYTHON $*"
  local started=$SECONDS
  if timeout "$limit" "$PYTHON" "$@" --json-out "$OUT/$name.json" >"$OUT/$name.log" 2>&1; then
    echo "   ok in $((SECONDS - started)) s -> $OUT/$name.json"
  else
    echo "   FAILED in $((SECONDS - started)) s; last lines of $OUT/$name.log:"
    tail -n 15 "$OUT/$name.log" | sed 's/^/   | /'
    failed=$((failed + 1))
  fi
}
for arm in $ARMS; do
  case $arm in
    probe) run probe 60 bench/gpu/probe.py ;;
    sft_compiled_4k) run "$arm" "$COMPILE_TIMEOUT_S" "${SFT[@]}" ${FLAGS[$arm]} ;;
    sft_*) run "$arm" "$CHECK_TIMEOUT_S" "${SFT[@]}" ${FLAGS[$arm]} ;;
    rl_step) run rl_step "$CHECK_TIMEOUT_S" bench/gpu/rl_step.py "${RL[@]}" ;;
    dali_decode) run dali_decode "$CHECK_TIMEOUT_S" bench/gpu/dali_decode.py "${DALI[@]}" ;;
    *) echo "== $arm: unknown arm (probe, sft_varlen_4k, sft_selckpt_8k, sft_ckpt_16k, sft_compiled_4k, rl_step, dali_decode)"; failed=$((failed + 1)) ;;
  esac
done
echo "== done in $((SECONDS - started_all)) s, $failed failed"
exit "$failed"
