#!/usr/bin/env bash
# GPU machine (H200), with the SGLang kit carried (`run` with carry [".kits/sglang"]):
# evenkv inside a real SGLang 0.5.17 engine, end to end.
#
# usage: bash tests/e2e/sglang.sh [STEP...]      (default: checks skew pytest)
#   checks  the kit's check.py on its tiny random Qwen3 (16 q / 4 kv heads, D 128, bf16):
#           evenkv and triton, eager (--graphs 0) and CUDA graphs (--graphs 1); greedy tokens and
#           logprobs vs HF transformers (ok=1), and evenkv's tokens vs triton's
#   skew    one 16K-token prompt beside 63 short ones, 64 decode steps in one batch: decode step
#           time, evenkv vs triton (tests/e2e/sglang_skew_step.py), CUDA graphs on
#   pytest  the GPU lane of tests/engines/test_sglang_integration.py (realistic SGLang pools, real CUDA
#           graph replay) plus its CPU-lane tests run on the GPU
#   fp8     tests/e2e/compare.py --compare on the tiny Qwen3 with --kv-cache-dtype fp8_e4m3: evenkv and
#           triton both over an e4m3 pool (CUDA graphs), tokens and logprobs against HF and each other
#   swa     tests/e2e/compare.py --compare on a tiny random Mellum (layer_models.py mellum: 128-token window
#           layers alternating with full ones), which SGLang serves on its hybrid SWA pool (two token pools,
#           window layers through the full->SWA mapping): evenkv and triton, CUDA graphs, prompts longer than the
#           window; tokens and logprobs against HF (ok=1) and each other
#   swa-spec-tree  the swa step's Mellum with n-gram speculation in draft trees (3 drafts, up to 2
#           branches a level): tree-masked verify rows on window layers of the hybrid pool, vs triton and HF
#   server  the HTTP server at full size through benchmarks/serving.py (evenkv only, chat workload):
#           `python -m sglang.launch_server --attention-backend evenkv` (Qwen3-30B-A3B attention shape, dummy
#           weights, CUDA graphs), 256 concurrent streaming requests on /generate, stopped by PID; start-up
#           time and the Triton kernels compiled after start-up
#   invariance  tests/e2e/invariance.py with --enable-deterministic-inference, CUDA graphs: one prompt alone,
#           among 63 others, and prefilled in 97-token chunks, evenkv: bitwise the same tokens and logprobs
#   invariance-default  the same with SGLang's fa3 (its Hopper default)
#   spec-ngram  tests/e2e/compare.py --compare with n-gram speculation (NGRAM, 3 draft tokens in a chain),
#           CUDA graphs: evenkv vs fa3 vs HF (SGLang builds its C++ n-gram cache with the image's compiler
#           on first use)
#   spec-ngram-p16  the same on pages of 16 tokens (SGLang allows n-gram trees at pages > 1 at breadth 1,
#           whose trees branch where several n-gram anchors propose different tokens)
#   spec-draft  STANDALONE speculation with the model as its own draft (3 steps in a chain), no
#           --speculative-draft-attention-backend (evenkv's plugin names triton for the draft): evenkv vs fa3 vs HF;
#           eager: SGLang 0.5.17's draft-graph capture imports its DSA backend, whose deep_gemm the kit lacks
#   spec-draft-evenkv  the same with --speculative-draft-attention-backend evenkv in evenkv's run: the
#           draft model's prefill, draft extend and decode steps on evenkv too
#   spec-draft-tree-evenkv  the same in draft trees (2 branches a step, 5 tokens verified): the draft's
#           decode steps run B x 2 rows over branch-scattered slots, verify rows carry tree masks
#   openai  the operator's path (tests/e2e/openai_server.py): `python -m sglang.launch_server
#           --attention-backend evenkv` with a tokenizer built here, 256 requests 32 at a time on
#           /v1/completions and /v1/chat/completions, streamed and not, evenkv's kernel line in the log,
#           stop by PID
# One engine's e2e set: BUDGET=360 bash tests/e2e/sglang.sh invariance spec-ngram openai
# env: BUDGET (s, default 570; a step that would not fit is skipped and says so), OUT (logs;
#      default /tmp/evenkv-sglang-e2e), SGLANG_KIT (default .kits/sglang), MODEL (tiny model dir).
# Prints RESULT lines (also in $OUT/results.txt); per-step logs in $OUT.
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
KIT=${SGLANG_KIT:-$ROOT/.kits/sglang}
L=${OUT:-/tmp/evenkv-sglang-e2e}
MODEL=${MODEL:-/tmp/evenkv-qwen3-tiny}
T0=$SECONDS
BUDGET=${BUDGET:-570}
mkdir -p "$L"
RES=$L/results.txt
: > "$RES"

if [ ! -f "$KIT/setup.sh" ]; then
  echo "no SGLang kit at $KIT (SGLANG_KIT: a folder whose setup.sh, sourced, makes SGLang importable)"; exit 1
fi
# shellcheck disable=SC1091
source "$KIT/setup.sh" || exit 1

# shellcheck disable=SC1091
source "$ROOT/tests/e2e/site.sh"
evenkv_site /tmp/evenkv-sglang-site sglang.srt.plugins evenkv.integrations.sglang:register || exit 1


tokens_vs_triton() {  # graphs: compare the prompt_len=... out=[...] lines of two check logs
  local g=$1 a=$L/check-evenkv-g$1.log b=$L/check-triton-g$1.log
  [ -f "$a" ] && [ -f "$b" ] || return 0
  python3 - "$a" "$b" "$g" <<'PY' | tee -a "$RES"
import ast, re, sys
def outs(p):
    return [ast.literal_eval(m.group(1)) for m in re.finditer(r"^prompt_len=\d+ out=(\[.*\])$", open(p).read(), re.M)]
a, b, g = outs(sys.argv[1]), outs(sys.argv[2]), sys.argv[3]
same = sum(x == y for ta, tb in zip(a, b) for x, y in zip(ta, tb))
print(f"RESULT tokens_vs_triton graphs={g} prompts_identical={sum(x == y for x, y in zip(a, b))}/{len(b)} "
      f"tokens_identical={same}/{sum(map(len, b))}")
PY
}

model() {
  [ -f "$MODEL/DONE" ] && return 0
  python3 "$KIT/make_model.py" "$MODEL" > "$L/model.log" 2>&1 || { tail "$L/model.log"; return 1; }
  echo "== model ready at $((SECONDS - T0))s"
}

step_checks() {
  model || return 1
  run_step check-evenkv-g0 170 60 python3 "$KIT/check.py" --model "$MODEL" --backend evenkv --graphs 0
  run_step check-evenkv-g1 170 60 python3 "$KIT/check.py" --model "$MODEL" --backend evenkv --graphs 1
  run_step check-triton-g1 150 60 python3 "$KIT/check.py" --model "$MODEL" --backend triton --graphs 1
  run_step check-triton-g0 150 60 python3 "$KIT/check.py" --model "$MODEL" --backend triton --graphs 0
  tokens_vs_triton 0
  tokens_vs_triton 1
}

step_skew() {
  local m32=$MODEL-ctx32k
  model || return 1
  # The tiny model declares 4096 positions; the 16K prompt needs more (RoPE is position-agnostic).
  python3 - "$MODEL" "$m32" <<'PY' || return 1
import json, os, sys
src, dst = sys.argv[1:]
os.makedirs(dst, exist_ok=True)
for f in os.listdir(src):
    if f != "config.json" and not os.path.exists(os.path.join(dst, f)):
        os.symlink(os.path.join(src, f), os.path.join(dst, f))
cfg = json.load(open(os.path.join(src, "config.json")))
cfg["max_position_embeddings"] = 32768
json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=1)
PY
  run_step skew-evenkv 170 90 python3 "$ROOT/tests/e2e/sglang_skew_step.py" run --model "$m32" --backend evenkv \
    --json "$L/skew-evenkv.json"
  run_step skew-triton 170 90 python3 "$ROOT/tests/e2e/sglang_skew_step.py" run --model "$m32" --backend triton \
    --json "$L/skew-triton.json"
  if [ -f "$L/skew-evenkv.json" ] && [ -f "$L/skew-triton.json" ]; then
    python3 "$ROOT/tests/e2e/sglang_skew_step.py" compare "$L/skew-evenkv.json" "$L/skew-triton.json" | tee -a "$RES"
  fi
}

step_pytest() {
  (cd "$ROOT" && run_step pytest-sglang 400 60 python3 -m pytest -q -rs -p no:cacheprovider -m "gpu or not gpu" \
    tests/engines/test_sglang_integration.py)
  tail -3 "$L/pytest-sglang.log" 2>/dev/null | sed 's/^/   /'
}

step_fp8() {
  model || return 1
  run_step fp8 330 200 python3 "$ROOT/tests/e2e/compare.py" "$MODEL" --engine sglang --graphs 1 --compare \
    --kv-cache-dtype fp8_e4m3
}

step_swa() {  # [name extra-compare-args...]
  local name=${1:-swa} m=$MODEL-mellum-swa
  shift $(($# > 0 ? 1 : 0))
  if [ ! -f "$m/config.json" ]; then
    python3 "$ROOT/tests/e2e/layer_models.py" mellum "$m" > "$L/swa-model.log" 2>&1 || { tail "$L/swa-model.log"; return 1; }
  fi
  run_step "$name" 330 200 python3 "$ROOT/tests/e2e/compare.py" "$m" --engine sglang --graphs 1 --compare "$@"
}

step_server() {
  (cd "$ROOT" && run_step server 300 200 python3 -m benchmarks.serving sglang --backends evenkv --workloads chat \
    --out "$L/server" --budget 280 --min-child 200)
  grep -E "^\| sglang" "$L/server/summary.md" 2>/dev/null | sed 's/^/   /'
}

for s in ${@:-checks skew pytest}; do
  case $s in
    checks) step_checks ;;
    skew) step_skew ;;
    pytest) step_pytest ;;
    server) step_server ;;
    fp8) step_fp8 ;;
    swa) step_swa ;;
    swa-spec-tree) step_swa swa-spec-tree --spec-ngram 3 --spec-breadth 2 ;;
    invariance) model && run_step invariance 240 100 python3 "$ROOT/tests/e2e/invariance.py" "$MODEL" \
      --engine sglang --backend evenkv ;;
    invariance-default) model && run_step invariance-default 240 100 python3 "$ROOT/tests/e2e/invariance.py" \
      "$MODEL" --engine sglang --backend default ;;
    spec-ngram) model && run_step spec-ngram 330 150 python3 "$ROOT/tests/e2e/compare.py" "$MODEL" --engine sglang \
      --graphs 1 --compare --spec-ngram 3 --baseline default ;;
    spec-ngram-p16) model && run_step spec-ngram-p16 330 150 python3 "$ROOT/tests/e2e/compare.py" "$MODEL" \
      --engine sglang --graphs 1 --compare --spec-ngram 3 --page-size 16 --baseline default ;;
    spec-draft) model && run_step spec-draft 330 150 python3 "$ROOT/tests/e2e/compare.py" "$MODEL" --engine sglang \
      --graphs 0 --compare --spec-draft 3 --baseline default ;;
    spec-draft-evenkv) model && run_step spec-draft-evenkv 330 150 python3 "$ROOT/tests/e2e/compare.py" "$MODEL" \
      --engine sglang --graphs 0 --compare --spec-draft 3 --draft-attention evenkv --baseline default ;;
    spec-draft-tree-evenkv) model && run_step spec-draft-tree-evenkv 330 150 python3 "$ROOT/tests/e2e/compare.py" \
      "$MODEL" --engine sglang --graphs 0 --compare --spec-draft 3 --spec-breadth 2 --draft-attention evenkv \
      --baseline default ;;
    openai) model && run_step openai 300 120 python3 "$ROOT/tests/e2e/openai_server.py" "$MODEL" --engine sglang \
      --log "$L/openai-server.log" ;;
    *) echo "unknown step $s (checks | skew | pytest | fp8 | swa | swa-spec-tree | server | invariance | invariance-default |" \
         "spec-ngram | spec-ngram-p16 | spec-draft | spec-draft-evenkv | spec-draft-tree-evenkv | openai)"; exit 2 ;;
  esac
done
echo "== done in $((SECONDS - T0))s; RESULT lines in $RES"
