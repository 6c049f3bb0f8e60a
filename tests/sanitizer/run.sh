#!/usr/bin/env bash
# GPU machine (H200): compute-sanitizer over evenkv's kernels at tiny sizes.
#
# usage: bash tests/sanitizer/run.sh [STEP...]      (default: plain memcheck racecheck)
#   1. plain run of tests/sanitizer/cases.py all (checks the results, fills the Triton cache
#      so the sanitized runs do not JIT-compile under instrumentation)
#   2. memcheck over `sanitizer_cases.py all`: decode (every policy), merge, KV write,
#      extend, mixed; every Triton and torch kernel of the run is instrumented
#   3. racecheck over `sanitizer_cases.py persistent`, instrumenting only the persistent
#      decode kernels (decode_stream_kernel, decode_units_kernel)
# env: OUT (logs and summary; default /tmp), COMPUTE_SANITIZER (binary; default from PATH
#      or /usr/local/cuda*/bin), SAN_TIMEOUT (s per sanitized run; default 330 memcheck,
#      200 racecheck, so all three steps fit one 10-minute device call).
# Writes $OUT/sanitizer-{plain,memcheck,racecheck}.log and appends to $OUT/sanitizer-summary.txt
# (the "ERROR SUMMARY" / "RACECHECK SUMMARY" lines); exits non-zero on any error, on a missing
# summary line or on a failed case.
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
L=${OUT:-/tmp}
mkdir -p "$L"
SUM=$L/sanitizer-summary.txt
echo "== gpu_sanitizer.sh ${*:-plain memcheck racecheck} at $(date -u +%FT%TZ)" >> "$SUM"

SAN=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || ls -d /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | sort -V | tail -1)}
if [ -z "$SAN" ] || [ ! -x "$SAN" ]; then echo "compute-sanitizer not found" | tee -a "$SUM"; exit 1; fi
echo "== $("$SAN" --version | tail -1)" | tee -a "$SUM"

# evenkv importable without pip: the site folder of the e2e scripts (the entry point is a
# placeholder the helper requires; nothing loads it).
# shellcheck disable=SC1091
source "$ROOT/tests/e2e/site.sh"
evenkv_site /tmp/evenkv-sanitizer-site evenkv.sanitizer evenkv:DecodeAttention || exit 1

export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/evenkv-sanitizer-triton-cache}
export PYTHONUNBUFFERED=1
CASES="$ROOT/tests/sanitizer/cases.py"
fail=0

# Sanitized runs: torch's caching allocator off, so memcheck sees each torch allocation's
# real bounds (an out-of-range read inside a cached block would otherwise pass). CUDA API
# errors (probes by torch / the driver) are not reported: the summary counts kernel errors.
run_tool() {
  local tool=$1 what=$2 log=$L/sanitizer-$1.log; shift 2
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -k 10 "$SAN_TIMEOUT" \
    "$SAN" --tool "$tool" --report-api-errors no --print-limit 100 --error-exitcode 3 "$@" \
    python3 "$CASES" "$what" > "$log" 2>&1
  local rc=$?
  local lines
  lines=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log")
  echo "== $tool ($what) rc=$rc: $(grep -c '^CASE ok' "$log") cases ok; $(grep '^CASES OK' "$log")" | tee -a "$SUM"
  if [ -z "$lines" ]; then
    echo "   no summary line in $log" | tee -a "$SUM"; tail -20 "$log"; return 1
  fi
  echo "$lines" | sed 's/^/   /' | tee -a "$SUM"
  if [ $rc -ne 0 ] || echo "$lines" | grep -qE "ERROR SUMMARY: [1-9]|\([1-9][0-9]* errors?"; then
    grep -m 20 -E "Invalid|Race|Hazard|hazard|Error|error|Traceback|Assertion" "$log"
    return 1
  fi
  return 0
}

step_plain() {  # results vs the fp32 oracles; warms the Triton cache
  python3 "$CASES" all > "$L/sanitizer-plain.log" 2>&1
  local rc=$?
  echo "== plain rc=$rc: $(grep -c '^CASE ok' "$L/sanitizer-plain.log") cases ok; $(grep '^CASES OK' "$L/sanitizer-plain.log")" | tee -a "$SUM"
  [ $rc -eq 0 ] || { tail -20 "$L/sanitizer-plain.log"; return 1; }
}

for s in ${@:-plain memcheck racecheck}; do
  case $s in
    plain) step_plain || fail=1 ;;
    # --padding: guard bytes after each allocation, so short overruns land in checked memory
    memcheck) SAN_TIMEOUT=${SAN_TIMEOUT:-330} run_tool memcheck all --padding 512 || fail=1 ;;
    # the hostile batch data alone (out-of-range page ids, lengths, slots, query ranges)
    hostile) SAN_TIMEOUT=${SAN_TIMEOUT:-200} run_tool memcheck hostile --padding 512 || fail=1 ;;
    racecheck) SAN_TIMEOUT=${SAN_TIMEOUT:-200} run_tool racecheck persistent --racecheck-report all \
                 --kernel-name "regex=decode_(stream|units)_kernel" || fail=1 ;;
    *) echo "unknown step $s (plain | memcheck | racecheck | hostile)"; exit 2 ;;
  esac
done

echo "== sanitizer $([ $fail -eq 0 ] && echo PASSED || echo FAILED); summary in $SUM" | tee -a "$SUM"
exit $fail
