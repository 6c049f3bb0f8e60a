#!/usr/bin/env bash
# The main job, on any machine.
#   GPU (nvidia-smi sees one): installs evenkv into the current Python (which must have a
#     CUDA torch), runs `python -m evenkv demo` (checks and times two 256K-token batches),
#     the quick decode benchmark against every peer that imports (results under
#     benchmarks/results/), then examples/offline_generate.py when MODEL names a checkpoint
#     (ENGINE=vllm|sglang, that engine installed).
#   CPU: makes .venv (torch's CPU-capable wheel, about 1.7 GB), runs a tiny decode under the
#     Triton interpreter against the fp32 reference and says that it has no performance meaning.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
step() { echo "[demo.sh $(date +%H:%M:%S)] $*"; }
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  step "GPU: $(nvidia-smi -L | head -1)"
  step "installing evenkv into $(command -v python3) (editable, with the benchmark extras)"
  python3 -m pip install --quiet -e ".[bench]"
  step "python -m evenkv demo"
  python3 -m evenkv demo
  step "quick decode benchmark (python -m benchmarks.decode_imbalance --quick); peers that do not import are listed and skipped"
  python3 -m benchmarks.decode_imbalance --quick
  if [ -n "${MODEL:-}" ]; then
    step "examples/offline_generate.py $MODEL --engine ${ENGINE:-vllm}"
    python3 examples/offline_generate.py "$MODEL" --engine "${ENGINE:-vllm}"
  else
    step "set MODEL=<checkpoint> (and ENGINE=vllm|sglang) to also run examples/offline_generate.py"
  fi
else
  VENV=${EVENKV_VENVS:-.}/.venv
  step "no GPU: the Triton-interpreter demo, in $VENV"
  [ -x "$VENV/bin/python" ] || { step "creating $VENV"; python3 -m venv "$VENV"; }
  step "installing torch 2.13.0 (first time: a large download unless pip finds a local wheel)"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "torch==2.13.0" setuptools wheel
  step "installing evenkv with its test extras (triton 3.6, numpy < 2.4)"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-build-isolation -e ".[test,bench]"
  step "python -m evenkv demo"
  "$VENV/bin/python" -m evenkv demo
fi
