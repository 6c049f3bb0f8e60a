"""Per-architecture decode configurations, chosen by one cached probe.

``decode_config(arch, head_dim, page_size)`` returns a frozen :class:`DecodeConfig`. The arch is
``"sm80"`` (A100-class: SM80/86/89) or ``"sm90"`` (Hopper); ``EVENKV_ARCH=sm80|sm90``
or an explicit ``arch=`` overrides the probe, so both tables run anywhere (an SM80
table runs on Hopper; the CPU lane tests both under the Triton interpreter).

The persistent grid is not in the table: it is the SM count times the resident
CTAs per SM that the compiled kernel's registers and shared memory allow, capped by
``max_ctas_per_sm`` (see ``evenkv.kernels.decode_launch.resident_ctas_per_sm``).

``many_segments_config(arch, head_dim, page_size)`` is a second row, with its own grid,
for batches of many short (request, KV head) segments (sm90: head_dim 64 at every page
size, head_dim 128 at page size >= 16); ``DecodeAttention.launch_config`` picks it by
batch size.
"""

import functools
import os
from dataclasses import dataclass

import torch

ARCHES = ("sm80", "sm90")


@dataclass(frozen=True)
class DecodeConfig:
    """Compile-time shape of the decode kernels for one architecture and head_dim class.

    block_n: KV tokens per tile (the unit of work and of the balanced partition).
    num_warps / num_stages: of the decode kernels (stages = loads in flight per CTA).
    max_ctas_per_sm: cap on resident persistent CTAs per SM.
    segment_overhead: fixed cost of a (request, KV head) segment, in tiles, charged by the
        balanced partition; the stream kernel spends one masked iteration per unit of it.
    merge_num_warps: of the LSE merge kernel.
    merge_rows: query rows (of a segment's G) per program of the units policies' merge
        kernel; fewer rows give a request of many splits more programs.
    max_registers: per-thread register cap of the decode kernels (ptx .maxnreg), or None
        for the compiler's choice; a lower cap fits more resident CTAs per SM.
    programmatic_launch: launch the balanced policy's merge kernel as a programmatic
        dependent of the decode kernel (sm90+; ignored on older GPUs and the interpreter).
    """

    name: str
    block_n: int
    num_warps: int
    num_stages: int
    max_ctas_per_sm: int
    segment_overhead: int
    merge_num_warps: int = 4
    merge_rows: int = 1
    max_registers: int | None = None
    programmatic_launch: bool = False


# Provenance: benchmarks/tune_decode.py on one H200 (2026-11-30), balanced policy,
# Qwen3-30B-A3B attention, T = 262144, B in {1, 8, 64, 512, 2048}, Uniform and Skewed80,
# page 16 and 1; 36 candidates (block_n 32/64/128 x warps 4/8 x stages 2/3/4 x cap 2/4).
# sm90 = the candidate with the best worst point over both page sizes after the best
# (bn32-w4-s4-c4), which it beats on the sum over points. sm80 keeps Ampere's usual two
# cp.async stages and two CTAs per SM (A100: 164 KiB shared memory, 108 SMs); it runs on
# Hopper too, measured slower there.
# sm90 max_registers 128 (benchmarks/breakdown_decode.py, run 2026-11-30, results in
# benchmarks/results/2026-11-30-h200-run2/breakdown): the compiler's 153 registers fit 3
# CTAs per SM, 128 fit 4; B = 2048 Skewed40 207 -> 190 us, B = 2048 Uniform 174 -> 168,
# B <= 128 +2 us (146 -> 148). The worst point is what the partition must flatten.
# Stages: each K/V load waits on the page-table load of its tile, so Triton's pipeliner
# keeps (num_stages - 1) // 2 K/V tiles in flight per CTA; stages 2-4 all compile to one.
# Two to four tiles in flight (stages 5/7/9, fewer CTAs per SM by shared memory) were no
# faster at B <= 512 and up to 2x slower at B = 2048 (tune_decode.py --configs, run 4:
# benchmarks/results/2026-11-30-h200-run4/tune/decode-stages-p*.csv): resident CTAs, not
# per-CTA depth, hide the latency here.
# Run 5 (benchmarks/results/2026-11-30-h200-run5/tune/): segment overhead 0 wins only on
# uniform batches whose segments fit one CTA exactly and loses on skewed ones (B = 2048
# Skewed80 215 vs 179 us, B = 512 Skewed80 171 vs 156);
# 2 loses at B >= 1024. 2-warp CTAs at 8 per SM with block_n 32 take B = 2048 Skewed40 from
# 185 to 170 us but are 6-19 us slower at every B <= 1536. programmatic_launch: the merge
# kernel as a programmatic dependent of the decode kernel, 2-4 us off every point.
# Run 6 (benchmarks/results/2026-11-30-h200-run6/): the stream kernel walks its range in one
# loop across segments, so an overhead unit is a whole masked iteration: overhead 1 then
# cost up to 37 us (B = 2048 Skewed40 216 vs 174 us with 0); with 0 the one loop took
# B = 2048 Skewed40 from 184 to 174 us and B = 128 Uniform from 151 to 140 (the segment
# boundaries no longer drain the pipeline). The sm80 rows follow (unmeasured on an A100).
# Run 7 (benchmarks/results/2026-11-30-h200-run7/tune/): one row per head-dim class, each
# tile holding 32 KiB of K and V (block_n * head_dim = 8192). head_dim 64 with block_n 128:
# Llama-3.2-1B 148-173 us against 167-219 with block_n 64 (B 1-2048, Uniform and Skewed40,
# d256-d64-tp8.log); capped at 112 registers (4 CTAs per SM, no local memory in the tile
# loop for G = 4), 1-4 us faster than at 128, where two registers spill in the tile loop
# (d64-regs.log; 5 CTAs at 96 registers win only B 2048 Skewed40). head_dim 256 capped at
# 168 registers: the compiler's 201-203 fit 2 CTAs per SM, 168 fit 3 with no local
# memory; Qwen3-Next 146-171 us against 164-192, Gemma-3 509-561 against 577-658.
# Llama-3-70B TP8 (Hkv 1) is as fast with block_n 32 as with 64 (within 1 us, worse at
# B 2048 Skewed40): it keeps the d<=128 row.
_TABLES = {
    "sm80": {
        "d64": DecodeConfig("sm80-d64", block_n=128, num_warps=4, num_stages=2, max_ctas_per_sm=2, segment_overhead=0),
        "d128": DecodeConfig("sm80-d<=128", block_n=64, num_warps=4, num_stages=2, max_ctas_per_sm=2, segment_overhead=0),
        "d256": DecodeConfig("sm80-d256", block_n=32, num_warps=4, num_stages=2, max_ctas_per_sm=2, segment_overhead=0),
    },
    "sm90": {
        "d64": DecodeConfig("sm90-d64", block_n=128, num_warps=4, num_stages=3, max_ctas_per_sm=4, segment_overhead=0,
                            max_registers=112, programmatic_launch=True),
        "d128": DecodeConfig("sm90-d<=128", block_n=64, num_warps=4, num_stages=3, max_ctas_per_sm=4, segment_overhead=0,
                             max_registers=128, programmatic_launch=True),
        "d256": DecodeConfig("sm90-d256", block_n=32, num_warps=4, num_stages=3, max_ctas_per_sm=3, segment_overhead=0,
                             max_registers=168, programmatic_launch=True),
    },
}


# Batches of many short segments (run 9, benchmarks/results/2026-11-30-h200-run9/tune/ab-occupancy.log;
# the per-CTA timelines there show that a CTA's walk time follows its iterations, not its
# bytes): a short request's tile is mostly masked, so those batches are bound by the latency
# of each CTA's iterations, and more resident CTAs help. Two stages compile to the same
# one-tile-ahead pipeline in far fewer registers (88-96 without local memory in the tile
# loop, against 128 at three stages), which fits 5 CTAs per SM in the same shared memory.
# Qwen3-30B-A3B, page 16, same call: T = 256K B = 2048 Skewed40 170.3 -> 158.5 us, 2x40
# 161.6 -> 158.0, Uniform 152.0 -> 155.4 (the worst distribution at B = 2048: 170.3 -> 158.5);
# T = 32K B = 2048 Skewed40 75.2 -> 62.8; but B <= 512 up to 10 us slower, T = 1M B = 32
# 12 us slower, and page 1 B = 2048 Skewed40 164 -> 170. So the row is used for page sizes
# >= 16 (at 32 and 64 as at 16: B = 2048 Skewed40 171 -> 161 us, Uniform 155 -> 157; run 10,
# tune/ab-pages-d128.log) and batches of at least MANY_SEGMENTS_PER_CTA (request, KV head)
# segments per CTA of the main row's grid: at B = 1536 (11.6 per CTA at Hkv 4) it took the
# worst distribution from 165.4 to 158.3 us (ab-many-1536.log), at B = 1024 (7.8) it cost
# 6.4 us at Uniform.
# Head dim 64 (run 10, benchmarks/results/2026-11-30-h200-run10/tune/ab-d64.log, ab2-d64.log;
# Llama-3.2-1B, 32/8/64): block_n 64 at 2 stages fits 64 registers with no local memory, so
# 8 CTAs per SM (grid 1056; the main row's block_n 128 spills below 96). T = 256K page 16,
# B = 2048: 2x40 194.5 -> 171.2 us, Skewed80 194.5 -> 166.9, Skewed40 172.5 -> 169.8, Uniform
# 161.9 -> 159.6; B = 1024 Skewed80 167.1 -> 158.9, Uniform 157.2 -> 154.3; T = 32K B = 2048
# Skewed80 118.4 -> 77.6; page 1 B = 2048 Skewed80 190.7 -> 176.2. But B = 64 Uniform 140.5 ->
# 146.2, T = 1M B = 64 Skewed40 522.9 -> 529.1, page 1 B = 16 Skewed40 151.3 -> 156.7: so a
# many-segments row (B >= 660 at 8 KV heads), at every page size (pages 32 and 64: 2-8 us faster
# at B >= 1024, tune/ab-pages-d64.log).
# Each row with the smallest page size it serves.
_MANY_SEGMENTS = {
    "sm90": {
        "d64": (1, DecodeConfig("sm90-d64-many", block_n=64, num_warps=4, num_stages=2, max_ctas_per_sm=8,
                                segment_overhead=0, max_registers=64, programmatic_launch=True)),
        "d128": (16, DecodeConfig("sm90-d<=128-many", block_n=64, num_warps=4, num_stages=2, max_ctas_per_sm=5,
                                  segment_overhead=0, max_registers=96, programmatic_launch=True)),
    },
}
MANY_SEGMENTS_PER_CTA = 10

# Page sizes >= 16, head dim 256 (run 10, tune/ab-d256-*.log, ab2-d256-*.log): 2 stages fit
# 128 registers with no local memory, 4 CTAs per SM (exactly the shared memory) against the
# main row's 3. Gemma-3-12B (16/8/256) faster at all 21 page-16 points (T = 256K B = 1
# 509.8 -> 499.6 us, B = 2048 Skewed40 566.7 -> 547.3, T = 1M B = 2048 Skewed80 2021 -> 1971);
# Qwen3-Next (16/2/256) faster at 14 of 21 (B = 256 Uniform 149.9 -> 140.3), within 0.6 us
# at 4, 1.2-3.3 us slower at 3 skewed points of B >= 1024 (2x40 158.6 -> 161.8). At page 1
# (32 page-table entries per tile; not profiled) it is slower: Gemma B = 16 Skewed40
# 514.9 -> 540.6, Qwen3-Next 145.1 -> 152.3. So the row serves page sizes >= 16 (at 32 and 64,
# tune/ab-pages-d256-*.log: Gemma-3 4.5-23.5 us faster at 6 of 6 points; Qwen3-Next B = 256
# Uniform 151.5 -> 141.5, B = 2048 Skewed40 166.9 -> 164.6, the other 4 within 1.1 us).
_PAGED = {
    "sm90": {
        "d256": DecodeConfig("sm90-d256-paged", block_n=32, num_warps=4, num_stages=2, max_ctas_per_sm=4,
                             segment_overhead=0, max_registers=128, programmatic_launch=True),
    },
}
PAGED_MIN_PAGE = 16


def is_interpreter() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _probe_arch(device_index: int) -> str:
    major, _ = torch.cuda.get_device_capability(device_index)
    return "sm90" if major >= 9 else "sm80"


def resolve_arch(arch: str | None, device: torch.device) -> str:
    """The config family for ``device``: explicit ``arch``, else EVENKV_ARCH, else the probe.

    The interpreter (and any CPU device) defaults to ``sm90``.
    """
    chosen = arch if arch is not None else os.environ.get("EVENKV_ARCH") or None
    if chosen is not None:
        if chosen not in ARCHES:
            raise ValueError(f"arch: expected one of {ARCHES}, got {chosen!r}")
        return chosen
    if device.type != "cuda" or is_interpreter():
        return "sm90"
    return _probe_arch(device.index if device.index is not None else torch.cuda.current_device())


def _head_dim_class(head_dim: int) -> str:
    return "d64" if head_dim <= 64 else "d128" if head_dim <= 128 else "d256"


def decode_config(arch: str, head_dim: int, page_size: int) -> DecodeConfig:
    """The decode config of ``arch`` for ``head_dim`` (<= 64, <= 128 or 256) and ``page_size``."""
    if arch not in ARCHES:
        raise ValueError(f"arch: expected one of {ARCHES}, got {arch!r}")
    head_dim_class = _head_dim_class(head_dim)
    if page_size >= PAGED_MIN_PAGE and head_dim_class in _PAGED.get(arch, {}):
        return _PAGED[arch][head_dim_class]
    return _TABLES[arch][head_dim_class]


def many_segments_config(arch: str, head_dim: int, page_size: int) -> DecodeConfig | None:
    """The balanced policy's config for batches of many short segments (at least
    MANY_SEGMENTS_PER_CTA segments per CTA of ``decode_config``'s grid), or None where the
    main row serves every batch (no measured gain: sm80, head_dim 256, head_dim 128 at page
    size < 16)."""
    if arch not in ARCHES:
        raise ValueError(f"arch: expected one of {ARCHES}, got {arch!r}")
    min_page, config = _MANY_SEGMENTS.get(arch, {}).get(_head_dim_class(head_dim), (None, None))
    return config if config is not None and page_size >= min_page else None


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
