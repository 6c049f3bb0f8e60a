#!/usr/bin/env bash
# The main job, on any machine.
#   GPU (nvidia-smi sees one): installs evenkv into the current Python (which must have a
#     CUDA torch), runs the quick decode benchmark (evenkv beside every peer that imports;
#     results under benchmarks/results/), then examples/offline_generate.py when MODEL
#     points at an HF checkpoint (ENGINE=sglang|vllm, that engine installed).
#   CPU: makes .venv with the CPU torch, runs a tiny Triton-interpreter decode against the
#     fp32 reference and says that it is an interpreter demo with no performance meaning.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  python3 -m pip install --quiet -e ".[bench]"
  evenkv demo
  if [ -n "${MODEL:-}" ]; then
    python3 examples/offline_generate.py "$MODEL" --engine "${ENGINE:-sglang}" --compare --skewed
  else
    echo "demo.sh: set MODEL=<HF checkpoint dir> (and ENGINE=sglang|vllm) to also run examples/offline_generate.py"
  fi
else
  [ -x .venv/bin/python ] || python3 -m venv .venv
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0" setuptools wheel
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-build-isolation -e ".[test,bench]"
  .venv/bin/evenkv demo
fi
