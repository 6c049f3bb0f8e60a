"""What every launcher shares: the base-2 softmax scale, launch-or-compile, parallel builds."""

import concurrent.futures
import contextlib

# Softmax runs in base 2 in every kernel: scores are scaled by sm_scale * log2(e), so
# exp2 replaces exp.
LOG2E = 1.4426950408889634


def score_scales(sm_scale: float, logit_cap: float | None, k_scale: float = 1.0) -> tuple[float, float]:
    """(qk_scale, cap_scale) for raw scores s = q . k_stored: base-2 scores are s * qk_scale, or
    with a soft-cap ``numerics.soft_cap(s, qk_scale, cap_scale)``. k_scale (an FP8 cache's
    dequantization scale) folds into qk_scale."""
    if logit_cap:
        return 2.0 * LOG2E * sm_scale * k_scale / logit_cap, logit_cap * LOG2E
    return sm_scale * k_scale * LOG2E, 0.0


def launch_or_compile(kernel, grid: tuple, warmup: bool, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, or with ``warmup`` only compile it for these
    arguments' types and specialization (nothing runs; None under the interpreter).
    Returns the compiled kernel."""
    if warmup:
        return kernel.warmup(*args, grid=grid, **kwargs)
    return kernel[grid](*args, **kwargs)


def compiled_kernel(kernel):
    """What ``launch_or_compile(..., warmup=True)`` returned, as a compiled kernel: inside
    ``parallel_compiles`` a build still in flight comes back as a future (Triton's
    ``FutureKernel``), whose ``result()`` waits for it."""
    result = getattr(kernel, "result", None)
    return result() if callable(result) else kernel


@contextlib.contextmanager
def parallel_compiles(workers: int = 8):
    """Within the block, kernels compiled by ``launch_or_compile(..., warmup=True)`` build on
    ``workers`` threads (Triton's async-compile mode; the builds wait in ptxas and LLVM, not in
    Python), and all are done when the block exits. Nested use and Tritons without the mode
    compile one by one."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode, active_mode
    except ImportError:  # Triton < 3.5
        yield
        return
    if active_mode.get() is not None:
        yield
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool, AsyncCompileMode(pool):
        yield
