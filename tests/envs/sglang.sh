#!/usr/bin/env bash
# CPU test venv for the SGLang integration: real SGLang classes on CPU torch.
#
# usage: bash tests/envs/sglang.sh VENV_DIR
#   then: VENV_DIR/bin/python -m pytest tests/engines/test_sglang_integration.py
#   (the test puts tests/stubs on sys.path itself; to import sglang by hand, set
#   PYTHONPATH=tests/stubs TRITON_INTERPRET=1.)
#
# torch 2.13.0: pip takes a local wheel where the machine keeps one, else the registry's; the
# engine pins torch==2.11.0 and flashinfer, hence --no-deps for sglang.
# numpy < 2.4: numpy 2.4 breaks triton 3.6's interpreter. Idempotent: re-running on an
# existing venv only re-checks the pins. Takes ~1.5 min and ~2.3 GB on a fresh machine.
set -euo pipefail

VENV=${1:?usage: bash tests/envs/sglang.sh VENV_DIR}
SGLANG_VERSION=${EVENKV_SGLANG_VERSION:-0.5.17}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-python3}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" "triton==3.6.0" "numpy<2.4" pytest hypothesis \
  "transformers==5.12.1" \
  orjson psutil pybase64 requests packaging pillow starlette fastapi uvicorn tqdm ipython \
  pydantic aiohttp msgspec pyzmq dill openai partial-json-parser "xgrammar==0.2.1" \
  sentencepiece einops compressed-tensors loguru gguf cachetools cbor2 cloudpickle \
  "llguidance>=1.7,<1.8" openai-harmony opentelemetry-api prometheus-client py-cpuinfo \
  uvloop setproctitle setuptools wheel
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
# --no-build-isolation: setuptools is already in the venv, so no build env has to be fetched.
"${PIP[@]}" --no-deps --no-build-isolation -e "$ROOT"

# Smoke check: sglang's interface modules import (with the torchvision stub) and the plugin
# entry point is visible.
PYTHONPATH="$ROOT/tests/stubs${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import sglang
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend  # noqa: F401
eps = [e for e in md.entry_points(group="sglang.srt.plugins") if e.name == "evenkv"]
assert eps, "evenkv's sglang.srt.plugins entry point is not installed"
print(f"[sglang env] sglang {sglang.__version__}; entry point {eps[0].value}")
PY
