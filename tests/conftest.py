"""Test lanes.

CPU lane (default, what CI runs): without a CUDA device every kernel runs in Triton's
interpreter, on tiny shapes. Triton reads ``TRITON_INTERPRET`` once, when the kernels are
defined, so the switch is made here, before anything imports triton. GPU lane:
``pytest -m gpu tests/gpu`` on a CUDA machine, realistic shapes. The default
``-m 'not gpu'`` (pyproject) also runs on a GPU machine, then compiled.

Markers: ``gpu`` needs a CUDA device; ``interpreter`` checks behaviour of the interpreter
lane itself and is skipped when the kernels are compiled.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402

from evenkv.configs import is_interpreter  # noqa: E402
from evenkv.kernels import decode_launch, extend_launch, plan_launch  # noqa: E402
from helpers import Recorder  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if is_interpreter():
        return
    skip = pytest.mark.skip(reason="interpreter lane only (the kernels are compiled here)")
    for item in items:
        if "interpreter" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where lane-agnostic tests put their tensors: the GPU when the kernels are compiled,
    else the CPU (interpreter)."""
    if is_interpreter():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def no_tf32():
    """fp32 oracles computed in true fp32 on a GPU (torch may use TF32 for fp32 matmuls)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.fixture
def recorder(monkeypatch):
    """Records every launch's specialization key instead of launching (``helpers.Recorder``).
    Nothing is built, so on a GPU a grid cannot come from a built kernel's occupancy: one CTA
    per SM stands in for it."""
    rec = Recorder()
    monkeypatch.setattr(decode_launch, "resident_ctas_per_sm", lambda kernel, device: 1)
    monkeypatch.setattr(decode_launch, "launch_or_compile", rec)
    monkeypatch.setattr(extend_launch, "launch_or_compile", rec)
    monkeypatch.setattr(plan_launch, "launch_or_compile", rec)
    return rec


@pytest.fixture
def compiles():
    """``module.name`` of each kernel specialization Triton builds while the fixture is active."""
    seen = []

    def hook(*, fn, **kwargs):
        seen.append(f"{fn.module}.{fn.name}")
        return None

    old = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = hook
    yield seen
    triton.knobs.runtime.jit_post_compile_hook = old
