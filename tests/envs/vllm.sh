#!/usr/bin/env bash
# CPU test environment for the vLLM integration (tests/engines/test_vllm_integration.py).
#
#   bash tests/envs/vllm.sh VENV_DIR        # e.g. .venv-vllm (git-ignored)
#   VENV_DIR/bin/python -m pytest tests/engines/test_vllm_integration.py
#
# Makes a venv with the CPU torch 2.13.0 wheel, triton 3.6 (its interpreter runs the
# kernels on CPU with TRITON_INTERPRET=1), numpy < 2.4 (2.4 breaks that interpreter),
# vLLM 0.26.0 installed with --no-deps (its pins name CUDA torch 2.11 and flashinfer,
# which a CPU machine neither has nor needs) plus the pure-Python packages its
# interface modules import, and this repo as an editable install, so the
# `vllm.general_plugins` entry point is visible to `load_general_plugins()`.
# Idempotent: rerunning it on an existing venv only installs what is missing.
# Knobs: PYTHON (default python3), VLLM_VERSION (default 0.26.0; 0.33.0 is the other
# version checked).
set -euo pipefail

if [ $# -ne 1 ]; then
  echo "usage: bash tests/envs/vllm.sh VENV_DIR" >&2
  exit 2
fi
VENV=$1
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-python3}
VLLM_VERSION=${VLLM_VERSION:-0.26.0}
t0=$SECONDS

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)

# 1. torch first, alone (pip takes a local wheel where the machine keeps one, else the registry's).
"${PIP[@]}" "torch==2.13.0"

# 2. Test tools and the pure-Python modules vLLM's interface modules import
#    (installed *with* their deps, never --no-deps:
#    transformers/huggingface_hub/pydantic-core mismatch otherwise).
"${PIP[@]}" "torch==2.13.0" "triton==3.6.0" "numpy<2.4" "pytest>=8" "hypothesis>=6.100" \
  "transformers==5.12.1" \
  orjson psutil pybase64 requests packaging pillow starlette fastapi uvicorn tqdm \
  pydantic aiohttp msgspec pyzmq dill openai partial-json-parser "xgrammar==0.2.1" \
  sentencepiece einops compressed-tensors loguru gguf cachetools cbor2 cloudpickle \
  "llguidance>=1.7,<1.8" openai-harmony opentelemetry-api prometheus-client py-cpuinfo \
  uvloop setproctitle "setuptools>=68" wheel

# 3. vLLM itself without its (CUDA) pins, then evenkv as an editable install.
"${PIP[@]}" --no-deps "vllm==$VLLM_VERSION"
"${PIP[@]}" --no-deps --no-build-isolation -e "$REPO"

# 4. Smoke check: the plugin's entry point is visible and the vLLM interface imports work.
CUDA_VISIBLE_DEVICES= "$VENV/bin/python" - <<'PY'
import importlib.metadata as md
eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "evenkv"]
assert eps, "evenkv's vllm.general_plugins entry point is not installed"
import numpy, torch, triton, vllm
from vllm.v1.attention.backend import AttentionBackend  # noqa: F401
print(f"[tests/envs/vllm.sh] ok: vllm {vllm.__version__}, torch {torch.__version__}, "
      f"triton {triton.__version__}, numpy {numpy.__version__}, entry point {eps[0].value}")
PY
echo "[tests/envs/vllm.sh] venv $VENV ready in $((SECONDS - t0)) s"
