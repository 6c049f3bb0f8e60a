# Sourced by the scripts of tests/e2e and tests/sanitizer on the GPU machine: make evenkv
# importable, and one engine entry point visible, in every process an engine spawns (they
# inherit PYTHONPATH), with nothing installed into the image. A site folder holds a link to
# the checkout's evenkv/ and a dist-info with the entry point.
#   evenkv_site SITE_DIR GROUP ENTRY      e.g. evenkv_site /tmp/s vllm.general_plugins evenkv.integrations.vllm:register
evenkv_site() {
  local site=$1 group=$2 entry=$3
  local root
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  rm -rf "$site"
  mkdir -p "$site/evenkv-0.2.0.dist-info"
  ln -s "$root/evenkv" "$site/evenkv"
  printf 'Metadata-Version: 2.1\nName: evenkv\nVersion: 0.2.0\n' > "$site/evenkv-0.2.0.dist-info/METADATA"
  printf '[%s]\nevenkv = %s\n' "$group" "$entry" > "$site/evenkv-0.2.0.dist-info/entry_points.txt"
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$site
  EVENKV_ENTRY_GROUP=$group EVENKV_ENTRY=$entry python3 - <<'PY'
import importlib.metadata as md, os, evenkv, torch
group, entry = os.environ["EVENKV_ENTRY_GROUP"], os.environ["EVENKV_ENTRY"]
eps = [e.value for e in md.entry_points(group=group)]
assert entry in eps, eps
print(f"== evenkv {evenkv.__version__} from {evenkv.__file__}; plugins {eps}; torch {torch.__version__}; "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO CUDA DEVICE'}", flush=True)
PY
}

# Shared by the e2e scripts: run_step NAME MAX_SECONDS MIN_SECONDS CMD... runs CMD with a
# timeout into $L/NAME.log, skips it if fewer than MIN_SECONDS of the caller's BUDGET
# (counted from T0) are left, and copies its RESULT lines to $RES.
left() { echo $(( BUDGET - (SECONDS - T0) )); }
run_step() {
  local name=$1 to=$2 need=$3 l; shift 3
  l=$(left)
  if [ "$l" -lt "$need" ]; then echo "== $name SKIPPED (budget: ${l}s left)" | tee -a "$RES"; return 1; fi
  [ "$to" -gt "$l" ] && to=$l
  timeout -k 10 "$to" "$@" > "$L/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc at $((SECONDS - T0))s"
  grep -E "^RESULT" "$L/$name.log" | tee -a "$RES"
  [ $rc -eq 0 ] || grep -E "Error|error:|Traceback|NotImplemented|FAIL" "$L/$name.log" | tail -12
  return $rc
}
