"""What every launcher shares: the base-2 softmax scale and launch-or-compile."""

# Softmax runs in base 2 in every kernel: scores are scaled by sm_scale * log2(e), so
# exp2 replaces exp.
LOG2E = 1.4426950408889634


def launch_or_compile(kernel, grid: tuple, warmup: bool, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, or with ``warmup`` only compile it for these
    arguments' types and specialization (nothing runs; None under the interpreter).
    Returns the compiled kernel."""
    if warmup:
        return kernel.warmup(*args, grid=grid, **kwargs)
    return kernel[grid](*args, **kwargs)
