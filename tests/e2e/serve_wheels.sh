#!/usr/bin/env bash
# CPU machine: download the wheels `vllm serve` needs beyond the vLLM device kit (built for
# `vllm.LLM`) and the GPU image, into DEST (git-ignored; carry it beside the kit). On the GPU,
# tests/e2e/vllm.sh's `openai` step installs them into a folder on PYTHONPATH.
#   bash tests/e2e/serve_wheels.sh .kits/vllm-serve
# What the kit lacks for the server, found by importing vllm.entrypoints.* and building the
# app with only the kit's packages and the image's: uvicorn, watchfiles (the one compiled
# wheel: cp310-abi3, fits the image's Python 3.12), model-hosting-container-standards,
# jmespath, prometheus-fastapi-instrumentator. Their own dependencies are on the image.
set -euo pipefail
[ $# -eq 1 ] || { sed -n '2,9p' "$0"; exit 2; }
DEST=$1
mkdir -p "$DEST"
printf '*\n' > "$DEST/.gitignore"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DEST" \
  "uvicorn==0.54.0" "watchfiles==1.3.0" "model-hosting-container-standards==0.1.16" "jmespath==1.1.0" \
  "prometheus-fastapi-instrumentator==8.1.0"
ls "$DEST"/*.whl | sed 's|^|  |'
echo "[serve_wheels] $(du -sh "$DEST" | cut -f1) in $DEST; carry it with the vLLM kit (SERVE_WHEELS=$DEST on the GPU)"
