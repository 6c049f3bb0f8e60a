#!/usr/bin/env bash
# GPU machine (H200), with the vLLM kit carried (`run` with carry [".kits/vllm"], plus
# ".kits/peers" for FA3 and ".kits/vllm-serve" for the `openai` step): evenkv inside a real
# vLLM 0.26.0 engine, end to end.
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
#   hnd     --compare with VLLM_KV_CACHE_LAYOUT=HND (both backends on head-major pages), CUDA graphs
#   gpt-oss --compare on a tiny random gpt-oss (64 q / 8 kv heads, D 64, sinks, alternating
#           128-token window and full layers: two layer kinds in two KV-cache groups)
#   invariance  tests/e2e/invariance.py with VLLM_BATCH_INVARIANT=1, CUDA graphs: one prompt alone, among
#           63 others, and prefilled in 97-token chunks, evenkv: bitwise the same tokens and logprobs
#   invariance-default  the same with FLASH_ATTN (FA3, one split in this mode; needs the peers kit)
#   spec-ngram  --compare with n-gram speculation (3 draft tokens), CUDA graphs: evenkv vs FLASH_ATTN
#           (TRITON_ATTN without the peers kit) vs HF
#   spec-draft  the same with the model as its own draft model (method "draft_model", 3 draft tokens), whose
#           drafts are mostly accepted: evenkv runs the draft model's attention too
#   openai  the operator's path (tests/e2e/openai_server.py): `vllm serve MODEL --attention-backend CUSTOM`
#           with a tokenizer built here, 256 requests 32 at a time on /v1/completions and
#           /v1/chat/completions, streamed and not, evenkv's kernel line in the log, stop by PID
#           (needs the wheels of tests/e2e/serve_wheels.sh, which the kit lacks for the server)
# One engine's e2e set: BUDGET=330 bash tests/e2e/vllm.sh invariance spec-ngram openai
# env: BUDGET (s, default 570; a step that would not fit is skipped and says so), OUT (logs;
#      default /tmp/evenkv-vllm-e2e), VLLM_KIT (default .kits/vllm), PEERS_KIT (default .kits/peers;
#      sourced first when present: FA3 for FLASH_ATTN and for evenkv's prefill), SERVE_WHEELS (default
#      .kits/vllm-serve), MODEL (tiny model dir).
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
PEERS=${PEERS_KIT:-$ROOT/.kits/peers}
FA3=0
if [ -f "$PEERS/setup.sh" ]; then
  # shellcheck disable=SC1091
  source "$PEERS/setup.sh" || exit 1
  FA3=1
fi
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

serve_wheels() {  # what `vllm serve` imports beyond the kit, into a folder on PYTHONPATH
  local w=${SERVE_WHEELS:-$ROOT/.kits/vllm-serve} site=/tmp/evenkv-vllm-serve
  ls "$w"/*.whl > /dev/null 2>&1 || { echo "== no wheels in $w (bash tests/e2e/serve_wheels.sh $w, here)"; return 1; }
  python3 -m pip install --quiet --no-index --no-deps --target "$site" "$w"/*.whl || return 1
  export PYTHONPATH=$site:$PYTHONPATH
}

baseline() {  # the engine's Hopper default where the peers kit brought FA3
  if [ $FA3 = 1 ]; then echo default; else echo "== no peers kit: the baseline is TRITON_ATTN" >&2; echo triton; fi
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
    hnd) model && run_step hnd 200 120 env VLLM_KV_CACHE_LAYOUT=HND python3 "$EX" "$MODEL" --graphs 1 --compare ;;
    gpt-oss) variant gpt-oss && run_step gpt-oss 240 120 python3 "$EX" "$MODEL-gpt-oss" --graphs 1 --compare ;;
    invariance) model && run_step invariance 240 100 python3 "$ROOT/tests/e2e/invariance.py" "$MODEL" \
      --engine vllm --backend evenkv ;;
    invariance-default)
      if [ $FA3 = 0 ]; then echo "== invariance-default SKIPPED (FLASH_ATTN needs the peers kit)" | tee -a "$RES"; continue; fi
      model && run_step invariance-default 240 100 python3 "$ROOT/tests/e2e/invariance.py" "$MODEL" \
        --engine vllm --backend default ;;
    spec-ngram) model && run_step spec-ngram 300 120 python3 "$EX" "$MODEL" --graphs 1 --compare --spec-ngram 3 \
      --baseline "$(baseline)" ;;
    spec-draft) model && run_step spec-draft 300 120 python3 "$EX" "$MODEL" --graphs 1 --compare --spec-draft 3 \
      --baseline "$(baseline)" ;;
    openai) model && (serve_wheels && run_step openai 300 120 python3 "$ROOT/tests/e2e/openai_server.py" "$MODEL" \
      --engine vllm --log "$L/openai-server.log") ;;
    *) echo "unknown step $s (eager | graphs | pytest | v2 | window | fp8 | hnd | gpt-oss | invariance |" \
         "invariance-default | spec-ngram | spec-draft | openai)"; exit 2 ;;
  esac
done
echo "== done in $((SECONDS - T0))s; RESULT lines in $RES"
