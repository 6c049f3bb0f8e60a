#!/usr/bin/env bash
# Installs evenkv and everything its tests need on a fresh CPU machine, then runs the
# CPU lanes: the core (kernels under the Triton interpreter, planner, API checks,
# benchmark harnesses) in .venv, and each engine integration against the real engine
# classes in its own venv (.venv-vllm, .venv-sglang), because vLLM and SGLang pin
# different versions of shared packages.
#
#   bash tests/run.sh            # all lanes
#   bash tests/run.sh core       # one lane: core | vllm | sglang
#
# Venvs go in the checkout (core ~1.7 GB, vllm ~2.8 GB, sglang ~2.2 GB); EVENKV_VENVS=DIR
# puts them in DIR instead. The GPU lanes are separate: `pytest -m gpu tests/gpu` on a CUDA
# machine, tests/sanitizer/run.sh and tests/e2e/*.sh on the device.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
VENVS=${EVENKV_VENVS:-.}
LANES=${*:-core vllm sglang}
step() { echo "[tests/run.sh $(date +%H:%M:%S)] $*"; }

for lane in $LANES; do
  t0=$SECONDS
  case $lane in
    core)
      venv=$VENVS/.venv
      step "core lane: venv $venv"
      [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
      # torch 2.13.0: the CPU lane's pin (pip takes a local wheel where the machine has one,
      # else the registry's); [test] pins triton 3.6 and numpy < 2.4 (2.4 breaks its interpreter).
      step "installing torch 2.13.0 and evenkv[test,bench]"
      "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "torch==2.13.0" setuptools wheel
      "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-build-isolation -e ".[test,bench]"
      step "pytest (kernels under the interpreter: about 2 minutes)"
      "$venv/bin/python" -m pytest -q tests --ignore=tests/engines
      ;;
    vllm)
      step "vLLM lane: venv $VENVS/.venv-vllm"
      bash tests/envs/vllm.sh "$VENVS/.venv-vllm"
      step "pytest tests/engines/test_vllm_integration.py"
      CUDA_VISIBLE_DEVICES= "$VENVS/.venv-vllm/bin/python" -m pytest -q tests/engines/test_vllm_integration.py
      ;;
    sglang)
      step "SGLang lane: venv $VENVS/.venv-sglang"
      bash tests/envs/sglang.sh "$VENVS/.venv-sglang"
      step "pytest tests/engines/test_sglang_integration.py"
      "$VENVS/.venv-sglang/bin/python" -m pytest -q tests/engines/test_sglang_integration.py
      ;;
    *) echo "unknown lane: $lane (core | vllm | sglang)" >&2; exit 2 ;;
  esac
  step "$lane lane passed in $((SECONDS - t0)) s"
done
