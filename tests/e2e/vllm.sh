#!/usr/bin/env bash
# GPU machine (H200), with the vLLM kit carried (`run` with carry [".kits/vllm"]): evenkv inside
# a real vLLM 0.26.0 engine, end to end, through tests/e2e/compare.py.
#
# usage: bash tests/e2e/vllm.sh [STEP...]      (default: eager graphs pytest v2)
#   eager   --compare, V1 model runner, eager: CUSTOM (evenkv) vs TRITON_ATTN vs HF transformers
#           teacher-forced on a tiny random Qwen3 with the Qwen3-30B-A3B attention shape
#           (32 q / 4 kv heads, D 128, bf16, 4 layers): RESULT compare ... ok=1
#   graphs  the same with full CUDA graphs of decode steps (FULL_DECODE_ONLY), plus --skewed: one
#           16K-token prompt beside 63 short ones, 64 decode steps, decode step time of each backend
#   pytest  the GPU lane of tests/engines/test_vllm_integration.py (bf16 mixed batch, CUDA graph replay
#           after a re-plan) plus its CPU-lane tests run on the GPU
#   v2      --compare, eager, with vLLM's default (V2) model runner
#   window  --compare on the same Qwen3 with a 128-token sliding window on every layer
#   fp8     --compare with --kv-cache-dtype fp8 (both backends read an e4m3 cache)
#   gpt-oss --compare on a tiny random gpt-oss (64 q / 8 kv heads, D 64, sinks, alternating
#           128-token window and full layers: two layer kinds in two KV-cache groups)
# env: BUDGET (s, default 570; a step that would not fit is skipped and says so), OUT (logs;
#      default /tmp/evenkv-vllm-e2e), VLLM_KIT (default .kits/vllm), MODEL (tiny model dir).
# Prints RESULT lines (also in $OUT/results.txt); per-step logs in $OUT.
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
KIT=${VLLM_KIT:-$ROOT/.kits/vllm}
L=${OUT:-/tmp/evenkv-vllm-e2e}
MODEL=${MODEL:-/tmp/evenkv-qwen3-32q4kv}
T0=$SECONDS
BUDGET=${BUDGET:-570}
mkdir -p "$L"
RES=$L/results.txt
: > "$RES"

[ -f "$KIT/setup.sh" ] || { echo "no vLLM kit at $KIT (VLLM_KIT: a folder whose setup.sh, sourced, makes vLLM importable)"; exit 1; }
# shellcheck disable=SC1091
source "$KIT/setup.sh" || exit 1

# shellcheck disable=SC1091
source "$ROOT/tests/e2e/site.sh"
evenkv_site /tmp/evenkv-vllm-site vllm.general_plugins evenkv.integrations.vllm:register || exit 1


model() {
  [ -f "$MODEL/config.json" ] && return 0
  # 32768 positions: the skewed workload's 16K prompt plus its decode steps.
  python3 "$KIT/make_model.py" "$MODEL" --q-heads 32 --kv-heads 4 --max-pos 32768 > "$L/model.log" 2>&1 \
    || { tail "$L/model.log"; return 1; }
  echo "== model ready at $((SECONDS - T0))s: $(tail -1 "$L/model.log")"
}

variant() {  # variant NAME: a layer_models.py checkpoint next to $MODEL
  local dir=$MODEL-$1
  [ -f "$dir/config.json" ] && return 0
  if [ "$1" = window ]; then model && python3 "$ROOT/tests/e2e/layer_models.py" window "$MODEL" "$dir"
  else python3 "$ROOT/tests/e2e/layer_models.py" "$1" "$dir"; fi > "$L/model-$1.log" 2>&1 || { tail "$L/model-$1.log"; return 1; }
}

EX=$ROOT/tests/e2e/compare.py
for s in ${@:-eager graphs pytest v2}; do
  case $s in
    eager) model && run_step eager 240 120 python3 "$EX" "$MODEL" --runner v1 --graphs 0 --compare ;;
    graphs) model && run_step graphs 300 150 python3 "$EX" "$MODEL" --runner v1 --graphs 1 --compare --skewed ;;
    pytest)
      (cd "$ROOT" && run_step pytest-vllm 200 60 python3 -m pytest -q -rs -p no:cacheprovider -m "gpu or not gpu" \
        tests/engines/test_vllm_integration.py)
      tail -3 "$L/pytest-vllm.log" 2>/dev/null | sed 's/^/   /' ;;
    v2) model && run_step v2 200 120 python3 "$EX" "$MODEL" --runner v2 --graphs 0 --compare ;;
    window) variant window && run_step window 200 120 python3 "$EX" "$MODEL-window" --graphs 1 --compare ;;
    fp8) model && run_step fp8 200 120 python3 "$EX" "$MODEL" --graphs 1 --compare --kv-cache-dtype fp8 ;;
    gpt-oss) variant gpt-oss && run_step gpt-oss 240 120 python3 "$EX" "$MODEL-gpt-oss" --graphs 1 --compare ;;
    *) echo "unknown step $s (eager | graphs | pytest | v2 | window | fp8 | gpt-oss)"; exit 2 ;;
  esac
done
echo "== done in $((SECONDS - T0))s; RESULT lines in $RES"
