#!/usr/bin/env bash
# The GPU checks in one run, one JSON file per check (docs/benchmarks.md records them):
#
#   bash bench/gpu/run_all.sh [OUT_DIR]            # one H200: about 6-8 minutes
#   bash bench/gpu/run_all.sh OUT_DIR --tiny       # CPU smoke run of the same scripts (tests/unit/test_bench_scripts.py)
#
#   sft_mfu.json      SFT MFU at Qwen2.5-VL-7B's shape: packed 4,096-token rows, bf16, the chunked LM-head loss,
#                     gradient checkpointing, the varlen attention kernel, rows packed ahead by one data worker
#                     (the stages' step_inputs, pinned memory) (bench/gpu/sft_mfu.py), with one step's
#                     loss / gradients compared against the SDPA loops first (--check-varlen)
#   sft_mfu_loops.json  the same with --varlen off: per-sample / per-window SDPA loops (the ratio of the two)
#   rl_step.json      one RL step's time split: rollout / scoring / update, rollout tokens/s (bench/gpu/rl_step.py)
#   dali_decode.json  DALI nvJPEG decode + smart_resize images/s, and torchvision's nvJPEG, against the CPU path
#                     (bench/gpu/dali_decode.py; DALI reported as missing where its wheel is not installed)
#
# A check that fails writes its log beside the JSON files and the others still run; the exit status is the
# number of failed checks. Each check's stdout/stderr is in OUT_DIR/<check>.log. Environment: PYTHON (default
# python3, the interpreter that holds PyTorch on a GPU image) and CHECK_TIMEOUT_S (default 600): a check running
# longer is stopped and counted as failed, so one hang cannot eat a GPU lease.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-bench/gpu/results}
MODE=${2:-}
PYTHON=${PYTHON:-python3}
CHECK_TIMEOUT_S=${CHECK_TIMEOUT_S:-600}
mkdir -p "$OUT"
if [[ "$MODE" == "--tiny" ]]; then
  SFT=(--tiny --steps 2 --data-workers 1)
  SFT_LOOPS=(--tiny --steps 2 --varlen off)
  RL=(--tiny --steps 1 --prompts 2 --samples 2 --max-new-tokens 4)
  DALI=(--tiny)
else
  SFT=(--steps 8 --warmup 2 --grad-ckpt --check-varlen)
  SFT_LOOPS=(--steps 8 --warmup 2 --grad-ckpt --varlen off)
  RL=(--steps 3 --prompts 32 --samples 2)
  DALI=()
fi
failed=0
run() {
  local name=$1
  shift
  echo "== $name: $PYTHON $*"
  local started=$SECONDS
  if timeout "$CHECK_TIMEOUT_S" "$PYTHON" "$@" --json-out "$OUT/$name.json" >"$OUT/$name.log" 2>&1; then
    echo "   ok in $((SECONDS - started)) s -> $OUT/$name.json"
  else
    echo "   FAILED in $((SECONDS - started)) s; last lines of $OUT/$name.log:"
    tail -n 15 "$OUT/$name.log" | sed 's/^/   | /'
    failed=$((failed + 1))
  fi
}
run sft_mfu bench/gpu/sft_mfu.py "${SFT[@]}"
run sft_mfu_loops bench/gpu/sft_mfu.py "${SFT_LOOPS[@]}"
run rl_step bench/gpu/rl_step.py "${RL[@]}"
run dali_decode bench/gpu/dali_decode.py "${DALI[@]}"
exit "$failed"
