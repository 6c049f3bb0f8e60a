"""Every per-architecture kernel configuration of evenkv, and the probe that picks a table.

Tables:

* decode (``decode_config``): one row per head-dim class (<= 64, <= 128, 256), plus a
  second row for batches of many short segments (``many_segments_config``);
* extend / prefill (``extend_config``): one row per head-dim class, shrunk for short batches.

The arch is ``"sm80"`` (A100-class: SM80/86/89) or ``"sm90"`` (Hopper). An explicit
``arch=`` argument, else ``EVENKV_ARCH=sm80|sm90``, else one cached probe of the device
picks it; the Triton interpreter uses ``sm90``. Each table runs anywhere: an sm80 row runs
on Hopper (slower), and the CPU lane tests both under the interpreter.

Each row names the measurement behind it (a section of ``docs/tuning.md``). The decode
kernels' persistent grid is not in the table: it is the SM count times the resident CTAs
per SM that the compiled kernel's registers and shared memory allow, capped by
``max_ctas_per_sm`` (``evenkv.kernels.decode_launch.persistent_grid``).
"""

import functools
import os
from dataclasses import dataclass, replace

import torch

ARCHES = ("sm80", "sm90")


def is_interpreter() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def env_flag(name: str, value: bool | None = None) -> bool:
    """An explicit argument (None or a bool) wins; else the environment variable (anything but
    "" / "0" is on)."""
    if value is not None and not isinstance(value, bool):
        argument = name.removeprefix("EVENKV_").lower()
        raise TypeError(f"{argument}: expected None (then {name}) or a bool, got {value!r}")
    return value if value is not None else os.environ.get(name, "0") not in ("", "0")


def debug_enabled(debug: bool | None) -> bool:
    """Host-side data checks before each launch (syncs): an explicit ``debug``, else EVENKV_DEBUG."""
    return env_flag("EVENKV_DEBUG", debug)


def graph_capturing() -> bool:
    """True while the current CUDA stream records a graph (False on machines without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_arch(arch: str) -> str:
    if arch not in ARCHES:
        raise ValueError(f"arch: expected one of {ARCHES}, got {arch!r}")
    return arch


@functools.lru_cache(maxsize=None)
def _probe_arch(device_index: int) -> str:
    major, _ = torch.cuda.get_device_capability(device_index)
    return "sm90" if major >= 9 else "sm80"


def resolve_arch(arch: str | None, device: torch.device) -> str:
    """The config family for ``device``: explicit ``arch``, else EVENKV_ARCH, else the probe
    (``sm90`` under the interpreter)."""
    chosen = arch if arch is not None else os.environ.get("EVENKV_ARCH") or None
    if chosen is not None:
        return check_arch(chosen)
    if device.type != "cuda" or is_interpreter():
        return "sm90"
    return _probe_arch(device.index if device.index is not None else torch.cuda.current_device())


# Under the interpreter there are no SMs: a small fake count makes the schedules cut
# requests (and so exercise the merges) on tiny test batches.
INTERPRETER_SMS = 2


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The SM count of a CUDA device (INTERPRETER_SMS for the CPU under the interpreter)."""
    if device.type != "cuda" or is_interpreter():
        return INTERPRETER_SMS
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def head_dim_class(head_dim: int) -> str:
    """The table key of a head dim: ``"d64"`` (<= 64), ``"d128"`` (<= 128) or ``"d256"``."""
    return "d64" if head_dim <= 64 else "d128" if head_dim <= 128 else "d256"


# ----------------------------------------------------------------------------- decode


def check_kernel_shape(config, powers_of_two: tuple, positive: tuple) -> None:
    """A config's tile sizes and warps: ints that are powers of two (Triton's block shapes);
    its counts: ints >= 1. ValueError naming the field otherwise."""
    for field in powers_of_two + positive:
        value = getattr(config, field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (
                field in powers_of_two and value & (value - 1)):
            kind = "a power of two" if field in powers_of_two else "an int >= 1"
            raise ValueError(f"{type(config).__name__}.{field}: expected {kind}, got {value!r}")


@dataclass(frozen=True)
class DecodeConfig:
    """Compile-time shape of the decode kernels for one arch and head-dim class.

    block_n: KV tokens per tile (the unit of work and of the balanced partition).
    num_warps / num_stages: of the decode kernels (stages = loads in flight per CTA).
    max_ctas_per_sm: cap on resident persistent CTAs per SM.
    max_registers: per-thread register cap of the decode kernels (ptx .maxnreg), or None
        for the compiler's choice; a lower cap fits more resident CTAs per SM.
    programmatic_launch: launch the balanced policy's merge kernel as a programmatic
        dependent of the decode kernel (sm90+; ignored on older GPUs and the interpreter).
    segment_loops: the balanced walk runs one pipelined loop per segment (per chunk in
        deterministic mode) with the q rows loaded once before it, instead of one loop
        across segments that reloads them every tile.
    """

    name: str
    block_n: int
    num_warps: int
    num_stages: int
    max_ctas_per_sm: int
    max_registers: int | None = None
    programmatic_launch: bool = False
    segment_loops: bool = False

    def __post_init__(self):
        check_kernel_shape(self, ("block_n", "num_warps"), ("num_stages", "max_ctas_per_sm"))


_DECODE = {
    # sm80: Ampere's two cp.async stages and two CTAs per SM (164 KiB shared memory), tiles
    # of 32 KiB of K and V as on sm90; not timed on an A100 (docs/tuning.md, "sm80").
    "sm80": {
        "d64": DecodeConfig("sm80-d64", block_n=128, num_warps=4, num_stages=2, max_ctas_per_sm=2),
        "d128": DecodeConfig("sm80-d<=128", block_n=64, num_warps=4, num_stages=2, max_ctas_per_sm=2),
        "d256": DecodeConfig("sm80-d256", block_n=32, num_warps=4, num_stages=2, max_ctas_per_sm=2),
    },
    "sm90": {
        # docs/tuning.md "Decode, head dim 64": block_n 128 at 112 registers, no spills.
        "d64": DecodeConfig("sm90-d64", block_n=128, num_warps=4, num_stages=3, max_ctas_per_sm=4,
                            max_registers=112, programmatic_launch=True),
        # docs/tuning.md "Decode, the main sm90 row": best worst point of 36 candidates;
        # 128 registers fit 4 CTAs per SM.
        "d128": DecodeConfig("sm90-d<=128", block_n=64, num_warps=4, num_stages=3, max_ctas_per_sm=4,
                             max_registers=128, programmatic_launch=True),
        # docs/tuning.md "Decode, head dim 256": 168 registers fit 3 CTAs per SM.
        "d256": DecodeConfig("sm90-d256", block_n=32, num_warps=4, num_stages=3, max_ctas_per_sm=3,
                             max_registers=168, programmatic_launch=True),
    },
}

# Head dim 256 at page sizes >= PAGED_MIN_PAGE (docs/tuning.md "Decode, head dim 256"):
# 2 stages in 128 registers, 4 CTAs per SM.
PAGED_MIN_PAGE = 16
_DECODE_PAGED = {
    "sm90": {
        "d256": DecodeConfig("sm90-d256-paged", block_n=32, num_warps=4, num_stages=2, max_ctas_per_sm=4,
                             max_registers=128, programmatic_launch=True),
    },
}

# Batches of at least MANY_SEGMENTS_PER_CTA (request, KV head) segments per CTA of the main
# grid are bound by each CTA's iterations, not its bytes: more, smaller CTAs win there
# (docs/tuning.md "Decode, many short segments"). Each row with the smallest page size it serves.
MANY_SEGMENTS_PER_CTA = 4
_DECODE_MANY_SEGMENTS = {
    "sm90": {
        "d64": (1, DecodeConfig("sm90-d64-many", block_n=64, num_warps=4, num_stages=2, max_ctas_per_sm=8,
                                max_registers=64, programmatic_launch=True)),
        "d128": (16, DecodeConfig("sm90-d<=128-many", block_n=64, num_warps=4, num_stages=2, max_ctas_per_sm=5,
                                  max_registers=96, programmatic_launch=True)),
    },
}


# An FP8 cache is widened to fp16 in registers after its (half-size) tiles arrive: the
# conversions need registers the bf16 rows' caps do not leave (the many-segments rows spill
# in the tile loop), and half-size tiles want longer ones. Head dims 128 and 256 walk one loop
# per segment, q loaded and widened once per run: the loop across segments reloads and widens
# q and carries the walk every tile, about half of its FP8 tile loop's instructions
# (docs/tuning.md "Decode, FP8 caches"). Rows not listed here use the main table's.
_DECODE_FP8 = {
    "sm90": {
        "d128": DecodeConfig("sm90-d<=128-fp8", block_n=128, num_warps=4, num_stages=2, max_ctas_per_sm=4,
                             max_registers=128, programmatic_launch=True, segment_loops=True),
        "d256": DecodeConfig("sm90-d256-fp8", block_n=32, num_warps=4, num_stages=3, max_ctas_per_sm=4,
                             max_registers=128, programmatic_launch=True, segment_loops=True),
    },
}

# Over an FP8 cache, batches of many short segments drain a segment-loops row's pipeline at
# every segment: head dim 128 takes the same tile in one loop across segments there (docs/tuning.md
# "Decode, FP8 caches"), with the smallest page size it serves.
_DECODE_MANY_SEGMENTS_FP8 = {
    "sm90": {
        "d128": (1, DecodeConfig("sm90-d<=128-fp8-many", block_n=128, num_warps=4, num_stages=2, max_ctas_per_sm=3,
                                 max_registers=168, programmatic_launch=True)),
    },
}


# Speculative-verify rows: G x q_len query rows per tile (decode_launch.tile_rows), with a
# causal mask per row, take more registers than a decode row, so they run rows of their own,
# keyed by tile rows; each class lists up to the largest tile rows it serves
# (``max_tile_rows``). On sm90, rows of 32 and more walk one loop per segment with their q tile
# loaded once (``segment_loops``), and batches of many short segments take the same tile in
# one loop across segments (``many_segments_config``); timed on the H200 (docs/tuning.md
# "Decode, verify rows": d128 rows 16-128, d64 rows 32-64, d256 rows 32-64); the others compiled
# without local memory in the tile loop (tests/test_decode.py), not timed.
_DECODE_VERIFY = {
    "sm90": {
        "d64": {16: DecodeConfig("sm90-d64-r16", block_n=128, num_warps=4, num_stages=3, max_ctas_per_sm=3,
                                 max_registers=168, programmatic_launch=True),
                32: DecodeConfig("sm90-d64-r32", block_n=64, num_warps=4, num_stages=2, max_ctas_per_sm=6,
                                 max_registers=80, programmatic_launch=True, segment_loops=True),
                64: DecodeConfig("sm90-d64-r64", block_n=64, num_warps=4, num_stages=2, max_ctas_per_sm=4,
                                 max_registers=128, programmatic_launch=True, segment_loops=True),
                128: DecodeConfig("sm90-d64-r128", block_n=32, num_warps=8, num_stages=2, max_ctas_per_sm=1,
                                  max_registers=224, programmatic_launch=True, segment_loops=True)},
        "d128": {16: DecodeConfig("sm90-d<=128-r16", block_n=64, num_warps=4, num_stages=3, max_ctas_per_sm=3,
                                  max_registers=168, programmatic_launch=True),
                 32: DecodeConfig("sm90-d<=128-r32", block_n=64, num_warps=4, num_stages=2, max_ctas_per_sm=4,
                                  max_registers=128, programmatic_launch=True, segment_loops=True),
                 64: DecodeConfig("sm90-d<=128-r64", block_n=64, num_warps=4, num_stages=3, max_ctas_per_sm=2,
                                  max_registers=224, programmatic_launch=True, segment_loops=True),
                 128: DecodeConfig("sm90-d<=128-r128", block_n=64, num_warps=8, num_stages=2, max_ctas_per_sm=1,
                                   max_registers=224, programmatic_launch=True, segment_loops=True)},
        "d256": {16: DecodeConfig("sm90-d256-r16", block_n=32, num_warps=4, num_stages=2, max_ctas_per_sm=2,
                                  max_registers=224, programmatic_launch=True),
                 32: DecodeConfig("sm90-d256-r32", block_n=32, num_warps=4, num_stages=2, max_ctas_per_sm=3,
                                  max_registers=168, programmatic_launch=True, segment_loops=True),
                 64: DecodeConfig("sm90-d256-r64", block_n=32, num_warps=8, num_stages=2, max_ctas_per_sm=2,
                                  max_registers=128, programmatic_launch=True, segment_loops=True)},
    },
    "sm80": {
        "d64": {16: DecodeConfig("sm80-d64-r16", block_n=128, num_warps=4, num_stages=2, max_ctas_per_sm=2),
                32: DecodeConfig("sm80-d64-r32", block_n=64, num_warps=4, num_stages=2, max_ctas_per_sm=2),
                64: DecodeConfig("sm80-d64-r64", block_n=64, num_warps=8, num_stages=2, max_ctas_per_sm=2),
                128: DecodeConfig("sm80-d64-r128", block_n=32, num_warps=8, num_stages=2, max_ctas_per_sm=1)},
        "d128": {16: DecodeConfig("sm80-d<=128-r16", block_n=64, num_warps=4, num_stages=2, max_ctas_per_sm=2),
                 32: DecodeConfig("sm80-d<=128-r32", block_n=64, num_warps=4, num_stages=2, max_ctas_per_sm=2),
                 64: DecodeConfig("sm80-d<=128-r64", block_n=32, num_warps=8, num_stages=2, max_ctas_per_sm=2),
                 128: DecodeConfig("sm80-d<=128-r128", block_n=32, num_warps=8, num_stages=2, max_ctas_per_sm=1)},
        "d256": {16: DecodeConfig("sm80-d256-r16", block_n=32, num_warps=4, num_stages=2, max_ctas_per_sm=2),
                 32: DecodeConfig("sm80-d256-r32", block_n=32, num_warps=8, num_stages=2, max_ctas_per_sm=1),
                 64: DecodeConfig("sm80-d256-r64", block_n=16, num_warps=8, num_stages=2, max_ctas_per_sm=1)},
    },
}


# Over an FP8 cache (tiles read as int16 pairs) the tile loop takes more registers: rows that
# spill there at their bf16 row's register cap keep the tiles they ran before (compiled, not
# timed; docs/tuning.md "Decode, FP8 caches"). Head dim 64 at 32 rows: 128 registers, 4 CTAs per
# SM (at 80, 34 spill slots). Head dim 256: 8 warps at one CTA per SM, which 255 registers fit at
# 32 rows (4 warps spill 196 slots at 168, 32 at 224) and 224 at 64 rows (80 slots at 128).
_DECODE_VERIFY_FP8 = {
    "sm90": {
        "d64": {32: DecodeConfig("sm90-d64-r32-fp8", block_n=64, num_warps=4, num_stages=3, max_ctas_per_sm=4,
                                 max_registers=128, programmatic_launch=True, segment_loops=True)},
        "d256": {32: DecodeConfig("sm90-d256-r32-fp8", block_n=32, num_warps=8, num_stages=2, max_ctas_per_sm=1,
                                  max_registers=255, programmatic_launch=True, segment_loops=True),
                 64: DecodeConfig("sm90-d256-r64-fp8", block_n=32, num_warps=8, num_stages=2, max_ctas_per_sm=1,
                                  max_registers=224, programmatic_launch=True, segment_loops=True)},
    },
}


def max_tile_rows(arch: str, head_dim: int) -> int:
    """The most packed rows (G x q_len, ``decode_launch.tile_rows``) a verify tile of this head
    dim takes."""
    return max(_DECODE_VERIFY[check_arch(arch)][head_dim_class(head_dim)])


# Unless told not to (``DecodeAttention(pack_kv_heads=False)``), plain decode rows of head dim
# 64 over an FP8 cache walk two neighbouring KV heads as one head of 128 columns whose rows hold
# both heads' G query heads, when 2 x G still fits the 16-row MMA minimum that pads them anyway:
# the tile then loads 128 bytes of each token per head pair (one head's 64-byte rows of a
# token-major FP8 cache cap the loads far below the copy bandwidth), and one softmax step covers
# two heads; on an H100 that takes 0.74-0.85x the one-head walk's time (docs/tuning.md, "Two KV
# heads of 64 as one"). A bf16 cache's rows are 128 bytes already, and its packed tile spills in
# the 96-register many-segments row: it walks each head alone.
PACKED_HEAD_DIM = 64
PACKED_TILE_ROWS = 16


def kv_head_pack(arch: str, num_q_heads: int, num_kv_heads: int, head_dim: int, max_q_len: int,
                 deterministic: bool, kv_fp8: bool) -> int:
    """KV heads a decode segment reads as one (``decode_launch.QueryRows.head_pack``): 2 for
    plain decode rows (``max_q_len`` 1) over an FP8 cache (``kv_fp8``) of head dim
    PACKED_HEAD_DIM with an even Hkv and 2 G <= PACKED_TILE_ROWS, where ``arch`` has an FP8 row
    for twice that head dim (sm90), outside deterministic mode (whose per-chunk partials would
    double); else 1."""
    group = num_q_heads // num_kv_heads
    packs = (kv_fp8 and head_dim == PACKED_HEAD_DIM and num_kv_heads % 2 == 0 and 2 * group <= PACKED_TILE_ROWS
             and max_q_len == 1 and not deterministic
             and head_dim_class(2 * head_dim) in _DECODE_FP8.get(check_arch(arch), {}))
    return 2 if packs else 1


def decode_config(arch: str, head_dim: int, page_size: int, kv_fp8: bool = False,
                  rows: int | None = None) -> DecodeConfig:
    """The decode config of ``arch`` for ``head_dim`` and ``page_size`` (and an FP8 cache):
    plain decode rows by default, speculative-verify rows of ``rows`` packed rows (a power of
    two from 16 up to ``max_tile_rows``) when given."""
    key = head_dim_class(head_dim)
    if rows is not None:
        verify = _DECODE_VERIFY[check_arch(arch)][key]
        if rows not in verify:
            raise ValueError(f"rows: expected a power of two in 16..{max(verify)} for head dim {head_dim} on {arch}, "
                             f"got {rows}")
        fp8_row = _DECODE_VERIFY_FP8.get(arch, {}).get(key, {}).get(rows) if kv_fp8 else None
        return fp8_row or verify[rows]
    if kv_fp8 and key in _DECODE_FP8.get(check_arch(arch), {}):
        return _DECODE_FP8[arch][key]
    if page_size >= PAGED_MIN_PAGE and key in _DECODE_PAGED.get(check_arch(arch), {}):
        return _DECODE_PAGED[arch][key]
    return _DECODE[arch][key]


def same_tile(a: DecodeConfig, b: DecodeConfig) -> bool:
    """Whether two decode rows run the same tile arithmetic (KV tokens per tile, warps sharing
    it), so a request's chunk gives the same bits under either; stages, registers and CTAs per
    SM change only the schedule."""
    return a.block_n == b.block_n and a.num_warps == b.num_warps


def _one_loop(config: DecodeConfig) -> DecodeConfig:
    """A segment-loops row's tile walked in one loop across segments."""
    return replace(config, name=f"{config.name}-one-loop", segment_loops=False)


# Verify rows that walk one loop per segment drain their pipeline at every segment: batches of
# many short segments take a row that walks one loop across segments (docs/tuning.md "Decode,
# verify rows"): the bucket's own tile and schedule in one loop, except where another tile was
# timed faster in one loop: head dim 64 at 32 rows (its FP8 row's: 4 CTAs per SM at 128 registers)
# and 64 rows (3 CTAs at 168), head dim 128 at 64 rows (the 32-token tile), head dim 256 at 64 rows
# (its FP8 row's: one CTA per SM at 224 registers). Head dim 256 at 32 rows keeps its main row at
# every batch: it led the one-loop row up to B = 2048.
_DECODE_VERIFY_MANY_SEGMENTS = {
    "sm90": {
        "d64": {32: replace(_one_loop(_DECODE_VERIFY_FP8["sm90"]["d64"][32]), name="sm90-d64-r32-one-loop"),
                64: DecodeConfig("sm90-d64-r64-one-loop", block_n=64, num_warps=4, num_stages=2,
                                 max_ctas_per_sm=3, max_registers=168, programmatic_launch=True),
                128: _one_loop(_DECODE_VERIFY["sm90"]["d64"][128])},
        "d128": {32: _one_loop(_DECODE_VERIFY["sm90"]["d128"][32]),
                 64: DecodeConfig("sm90-d<=128-r64-one-loop", block_n=32, num_warps=4, num_stages=3,
                                  max_ctas_per_sm=2, max_registers=224, programmatic_launch=True),
                 128: _one_loop(_DECODE_VERIFY["sm90"]["d128"][128])},
        "d256": {64: replace(_one_loop(_DECODE_VERIFY_FP8["sm90"]["d256"][64]), name="sm90-d256-r64-one-loop")},
    },
}

# Over an FP8 cache (tiles read as int16 pairs, docs/tuning.md "Decode, FP8 caches") the main
# verify rows of 32 tile rows beat the one-loop rows at every batch timed, up to 2048 requests:
# head dims 64 and 128 keep their main row (None: no switch). Head dim 256's one-loop rows are
# its FP8 rows' tiles in one loop, at 255 registers, where they do not spill (compiled, not timed).
_DECODE_VERIFY_MANY_SEGMENTS_FP8 = {
    "sm90": {
        "d64": {32: None},
        "d128": {32: None},
        "d256": {rows: replace(_one_loop(cfg), name=f"sm90-d256-r{rows}-fp8-one-loop", max_registers=255)
                 for rows, cfg in _DECODE_VERIFY_FP8["sm90"]["d256"].items()},
    },
}


def many_segments_config(arch: str, head_dim: int, page_size: int, kv_fp8: bool = False,
                         rows: int | None = None) -> DecodeConfig | None:
    """The balanced policy's config for batches of many short segments, or None where the
    main row serves every batch. Plain decode rows (``rows`` None): a row of more, smaller CTAs
    (none on sm80, for head dim 256, or head dim 128 at page size < 16); over an FP8 cache, head
    dim 128's tile in one loop across segments (none for head dims 64 and 256). Verify
    rows of ``rows`` tile rows: where their row walks one loop per segment, a row that walks
    one loop across segments (a pipeline drained at every short segment costs more than the q
    reloads it saves), else None."""
    key = head_dim_class(head_dim)
    if rows is not None:
        decode_config(arch, head_dim, page_size, kv_fp8, rows)  # checks rows
        fp8_rows = _DECODE_VERIFY_MANY_SEGMENTS_FP8.get(arch, {}).get(key, {}) if kv_fp8 else {}
        if rows in fp8_rows:
            return fp8_rows[rows]
        return _DECODE_VERIFY_MANY_SEGMENTS.get(arch, {}).get(key, {}).get(rows)
    table = _DECODE_MANY_SEGMENTS_FP8 if kv_fp8 else _DECODE_MANY_SEGMENTS
    min_page, config = table.get(check_arch(arch), {}).get(key, (None, None))
    return config if config is not None and page_size >= min_page else None


# ----------------------------------------------------------------------------- extend


@dataclass(frozen=True)
class ExtendConfig:
    """Compile-time shape of the extend kernel.

    block_m: packed (query, head) rows per program (PackGQA: block_m / G queries).
    block_n: KV tokens per inner tile.
    num_warps / num_stages: of the extend kernel. K/V loads wait on their tile's page-table
        load, so Triton's pipeliner keeps (num_stages - 1) // 2 K/V tiles in flight.
    """

    name: str
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __post_init__(self):
        check_kernel_shape(self, ("block_m", "block_n", "num_warps"), ("num_stages",))


_EXTEND = {
    # docs/tuning.md "Extend": 5 stages (two K/V tiles in flight) against 3 or 7, measured at
    # head dims 64 and 128; d256 follows the rule, compiled without spills, not timed.
    "sm90": {
        "d64": ExtendConfig("sm90-d64", block_m=128, block_n=64, num_warps=8, num_stages=5),
        "d128": ExtendConfig("sm90-d128", block_m=128, block_n=64, num_warps=8, num_stages=5),
        "d256": ExtendConfig("sm90-d256", block_m=64, block_n=32, num_warps=8, num_stages=5),
    },
    # Ampere's two stages; fit checked by compiling for sm_80, not timed.
    "sm80": {
        "d64": ExtendConfig("sm80-d64", block_m=128, block_n=64, num_warps=8, num_stages=2),
        "d128": ExtendConfig("sm80-d128", block_m=128, block_n=32, num_warps=8, num_stages=2),
        "d256": ExtendConfig("sm80-d256", block_m=64, block_n=32, num_warps=8, num_stages=2),
    },
}

# Short batches (decode-like or spec-verify rows: max_q_len * G small) use a smaller
# block_m so a program is not mostly padding; 16 is the MMA minimum. Blocks of 16 / 32
# rows run on 4 warps; 64 keeps the table's warps (4 warps spill at 5 stages).
EXTEND_SMALL_BLOCK_M = (16, 32, 64)

# The candidates benchmarks/prefill.py --sweep-configs times, (block_m, block_n, num_warps,
# num_stages), each compiled without spills for sm_90a at head dim 128.
EXTEND_CONFIG_CANDIDATES = (
    (128, 64, 8, 3), (128, 64, 8, 5), (128, 64, 8, 7), (64, 32, 4, 5), (64, 32, 4, 7), (64, 32, 8, 5),
)


def extend_config(arch: str, head_dim: int, group_size: int, max_q_len: int) -> ExtendConfig:
    """The extend config of ``arch`` for ``head_dim``, shrunk for short batches: block_m
    becomes the smallest of EXTEND_SMALL_BLOCK_M that holds max_q_len * G rows when that is
    below the table's block_m (one program then covers every row of a request)."""
    base = _EXTEND[check_arch(arch)][head_dim_class(head_dim)]
    rows = max_q_len * group_size
    for small in EXTEND_SMALL_BLOCK_M:
        if rows <= small < base.block_m:
            return ExtendConfig(f"{base.name}-m{small}", block_m=small, block_n=base.block_n,
                                num_warps=4 if small < 64 else base.num_warps, num_stages=base.num_stages)
    return base


def extend_configs(arch: str, head_dim: int, group_size: int) -> tuple[ExtendConfig, ...]:
    """Every config ``extend_config`` can return for this shape (what start-up compiles)."""
    q_lens = {1, 1 << 20} | {rows // group_size for rows in EXTEND_SMALL_BLOCK_M if rows >= group_size}
    configs = {}
    for max_q_len in sorted(q_lens):
        config = extend_config(arch, head_dim, group_size, max_q_len)
        configs.setdefault(config.name, config)
    return tuple(configs.values())
