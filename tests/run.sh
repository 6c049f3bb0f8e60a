#!/usr/bin/env bash
# Installs evenkv and everything its tests need on a fresh CPU machine, then runs the
# CPU lanes: the core (kernels under the Triton interpreter, planner, API checks,
# benchmark harnesses) in .venv, and each engine integration against the real engine
# classes in its own venv (.venv-vllm, .venv-sglang), because vLLM and SGLang pin
# different versions of shared packages.
#
#   bash tests/run.sh            # all lanes
#   bash tests/run.sh core       # one lane: core | vllm | vllm-0.33 | sglang | sglang-0.5.23
#
# The engine lanes run the oldest and the newest engine release the extras allow (vLLM 0.26.0
# and 0.33.0, SGLang 0.5.17 and 0.5.23). Venvs go in the checkout (core ~1.8 GB, each vLLM
# ~2.9 GB, each SGLang ~2.3 GB); EVENKV_VENVS=DIR puts them in DIR instead. The GPU lanes are separate: `pytest -m gpu tests/gpu` on a CUDA
# machine, tests/sanitizer/run.sh and tests/e2e/*.sh on the device.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
VENVS=${EVENKV_VENVS:-.}
LANES=${*:-core vllm vllm-0.33 sglang sglang-0.5.23}
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
      step "pytest (kernels under the interpreter: about 22 minutes on 2 cores)"
      "$venv/bin/python" -m pytest -q tests --ignore=tests/engines
      ;;
    vllm|vllm-0.33)
      venv=$VENVS/.venv-$lane
      version=$([ "$lane" = vllm ] && echo 0.26.0 || echo 0.33.0)
      step "vLLM $version lane: venv $venv"
      VLLM_VERSION=$version bash tests/envs/vllm.sh "$venv"
      step "pytest tests/engines/test_vllm_integration.py (vLLM $version)"
      CUDA_VISIBLE_DEVICES= "$venv/bin/python" -m pytest -q tests/engines/test_vllm_integration.py
      ;;
    sglang|sglang-0.5.23)
      venv=$VENVS/.venv-$lane
      version=$([ "$lane" = sglang ] && echo 0.5.17 || echo 0.5.23)
      step "SGLang $version lane: venv $venv"
      EVENKV_SGLANG_VERSION=$version bash tests/envs/sglang.sh "$venv"
      step "pytest tests/engines/test_sglang_integration.py (SGLang $version)"
      "$venv/bin/python" -m pytest -q tests/engines/test_sglang_integration.py
      ;;
    *) echo "unknown lane: $lane (core | vllm | vllm-0.33 | sglang | sglang-0.5.23)" >&2; exit 2 ;;
  esac
  step "$lane lane passed in $((SECONDS - t0)) s"
done
