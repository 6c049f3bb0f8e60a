"""Start-up builds in forked processes (``evenkv.kernels.launching.ForkedBuilds``).

The mode's bookkeeping runs on stand-in builds that record which process ran them; a real
build, an evenkv kernel compiled for sm_90a on this CPU, checks that the parent loads what the
children built from Triton's disk cache instead of compiling it again.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from evenkv.kernels import launching

pytestmark = pytest.mark.skipif(launching.AsyncCompileMode is None or not hasattr(os, "fork"),
                                reason="needs Triton >= 3.5's async-compile mode and os.fork")


def _recording_build(tmp_path, name: str, fail: bool = False):
    """A stand-in build: leaves a file naming the process it ran in, returns (name, pid)."""
    def build():
        (tmp_path / f"{name}.{os.getpid()}").touch()
        if fail:
            raise RuntimeError(f"build {name} failed")
        return name, os.getpid()
    return build


def _submit(mode, key, build, finalized: list):
    return mode.submit(key, build, lambda kernel: finalized.append(kernel))


def test_builds_run_in_children_then_here(tmp_path):
    names = [f"k{i}" for i in range(5)]
    finalized = []
    with launching.ForkedBuilds(processes=3) as mode:
        futures = [_submit(mode, name, _recording_build(tmp_path, name), finalized) for name in names]
        assert not any(f.future.done() for f in futures), "builds must be held until the block ends"
    parent = os.getpid()
    assert [f.result() for f in futures] == [(name, parent) for name in names]
    assert sorted(finalized) == sorted((name, parent) for name in names)
    for name in names:
        pids = {int(p.suffix[1:]) for p in tmp_path.glob(f"{name}.*")}
        assert parent in pids and len(pids) == 2, f"{name} ran in {pids}: once in a child, once here"
    child_pids = {int(p.suffix[1:]) for p in tmp_path.iterdir()} - {parent}
    assert 1 <= len(child_pids) <= 3, "5 builds over at most 3 processes"


def test_children_take_the_next_build_when_free(tmp_path):
    """A child takes builds until none is left: while one child runs a long build, another runs
    every short one (not a fixed round-robin share that would queue short builds behind it)."""
    import time

    def build(name: str, seconds: float):
        def run():
            (tmp_path / f"{name}.{os.getpid()}").touch()
            time.sleep(seconds)
        return run

    builds = [build("long", 2.0)] + [build(f"short{i}", 0.05) for i in range(4)]
    launching.build_in_children(builds, 2)
    ran_in = {p.name.split(".")[0]: int(p.suffix[1:]) for p in tmp_path.iterdir()}
    assert len(ran_in) == 5 and os.getpid() not in ran_in.values()
    others = {pid for name, pid in ran_in.items() if name != "long"}
    assert ran_in["long"] not in others and len(others) == 1, ran_in


def test_one_process_builds_here_only(tmp_path):
    with launching.ForkedBuilds(processes=1) as mode:
        future = _submit(mode, "k", _recording_build(tmp_path, "k"), [])
    assert future.result() == ("k", os.getpid())
    assert [p.name for p in tmp_path.iterdir()] == [f"k.{os.getpid()}"]


def test_result_inside_the_block_builds_what_is_held(tmp_path):
    with launching.ForkedBuilds(processes=2) as mode:
        first = _submit(mode, "a", _recording_build(tmp_path, "a"), [])
        _submit(mode, "b", _recording_build(tmp_path, "b"), [])
        assert first.result() == ("a", os.getpid())
        assert len(list(tmp_path.glob("b.*"))) == 2, "asking for one result builds every held build"
        late = _submit(mode, "c", _recording_build(tmp_path, "c"), [])
        assert not late.future.done()
    assert late.result() == ("c", os.getpid())


def test_same_key_is_built_once(tmp_path):
    with launching.ForkedBuilds(processes=2) as mode:
        first = _submit(mode, "k", _recording_build(tmp_path, "k"), [])
        again = _submit(mode, "k", _recording_build(tmp_path, "other"), [])
    assert again is first and not list(tmp_path.glob("other.*"))


def test_a_failing_build_raises_in_the_parent(tmp_path):
    with pytest.raises(RuntimeError, match="build bad failed"):
        with launching.ForkedBuilds(processes=2) as mode:
            _submit(mode, "good", _recording_build(tmp_path, "good"), [])
            _submit(mode, "bad", _recording_build(tmp_path, "bad", fail=True), [])
    from triton.runtime._async_compile import active_mode
    assert active_mode.get() is None, "a failed batch leaves no compile mode active"


def _cache_holds(cache_dir, key: str) -> None:
    """Lay out a build of async-compile key ``key`` in a Triton file cache at ``cache_dir`` as
    ``triton.compile`` does: a group file in the folder named by the key's hash."""
    import hashlib

    from triton.runtime import cache
    folder = cache_dir / cache._base32(hashlib.sha256(key.encode("utf-8")).hexdigest())
    folder.mkdir(parents=True)
    (folder / "__grp__kernel.json").write_text("{}")


def test_a_warm_cache_loads_here_without_forking(tmp_path, monkeypatch):
    import triton
    cache_dir, marks = tmp_path / "cache", tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setattr(triton.knobs.cache, "dir", str(cache_dir))
    for name in ("a", "b", "c"):
        _cache_holds(cache_dir, name)
    assert launching.in_disk_cache("a") and not launching.in_disk_cache("d")
    with launching.ForkedBuilds(processes=3) as mode:
        futures = [_submit(mode, name, _recording_build(marks, name), []) for name in ("a", "b", "c")]
    assert [f.result() for f in futures] == [(name, os.getpid()) for name in ("a", "b", "c")]
    assert sorted(p.name for p in marks.iterdir()) == [f"{name}.{os.getpid()}" for name in ("a", "b", "c")]
    # One build missing from the cache: the held builds fork as on a cold start.
    with launching.ForkedBuilds(processes=3) as mode:
        for name in ("a", "d"):
            _submit(mode, name, _recording_build(marks, name), [])
    assert len(list(marks.glob("d.*"))) == len(list(marks.glob("a.*"))) == 2, "each in a child, then here"


def test_build_processes_knob(monkeypatch):
    monkeypatch.setenv(launching.BUILD_PROCESSES_ENV, "3")
    assert launching.build_processes() == 3
    monkeypatch.delenv(launching.BUILD_PROCESSES_ENV)
    assert 1 <= launching.build_processes() <= 16
    for bad in ("0", "-2", "four", ""):
        monkeypatch.setenv(launching.BUILD_PROCESSES_ENV, bad)
        with pytest.raises(ValueError, match=f"{launching.BUILD_PROCESSES_ENV} must be a whole number >= 1, got"):
            launching.build_processes()


# Compiles kv_write_kernel for sm_90a in three variants inside ForkedBuilds(3), with a fresh
# disk cache; prints, for each compile this process ran, whether it was a disk-cache hit.
REAL_BUILDS = textwrap.dedent("""
    import json, os, sys, tempfile
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from evenkv.kernels import launching
    from evenkv.kernels.kv_write import kv_write_kernel as kernel

    hits = []
    triton.knobs.compilation.listener = lambda *, src, cache_hit, **_: hits.append((os.getpid(), cache_hit))
    sig = {n: "*bf16" if n.endswith("_ptr") and n[0] in "kv" else "*i32" if n.endswith("_ptr") else
           "fp32" if n.endswith("scale") else "constexpr" if n.isupper() else "i32" for n in kernel.arg_names}
    target = GPUTarget("cuda", 90, 32)
    def build(heads):
        consts = dict(PAGE_SIZE=1, NUM_KV_HEADS=heads, HEAD_DIM=128, BLOCK_H=heads, BLOCK_D=128, KV_FP8=False)
        src = ASTSource(kernel, sig, {(kernel.arg_names.index(k),): v for k, v in consts.items()})
        return lambda: triton.compile(src, target=target, options={"num_warps": 4})
    with launching.ForkedBuilds(processes=3) as mode:
        futures = [mode.submit(heads, build(heads), lambda kernel: None) for heads in (1, 2, 4)]
    assert all(f.result().metadata.target.arch == 90 for f in futures)
    print(json.dumps([hit for pid, hit in hits if pid == os.getpid()]))
""")


def test_children_fill_the_disk_cache_the_parent_loads():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", REAL_BUILDS], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [True, True, True]


def test_children_build_each_kernels_launcher_too(tmp_path, monkeypatch):
    """A child builds the kernel, then its launcher (Triton's ``launcher_cls`` on the compiled
    kernel's source and metadata), so that the parent's first launch finds it in the disk cache;
    the parent itself builds no launcher. Stand-ins for the compiled kernel and the driver."""
    import types

    class Compiled:
        def __init__(self, name):
            self.src, self.metadata = f"src-{name}", f"meta-{name}"

    def launcher_cls(src, metadata):
        (tmp_path / f"launcher-{src}-{metadata}.{os.getpid()}").touch()

    monkeypatch.setattr(launching, "driver", types.SimpleNamespace(active=types.SimpleNamespace(
        launcher_cls=launcher_cls)))
    names = ["a", "b", "c"]
    with launching.ForkedBuilds(processes=2) as mode:
        futures = [_submit(mode, name, lambda name=name: Compiled(name), []) for name in names]
    assert [f.result().src for f in futures] == [f"src-{name}" for name in names]
    built = {p.name.split(".")[0]: int(p.suffix[1:]) for p in tmp_path.iterdir()}
    assert sorted(built) == [f"launcher-src-{n}-meta-{n}" for n in names]
    assert os.getpid() not in built.values(), "the launchers are built in the children, not here"
