#!/usr/bin/env bash
# Installs evenkv and everything its tests need on a fresh CPU machine, then runs the
# CPU lane: the core (kernels under the Triton interpreter, planner, API checks,
# benchmark harness) in .venv, and each engine integration against the real engine
# classes in its own venv (.venv-vllm, .venv-sglang), because vLLM 0.26 and SGLang
# 0.5.17 pin different versions of shared packages.
#
#   bash tests/run.sh            # all lanes
#   bash tests/run.sh core       # one lane: core | vllm | sglang
#
# The GPU lane is separate: `pytest -m gpu` on a CUDA machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
LANES=${*:-core vllm sglang}
ENGINE_TESTS=(tests/test_vllm_integration.py tests/test_sglang_integration.py)

for lane in $LANES; do
  case $lane in
    core)
      [ -x .venv/bin/python ] || "$PY" -m venv .venv
      # torch 2.13.0 is the CPU wheel this machine keeps on disk; [test] pins triton 3.6 and numpy < 2.4.
      .venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0" setuptools wheel
      .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-build-isolation -e ".[test,bench]"
      .venv/bin/python -m pytest -q tests $(printf -- '--ignore=%s ' "${ENGINE_TESTS[@]}")
      ;;
    vllm)
      bash tests/envs/vllm.sh .venv-vllm
      CUDA_VISIBLE_DEVICES= .venv-vllm/bin/python -m pytest -q tests/test_vllm_integration.py
      ;;
    sglang)
      bash tests/envs/sglang.sh .venv-sglang
      .venv-sglang/bin/python -m pytest -q tests/test_sglang_integration.py
      ;;
    *) echo "unknown lane: $lane (core | vllm | sglang)" >&2; exit 2 ;;
  esac
done
