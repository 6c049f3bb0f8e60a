"""Test lanes.

CPU lane (default): without a CUDA device the Triton interpreter runs every kernel
(TRITON_INTERPRET=1 is set here, before anything imports triton); tiny shapes.
GPU lane: ``pytest -m gpu`` on a CUDA machine; realistic shapes. The default
``-m 'not gpu'`` (pyproject) runs the CPU lane, which also runs on a GPU machine
(then on the GPU, compiled).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the CPU-lane tests put their tensors: the GPU if there is one, else the CPU (interpreter)."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
