"""What every launcher shares: the base-2 softmax scale, launch-or-compile, parallel builds."""

import concurrent.futures
import contextlib
import functools
import hashlib
import multiprocessing
import os
import signal
import time
import warnings

from triton.runtime.driver import driver

from evenkv.checks import check_fp32_scale

try:
    from triton.runtime._async_compile import AsyncCompileMode, FutureKernel, active_mode
except ImportError:  # private to Triton: where it moves, kernels build one at a time
    AsyncCompileMode = FutureKernel = active_mode = None
try:
    from triton import knobs
    from triton._C.libtriton import native_specialize_impl as _native_specialize
except ImportError:  # private to Triton: where it moves, every launch goes through kernel[grid]
    knobs = _native_specialize = None


# Softmax runs in base 2 in every kernel: scores are scaled by sm_scale * log2(e), so
# exp2 replaces exp.
LOG2E = 1.4426950408889634


def score_scales(sm_scale: float, logit_cap: float | None, k_scale: float = 1.0) -> tuple[float, float]:
    """(qk_scale, cap_scale) for raw scores s = q . k_stored: base-2 scores are s * qk_scale, or
    with a soft-cap ``numerics.soft_cap(s, qk_scale, cap_scale)``. k_scale (an FP8 cache's
    dequantization scale) folds into qk_scale. Each must be a normal float32 in the kernels
    (ValueError naming the arguments otherwise)."""
    if logit_cap:
        scales = 2.0 * LOG2E * sm_scale * k_scale / logit_cap, logit_cap * LOG2E
    else:
        scales = sm_scale * k_scale * LOG2E, 0.0
    for value in scales:
        if value:
            check_fp32_scale("sm_scale, k_scale, logit_cap: the score scale they fold into (sm_scale x k_scale x "
                             "log2(e), over logit_cap with a soft-cap)", value)
    return scales


def launch_or_compile(kernel, grid: tuple, warmup: bool, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)`` (through ``DirectLaunches`` where it applies), or with
    ``warmup`` only compile it for these arguments' types and specialization (nothing runs;
    None under the interpreter). Returns the compiled kernel."""
    if warmup:
        return kernel.warmup(*args, grid=grid, **kwargs)
    launches = _DIRECT_LAUNCHES.get(id(kernel))
    if launches is None:
        launches = _DIRECT_LAUNCHES[id(kernel)] = DirectLaunches(kernel)
    return launches(grid, args, kwargs)


class DirectLaunches:
    """One kernel's launches, after the first of each specialization, without Triton's dispatch.

    ``kernel[grid](...)`` binds every argument, specializes each, hashes the result with the
    options and looks the binary up before it launches, in Python, on every call. For a
    decode kernel of 34 arguments and 20 constants that is most of the host time of a layer,
    and it is paid in every eagerly run step and every CUDA graph capture. Here the compiled
    kernel is kept under a key at least as fine as Triton's own: the device, the keyword
    arguments (constants and launch options, by value), Triton's debug and instrumentation
    knobs, and each runtime argument's specialization as Triton computes it
    (``native_specialize_impl`` with the parameter's own flags). A launch whose key was seen
    calls the binary's launcher with the arguments Triton would pass; any other goes through
    ``kernel[grid]`` once and is kept. What this cannot mirror (the interpreter, runtime
    parameters after a constant or passed by keyword, pre-run hooks, a Triton without these
    internals) goes through ``kernel[grid]`` every time. Not repeated: Triton's check that the
    module globals a kernel read when it compiled still hold the same values (evenkv's kernels
    read only constants)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled: dict = {}
        params = getattr(kernel, "params", None)
        self.enabled = _native_specialize is not None and params is not None and hasattr(kernel, "device_caches")
        if not self.enabled:
            return
        runtime = [p for p in params if not p.is_constexpr]
        # Triton's launcher takes every parameter in order, constants included: runtime
        # arguments, passed positionally, must all come before the first constant.
        self.enabled = all(not p.is_constexpr for p in params[:len(runtime)])
        self.flags = [(p.is_const, not p.do_not_specialize, not p.do_not_specialize_on_alignment) for p in runtime]
        self.constants = [(p.name, p.default) for p in params[len(runtime):]]

    def __call__(self, grid: tuple, args: tuple, kwargs: dict):
        if not self.enabled or len(args) != len(self.flags) or self.kernel.pre_run_hooks:
            return self.kernel[grid](*args, **kwargs)
        device = driver.active.get_current_device()
        backend = self.kernel.device_caches[device][3]
        try:
            key = (device, tuple(kwargs.items()), knobs.runtime.debug, knobs.compilation.instrumentation_mode,
                   tuple([_native_specialize(backend, arg, *flags) for arg, flags in zip(args, self.flags)]))
            entry = self.compiled.get(key)
        except TypeError:  # an unhashable keyword value: no key, Triton's own dispatch
            return self.kernel[grid](*args, **kwargs)
        if entry is None:
            compiled = self.kernel[grid](*args, **kwargs)
            self.compiled[key] = (compiled, tuple(kwargs.get(name, default) for name, default in self.constants))
            return compiled
        compiled, constants = entry
        stream = driver.active.get_current_stream(device)
        bound = (*args, *constants)
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                     compiled.function, compiled.packed_metadata, compiled.launch_metadata(grid, stream, *bound),
                     knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound)
        return compiled


# By the kernel's identity (a JITFunction hashes its source hash under a lock); each entry
# holds its kernel, so an id is never reused while its entry lives.
_DIRECT_LAUNCHES: dict[int, DirectLaunches] = {}


def compiled_kernel(kernel):
    """What ``launch_or_compile(..., warmup=True)`` returned, as a compiled kernel: inside
    ``parallel_compiles`` a held build comes back as a future (Triton's ``FutureKernel``),
    whose ``result()`` runs the held builds and returns this one."""
    result = getattr(kernel, "result", None)
    return result() if callable(result) else kernel


# A child stuck longer than this (a deadlock inherited through fork) is killed and its builds
# run in this process instead: start-up slows down but never hangs.
CHILD_BUILD_TIMEOUT_S = 600.0

BUILD_PROCESSES_ENV = "EVENKV_BUILD_PROCESSES"


def build_processes() -> int:
    """How many forked processes ``parallel_compiles`` builds in: EVENKV_BUILD_PROCESSES (1 builds
    in this process only), else the CPUs this process may run on, at most 16."""
    value = os.environ.get(BUILD_PROCESSES_ENV)
    if value is None:
        return min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 16)
    if not value.strip().isdigit() or int(value) < 1:
        raise ValueError(f"{BUILD_PROCESSES_ENV} must be a whole number >= 1, got {value!r}")
    return int(value)


@contextlib.contextmanager
def parallel_compiles(processes: int | None = None):
    """Within the block, kernels compiled by ``launch_or_compile(..., warmup=True)`` are held
    back and built together, in up to ``processes`` forked processes (default
    ``build_processes()``), when the block exits or when one's compiled kernel is first asked
    for (``compiled_kernel``). Nested use and Tritons without an async-compile mode (< 3.5)
    compile one by one."""
    if AsyncCompileMode is None or active_mode.get() is not None:
        yield
        return
    with ForkedBuilds(build_processes() if processes is None else processes):
        yield


class HeldBuild(concurrent.futures.Future):
    """A build's future that, asked for its result before the builds ran, runs them."""

    def __init__(self, mode: "ForkedBuilds"):
        super().__init__()
        self._mode = mode

    def result(self, timeout=None):
        if not self.done():
            self._mode.build_held()
        return super().result(timeout)


class ForkedBuilds(AsyncCompileMode or object):
    """Triton's async-compile mode with the builds in forked processes.

    Triton's front end and passes hold the GIL, so builds on threads finish one after another.
    Here each build Triton submits is held; ``build_held`` splits the held builds among forked
    children, each compiling its share into Triton's on-disk cache and exiting (a build for a
    given target makes no CUDA call, so the children never touch the parent's CUDA context),
    then runs every build again in this process, where it loads the children's binaries from
    that cache. The children also build each kernel's launcher (``build_with_launcher``). A build
    no child finished (a failure, a timeout, a cache that stores nothing) compiles here, raising
    its error where Triton's own mode raises it. When the cache already holds every held build
    (``in_disk_cache``), nothing forks: each is loaded here."""

    def __init__(self, processes: int):
        super().__init__(executor=None)
        self.processes = processes
        self.held: list[tuple] = []  # (compile_fn, HeldBuild)

    def submit(self, key, compile_fn, finalize_fn):
        if key in self.future_kernels:
            return self.future_kernels[key]
        future = HeldBuild(self)
        future._key = key
        self.raw_futures.append(future)
        self.held.append((compile_fn, future))
        self.future_kernels[key] = FutureKernel(finalize_fn, future)
        return self.future_kernels[key]

    def build_held(self) -> None:
        held, self.held = self.held, []
        # A warm cache makes every build a load: forking (tens of ms per child of an engine's
        # large process) would cost more than the loads.
        if (self.processes > 1 and len(held) > 1 and hasattr(os, "fork") and not _always_compile()
                and not all(in_disk_cache(future._key) for _, future in held)):
            build_in_children([functools.partial(build_with_launcher, compile_fn) for compile_fn, _ in held],
                              self.processes)
        for compile_fn, future in held:
            try:
                future.set_result(compile_fn())
            except BaseException as error:
                future.set_exception(error)

    def __exit__(self, exc_type, exc_value, traceback):
        try:
            if exc_type is None:
                self.build_held()
            return super().__exit__(exc_type, exc_value, traceback)
        finally:  # Triton's exit leaves the mode active when a build raised
            active_mode.set(None)


def build_with_launcher(compile_fn) -> None:
    """A child's build: the kernel's binary, then its launcher. Triton builds a kernel's launcher
    (a C extension for its argument signature, compiled by the host's C compiler, a few tenths of
    a second each) at its first launch, in the launching process, one after another; built in a
    child, it is in Triton's disk cache too, and that first launch only loads it."""
    compiled = compile_fn()
    if hasattr(compiled, "src") and hasattr(compiled, "metadata"):
        launcher_cls = getattr(driver.active, "launcher_cls", None)
        if launcher_cls is not None:
            launcher_cls(compiled.src, compiled.metadata)


def in_disk_cache(key: str) -> bool:
    """Whether Triton's file cache holds the build of this async-compile key (the group file
    ``triton.compile`` writes in the key's folder), so that building it is a load. False for a
    cache manager other than Triton's file cache, where that layout is unknown."""
    import triton
    from triton.runtime import cache

    folder_name = getattr(cache, "_base32", None)  # how FileCacheManager names a key's folder
    cache_knobs = triton.knobs.cache
    if (not isinstance(key, str) or cache_knobs.manager_class is not None or not cache_knobs.dir
            or folder_name is None):
        return False
    folder = os.path.join(cache_knobs.dir, folder_name(hashlib.sha256(key.encode("utf-8")).hexdigest()))
    try:
        return any(name.startswith("__grp__") for name in os.listdir(folder))
    except OSError:
        return False


def _always_compile() -> bool:
    """Whether Triton ignores its disk cache (TRITON_ALWAYS_COMPILE), so children's builds would be lost."""
    import triton
    return bool(triton.knobs.compilation.always_compile)


def build_in_children(builds: list, processes: int) -> None:
    """Run the callables ``builds`` in up to ``processes`` forked children and wait for them.
    Each child takes the next build not yet taken (a shared counter) until none is left, so a
    child done with a short build takes another while a long one runs elsewhere. What the
    builds return or raise stays in the children: their effect is Triton's disk cache."""
    next_build = multiprocessing.get_context("fork").Value("i", 0)
    children = []
    with warnings.catch_warnings():  # Python >= 3.12 warns on fork in a threaded process
        warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
        for _ in range(min(processes, len(builds))):
            pid = os.fork()
            if pid == 0:  # the child: build, then leave without running the parent's exit handlers
                try:
                    while True:
                        with next_build.get_lock():
                            index = next_build.value
                            next_build.value += 1
                        if index >= len(builds):
                            break
                        try:
                            builds[index]()
                        except BaseException:  # the parent builds it again and raises there
                            pass
                finally:
                    os._exit(0)
            children.append(pid)
    deadline = time.monotonic() + CHILD_BUILD_TIMEOUT_S
    for pid in children:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.005)
