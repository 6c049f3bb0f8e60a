"""Direct launches (``evenkv.kernels.launching.DirectLaunches``): when a launch may skip
Triton's dispatch, and what it then hands the compiled kernel's launcher.

A real ``JITFunction`` (built without the interpreter's switch) stands in for a kernel; its
dispatch (``run``) and the compiled kernel it returns are recorders, and the driver answers
device 0 and a fixed stream, so this runs without a GPU. The GPU lane launches the real
kernels both ways (``tests/gpu/test_decode_gpu.py``).
"""

import pytest
import torch
import triton.language as tl
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction

from evenkv.kernels import launching

pytestmark = pytest.mark.skipif(launching._native_specialize is None,
                                reason="direct launches need Triton >= 3.4's native_specialize_impl")

STREAM = 1234


def stand_in(x_ptr, n, m, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = True):
    pass


def stand_in_constant_first(BLOCK: tl.constexpr, x_ptr, n):
    pass


class CompiledStandIn:
    """What ``kernel[grid](...)`` returns: records the launches made through it."""

    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.launches = []

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args):
        self.launches.append(args)


class Driver:
    class active:
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda device: STREAM)


@pytest.fixture
def kernel(monkeypatch):
    """stand_in as a JITFunction whose dispatch records its calls and returns a new compiled kernel."""
    monkeypatch.setattr(launching, "driver", Driver)
    return _jit(stand_in)


def _jit(fn):
    kernel = JITFunction(fn, do_not_specialize=["m"])
    kernel.device_caches = {0: (None, None, None, BaseBackend, None)}
    kernel.dispatched = []

    def run(*args, grid, warmup, **kwargs):
        compiled = CompiledStandIn()
        kernel.dispatched.append((grid, args, kwargs, compiled))
        return compiled
    kernel.run = run
    return kernel


def test_a_seen_specialization_launches_the_compiled_kernel_directly(kernel):
    x = torch.zeros(64)
    launches = launching.DirectLaunches(kernel)
    first = launches((8,), (x, 32, 5, 0.5), dict(BLOCK=64, num_warps=4))
    second = launches((3,), (x, 48, 7, 0.25), dict(BLOCK=64, num_warps=4))
    assert len(kernel.dispatched) == 1 and second is first
    # Triton's launcher's arguments: grid, stream, binary, metadata, hooks, then every parameter
    # in order, the constants (FLAG by its default) included.
    (launch,) = first.launches
    assert launch[:7] == (3, 1, 1, STREAM, "fn", "meta", None)
    assert launch[9:] == (x, 48, 7, 0.25, 64, True)


@pytest.mark.parametrize("change", [
    dict(n=33),  # an int no longer divisible by 16
    dict(n=1),  # an int Triton turns into a constant
    dict(n=2 ** 31),  # a 64-bit int
    dict(x="offset"),  # a pointer no longer 16-byte aligned
    dict(x="half"),  # another dtype
    dict(BLOCK=128),  # a constant
    dict(num_warps=8),  # a launch option
])
def test_whatever_triton_specializes_on_dispatches_again(kernel, change):
    x = torch.zeros(64)
    args = dict(x=x, n=32, m=5, scale=0.5)
    kwargs = dict(BLOCK=64, num_warps=4)
    launches = launching.DirectLaunches(kernel)
    launches((1,), tuple(args.values()), kwargs)
    for name, value in change.items():
        if name == "x":
            value = x[1:] if value == "offset" else x.half()
        (args if name in args else kwargs)[name] = value
    launches((1,), tuple(args.values()), kwargs)
    assert len(kernel.dispatched) == 2


def test_an_unspecialized_int_and_a_float_do_not_dispatch_again(kernel):
    x = torch.zeros(64)
    launches = launching.DirectLaunches(kernel)
    launches((1,), (x, 32, 16, 0.5), dict(BLOCK=64))
    launches((1,), (x, 32, 17, 3.0), dict(BLOCK=64))  # m is do_not_specialize
    assert len(kernel.dispatched) == 1


def test_what_cannot_be_mirrored_goes_through_triton_every_time(kernel, monkeypatch):
    x = torch.zeros(64)
    for launches, args, kwargs in [
        (launching.DirectLaunches(kernel), (x, 32, 5), dict(scale=0.5, BLOCK=64)),  # a runtime argument by keyword
        (launching.DirectLaunches(kernel), (x, 32, 5, 0.5), dict(BLOCK=[64])),  # an unhashable keyword value
        (launching.DirectLaunches(_jit(stand_in_constant_first)), (x, 32), dict(BLOCK=64)),  # runtime after a constant
    ]:
        dispatched = launches.kernel.dispatched
        before = len(dispatched)
        for _ in range(2):
            launches((1,), args, kwargs)
        assert len(dispatched) == before + 2
        assert all(not compiled.launches for *_, compiled in dispatched)
    hooked = launching.DirectLaunches(kernel)
    monkeypatch.setattr(kernel, "pre_run_hooks", [lambda *a, **k: None])
    before = len(kernel.dispatched)
    for _ in range(2):
        hooked((1,), (x, 32, 5, 0.5), dict(BLOCK=64))
    assert len(kernel.dispatched) == before + 2


def test_the_interpreter_dispatches_every_launch():
    from triton.runtime.interpreter import InterpretedFunction

    assert not launching.DirectLaunches(InterpretedFunction(stand_in)).enabled
