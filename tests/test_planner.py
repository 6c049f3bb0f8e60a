"""Planner tests: GPU plans equal the numpy oracle exactly, and the schedules' invariants."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import evenkv
from evenkv.kernels.decode_launch import FUSED_MERGE_PIECES, QueryRows, merge_stream_constants, merge_stream_grid
from planner_oracle import (chunks, fa3_plan, merge_lists, simulate_stream, stream_fused_merges, stream_merge_reads,
                            stream_merge_shares, stream_plan)

BLOCK_N = evenkv.decode_config("sm90", 128, 16).block_n
# (G, head_dim) of merge_stream_kernel's share checks: an all-rows step of 4 or 8 pieces,
# partly masked rows and columns (7, 80), G = 1 with one column chunk per row, and more
# (row, column chunk) items than a segment of 33-64 pieces has programs (16, 128).
MERGE_SHAPES = [(8, 128), (7, 80), (2, 256), (1, 32), (16, 128)]


def _attn(device, policy, num_kv_heads, max_batch, num_ctas, page_size=16, max_pages=64, max_q_len=1, window=None,
          deterministic=False, max_total_tokens=1 << 21):
    return evenkv.DecodeAttention(num_kv_heads * 2, num_kv_heads, 128, page_size, torch.float16, device,
                                  max_batch, max_pages, policy, num_ctas=num_ctas, max_q_len=max_q_len,
                                  sliding_window=window, deterministic=deterministic,
                                  max_total_tokens=max_total_tokens)


def _check_stream(device, lens, num_kv_heads, num_ctas, max_pages=64, page_size=16, cu=None, q_len=1, window=None,
                  deterministic=False, max_total_tokens=1 << 21, compare_ctas=None):
    """The balanced plan of ``lens`` (verify rows of up to q_len tokens where cu is given; the
    deterministic chunked plan) equals the oracle's, field by field. compare_ctas: the main
    grid the plan kernel's compare tile is sized for, when it is not this grid."""
    attn = _attn(device, "balanced", num_kv_heads, max(len(lens), 1), num_ctas, page_size, max_pages,
                 max_q_len=q_len, window=window, deterministic=deterministic, max_total_tokens=max_total_tokens)
    if compare_ctas is not None:
        attn.num_ctas = compare_ctas  # as for an object's other grids (many-segments row, verify buckets)
    seq_lens = torch.tensor(lens, dtype=torch.int64, device=device)
    page_table = torch.zeros(len(lens), max_pages, dtype=torch.int32, device=device)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
    errors = evenkv.errors.error_flag(device)
    errors.zero_()
    plan = attn.plan(seq_lens, page_table, cu_seqlens_q=cu_t, q_len=q_len)
    cfg = plan.config
    chunking = attn._chunking(cfg) if deterministic else None
    want = stream_plan(lens, max_pages * page_size, num_ctas, num_kv_heads, cfg.block_n, cu, q_len, window or 0,
                       chunking)
    s = plan.schedule
    np.testing.assert_array_equal(plan.seq_lens.cpu().numpy(), want["seq_lens"])
    active = s.active_req[:len(want["active_req"])].cpu().numpy()
    np.testing.assert_array_equal(active[:, 0], want["active_req"])
    np.testing.assert_array_equal(active[:, 1], want["seq_lens"][want["active_req"]])
    np.testing.assert_array_equal(active[:, 2], want["q_start"][want["active_req"]])
    np.testing.assert_array_equal(active[:, 3], want["q_len"][want["active_req"]])
    np.testing.assert_array_equal(s.cta_start[:num_ctas].cpu().numpy(), want["cta_start"])
    np.testing.assert_array_equal(s.cta_pos[:num_ctas + 1].cpu().numpy(), want["cta_pos"])
    assert s.plan_scalars.cpu().tolist() == [want["piece"], want["total"], len(want["active_req"]), want["max_tiles"],
                                             want["rows_end"]]
    if deterministic:
        np.testing.assert_array_equal(active[:, 4], want["chunk"][want["active_req"]])
        np.testing.assert_array_equal(active[:, 5], want["chunk_base"][want["active_req"]])
        np.testing.assert_array_equal(s.req_chunks[:len(lens)].cpu().numpy(), want["chunks"])
        np.testing.assert_array_equal(s.req_chunk_base[:len(lens)].cpu().numpy(), want["chunk_base"])
        _check_merge_lists(s, want, attn.max_batch_size - 1)
        assert (evenkv.errors.INVARIANCE_LOST in _flag_bits(device)) == want["overflow"]
    malformed = bool(want["malformed"].any())
    assert (evenkv.errors.QUERY_OUT_OF_RANGE in _flag_bits(device)) == malformed
    errors.zero_()
    return want, cfg


def _flag_bits(device) -> set:
    bits = int(evenkv.errors.error_flag(device).item())
    return {bit for bit in evenkv.errors.REASONS if bits & bit}


def _stream_invariants(want, cfg, num_kv_heads, num_ctas):
    pieces, writes = simulate_stream(want, num_ctas, num_kv_heads)
    # Every tile of every non-empty segment is covered exactly once.
    covered = {}
    for mine in pieces:
        for b, h, t0, t1 in mine:
            for t in range(t0, t1):
                covered[(b, h, t)] = covered.get((b, h, t), 0) + 1
    expected = {(b, h, t) for b, n in enumerate(want["tiles"].tolist()) for h in range(num_kv_heads)
                for t in range(n)}
    assert set(covered) == expected and all(v == 1 for v in covered.values())
    # Equal pieces: CTA c walks exactly `piece` tiles (the tail CTAs fewer); a chunked plan
    # moves each start up to a chunk boundary, by less than the chunk it falls in.
    piece = want["piece"]
    for c, mine in enumerate(pieces):
        tiles = sum(t1 - t0 for _, _, t0, t1 in mine)
        if want["chunked"]:
            pos = want["cta_pos"]
            assert tiles == pos[c + 1] - pos[c] and 0 <= pos[c] - min(c * piece, want["total"]) < max(
                want["chunk"].max(initial=1), 1)
        else:
            assert tiles == max(min(piece, want["total"] - c * piece), 0)
    # The merges read exactly the partial slots that were written, and nothing else.
    written = {}
    for kind, b, h, slot in writes:
        if kind == "partial":
            written.setdefault((b, h), []).append(slot)
    reads = stream_merge_reads(want, num_kv_heads)
    assert {k: sorted(v) for k, v in written.items()} == {k: sorted(v) for k, v in reads.items()}
    slots = [s for v in written.values() for s in v]
    outs = [(b, h) for kind, b, h, _ in writes if kind == "out"]
    assert len(outs) == len(set(outs)) and not set(outs) & set(reads)
    assert set(outs) | set(reads) == {(b, h) for b, n in enumerate(want["tiles"].tolist()) if n > 0
                                      for h in range(num_kv_heads)}
    if want["chunked"]:
        # One slot per chunk of each segment of several, inside the workspace.
        assert len(slots) == len(set(slots)) and all(0 <= s < int(want["chunks"].sum()) * num_kv_heads for s in slots)
        return
    assert len(slots) == len(set(slots)) and all(0 <= s < 2 * num_ctas for s in slots)
    # Every cut segment is merged exactly once: by the decode kernel (at most
    # FUSED_MERGE_PIECES pieces, one arrival counter each, inside [0, C)) or by the
    # boundary-indexed programs of merge_stream_kernel inside it (the rest), whose shares
    # cover each of its rows (G per query token) and head-dim columns once, for each step shape.
    max_q_len = int(want["q_len"].max(initial=1))
    for fused_pieces in (FUSED_MERGE_PIECES, 2, 0):
        fused = stream_fused_merges(reads, fused_pieces)
        counters = list(fused.values())
        assert len(counters) == len(set(counters)) and all(0 <= c < num_ctas for c in counters)
        for group, head_dim in MERGE_SHAPES:
            query = QueryRows(max_q_len if want["multi_q"] else 1, group * max_q_len)
            consts = merge_stream_constants(num_kv_heads, group, head_dim, cfg, False, query)
            _, splits = merge_stream_grid(num_ctas, group, head_dim, query)
            shares = stream_merge_shares(want, num_ctas, num_kv_heads, fused_pieces, consts, splits)
            assert not set(shares) & set(fused) and set(shares) | set(fused) == set(reads)
            for (b, h), parts in shares.items():
                rows = group * int(want["q_len"][b]) if want["multi_q"] else group
                cover = np.zeros((rows, head_dim), dtype=np.int64)
                for _, _, row, col0, col1 in parts:
                    cover[row, col0:col1] += 1
                assert (cover == 1).all(), ((b, h), fused_pieces, group, head_dim, len(reads[(b, h)]))


@pytest.mark.parametrize("lens,num_kv_heads,num_ctas", [
    ([100, 0, 20], 1, 4),
    ([1], 4, 7),
    ([0, 0, 0], 2, 3),
    ([5000] + [1] * 40, 4, 16),
    ([64] * 33, 8, 132),
    ([1024, 1024, 3, 0, 7], 2, 5),
    # Batches past one scan chunk (the chunk is the batch rounded up to a power of two,
    # at most 2048): the carries between chunks and the narrower compare tiles.
    ([(37 * i) % 1025 for i in range(300)], 4, 132),
    ([(13 * i) % 70 for i in range(2500)] + [1024], 2, 40),
])
def test_stream_plan_matches_oracle(device, lens, num_kv_heads, num_ctas):
    want, cfg = _check_stream(device, lens, num_kv_heads, num_ctas)
    _stream_invariants(want, cfg, num_kv_heads, num_ctas)


@pytest.mark.parametrize("num_ctas,compare_ctas", [(7, 2), (5, 16), (12, 4), (300, 3)])
def test_stream_plan_of_another_grid(device, num_ctas, compare_ctas):
    """A plan whose compare tile is sized for another grid (one CTA per program, one program
    of 8 with 3 masked, 2 per program, 2 per program for 300 CTAs) is the oracle's plan."""
    lens = [700, 3, 0, 64, 1000, 17, 250]
    want, cfg = _check_stream(device, lens, 2, num_ctas, compare_ctas=compare_ctas)
    _stream_invariants(want, cfg, 2, num_ctas)


@pytest.mark.parametrize("num_ctas", [34, 100])
def test_stream_merge_shares_many_pieces(device, num_ctas):
    """A 64-tile request (a 4096-token page table) cut into 32 pieces (merge_stream_kernel
    shares it by rows at head_dim 80/128, by (row, column chunk) items at 256) and into 64
    (items everywhere; at G = 16, head_dim 128, 64 items on 63 programs, one takes two)."""
    want, cfg = _check_stream(device, [4096, 5, 0, 70], 1, num_ctas, max_pages=256)
    _stream_invariants(want, cfg, 1, num_ctas)


def test_stream_plan_worked_example():
    """The worked example of evenkv.kernels.plan's docstring (Hkv 1, BLOCK_N 16, C 4)."""
    want = stream_plan([100, 0, 20], 1024, 4, 1, 16)
    assert want["req_cost_start"].tolist() == [0, 7, 7, 9]
    assert want["active_req"].tolist() == [0, 2]
    assert want["cta_start"].tolist() == [[0, 0, 100, 0], [0, 0, 100, 0], [0, 0, 100, 0], [2, 3, 0, 9]]
    assert (want["piece"], want["total"]) == (3, 9)


# Zeros, ones, ordinary and capacity-sized lengths, and hostile ones: negative (clamped to 0)
# and far past the page table (clamped to its 64 x 16 = 1024-token capacity).
lengths = st.lists(st.one_of(st.integers(0, 3), st.integers(0, 300), st.integers(1000, 1024),
                             st.integers(-2**31, -1), st.integers(1025, 2**31 - 1)), min_size=1, max_size=40)


# compare_ctas: the plan kernel's compare tile sized for another grid (an object's main grid
# when this is its many-segments or a verify bucket's): fewer or more CTAs per program.
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=lengths, num_kv_heads=st.sampled_from([1, 2, 4, 8]), num_ctas=st.integers(1, 300),
       compare_ctas=st.one_of(st.none(), st.integers(1, 300)))
def test_stream_plan_properties(device, lens, num_kv_heads, num_ctas, compare_ctas):
    want, cfg = _check_stream(device, lens, num_kv_heads, num_ctas, compare_ctas=compare_ctas)
    _stream_invariants(want, cfg, num_kv_heads, num_ctas)


# Verify rows: query lengths 0-16 (0: no query; past q_len: malformed, clamped and flagged)
# over lengths that include 0 (padding rows keep their q rows) and short requests (q_len >
# seq_len: clamped and flagged), with and without a window.
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.tuples(st.one_of(st.integers(0, 5), st.integers(0, 300), st.integers(1000, 1100)),
                               st.integers(0, 9)), min_size=1, max_size=30),
       num_kv_heads=st.sampled_from([1, 2, 4]), num_ctas=st.integers(1, 200), q_len=st.sampled_from([2, 4, 8]),
       window=st.sampled_from([None, 1, 40]), shift=st.sampled_from([0, -3]))
def test_verify_plan_properties(device, rows, num_kv_heads, num_ctas, q_len, window, shift):
    lens = [n for n, _ in rows]
    cu = np.concatenate([[0], np.cumsum([k for _, k in rows])]).tolist()
    cu[0] += shift  # a first row starting before q row 0
    want, cfg = _check_stream(device, lens, num_kv_heads, num_ctas, cu=cu, q_len=q_len, window=window)
    _stream_invariants(want, cfg, num_kv_heads, num_ctas)


def test_verify_plan_worked_example():
    """Rows of 3, 1, 0 and 2 query tokens over 100, 20, 50 and 0 keys (a padding row keeps its
    2 rows, which get zeros): the 50-key request has no query and costs nothing."""
    want = stream_plan([100, 20, 50, 0], 1024, 4, 1, 16, cu_seqlens_q=[0, 3, 4, 4, 6], max_q_len=4)
    assert want["q_start"].tolist() == [0, 3, 4, 4] and want["q_len"].tolist() == [3, 1, 0, 2]
    assert want["tiles"].tolist() == [7, 2, 0, 0] and want["active_req"].tolist() == [0, 1]
    assert want["rows_end"] == 6 and not want["malformed"].any()
    under_window = stream_plan([100], 1024, 4, 1, 16, cu_seqlens_q=[0, 4], max_q_len=4, window=10)
    assert under_window["tiles"].tolist() == [1]  # the last 10 + 4 - 1 = 13 keys


def test_plain_decode_rows_of_several_tokens_are_flagged(device):
    """A plain decode plan whose cu_seqlens_q gives a row more than one token (num_decodes
    that does not match the batch) is flagged."""
    attn = _attn(device, "balanced", 1, 3, 4)
    evenkv.errors.error_flag(device).zero_()
    attn.plan(torch.tensor([30, 5, 7], device=device), torch.zeros(3, 64, dtype=torch.int32, device=device),
              cu_seqlens_q=torch.tensor([0, 1, 2, 7], dtype=torch.int32, device=device))
    assert _flag_bits(device) == {evenkv.errors.QUERY_OUT_OF_RANGE}
    evenkv.errors.error_flag(device).zero_()


def _check_merge_lists(schedule, want, list_last):
    """merge_units_kernel's two lists: whole from the front, by rows from entry list_last down."""
    whole, by_rows = schedule.merge_count.tolist()
    merge_list = schedule.merge_list.cpu().numpy()
    np.testing.assert_array_equal(merge_list[:whole], want["merge_whole"])
    np.testing.assert_array_equal(merge_list[list_last - np.arange(by_rows)], want["merge_by_rows"])


def _check_fa3(device, lens, num_kv_heads):
    attn = evenkv.DecodeAttention(num_kv_heads * 2, num_kv_heads, 128, 16, torch.float16, device, max(len(lens), 1),
                                  64, "fa3", num_ctas=8)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    page_table = torch.zeros(len(lens), 64, dtype=torch.int32, device=device)
    plan = attn.plan(seq_lens, page_table)
    s = plan.schedule
    want = fa3_plan(lens, 64 * 16, attn.num_sms, num_kv_heads, attn.config.block_n, s.unit_req.shape[0])
    b = len(lens)
    np.testing.assert_array_equal(s.req_splits[:b].cpu().numpy(), want["req_splits"])
    np.testing.assert_array_equal(s.req_tiles_per_split[:b].cpu().numpy(), want["req_tiles_per_split"])
    np.testing.assert_array_equal(s.req_split_base[:b].cpu().numpy(), want["req_split_base"])
    n = len(want["unit_req"])
    assert n <= s.unit_req.shape[0], "fa3 unit capacity bound violated"
    np.testing.assert_array_equal(s.unit_req[:n].cpu().numpy(), want["unit_req"])
    np.testing.assert_array_equal(s.unit_split[:n].cpu().numpy(), want["unit_split"])
    assert s.num_units.item() == want["num_units"]
    _check_merge_lists(s, merge_lists(want["req_splits"], attn._whole_merge_splits), attn.max_batch_size - 1)
    # Splits cover each request's tiles exactly, none empty.
    for r, k in zip(want["unit_req"], want["unit_split"]):
        tiles = -(-min(max(lens[r], 0), 1024) // attn.config.block_n)
        begin = k * want["req_tiles_per_split"][r]
        assert tiles == 0 or begin < tiles


def test_fa3_worked_example():
    want = fa3_plan([10 * 64, 2 * 64, 0], 10**6, 4, 1, 64, 100)
    assert want["req_splits"].tolist() == [3, 1, 1]
    assert want["req_tiles_per_split"].tolist() == [4, 2, 1]
    assert list(zip(want["unit_req"].tolist(), want["unit_split"].tolist())) == [(0, 0), (0, 1), (0, 2), (1, 0), (2, 0)]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=lengths, num_kv_heads=st.sampled_from([1, 4, 8]))
def test_fa3_plan_properties(device, lens, num_kv_heads):
    """fa3 unit plans equal the oracle; units cover each request's tiles."""
    _check_fa3(device, lens, num_kv_heads)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=lengths, num_kv_heads=st.sampled_from([1, 2, 4]), num_ctas=st.integers(1, 300),
       max_total_tokens=st.sampled_from([1 << 21, 2048]))
def test_deterministic_plan_properties(device, lens, num_kv_heads, num_ctas, max_total_tokens):
    """The deterministic plan equals the oracle (chunks of the request's own length, CTA starts
    on chunk boundaries; larger chunks and the INVARIANCE_LOST flag when a batch overflows the
    workspace); every tile is walked once, no CTA cuts a chunk, every chunk of a segment of
    several has its own slot, which the merge reads."""
    want, cfg = _check_stream(device, lens, num_kv_heads, num_ctas, deterministic=True,
                              max_total_tokens=max_total_tokens)
    _stream_invariants(want, cfg, num_kv_heads, num_ctas)


def test_deterministic_chunks_depend_on_own_length_only():
    """The worked example of kernels.plan.chunk_tiles, and the same chunks in other batches."""
    a = chunks([100, 3, 0, 8192], 8, 128, 10**7)
    b = chunks([1, 100, 1, 1, 1, 8192, 9999], 8, 128, 10**7)
    assert a[0][[0, 3]].tolist() == b[0][[1, 5]].tolist() == [8, 64]
    assert a[1][[0, 3]].tolist() == b[1][[1, 5]].tolist() == [13, 128]
    assert a[1][2] == 0 and not a[3]


def test_deterministic_workspace_overflow_is_flagged(device):
    """A batch of more tokens than max_total_tokens (only possible with shared prefix pages)
    takes larger chunks to fit the workspace, still walks every tile, and says it is no
    longer invariant; the plan equals the oracle's."""
    want, cfg = _check_stream(device, [1024, 1024, 1024, 7], 4, 6, deterministic=True, max_total_tokens=1024)
    assert want["overflow"]
    _stream_invariants(want, cfg, 4, 6)


def test_plan_clamps_int64_lengths_past_int32(device):
    want, _ = _check_stream(device, [2**40, -2**40, 7], 2, 4, max_pages=4, page_size=16)
    assert want["seq_lens"].tolist() == [64, 0, 7]


@pytest.mark.parametrize("policy", ["balanced", "fa3"])
def test_plan_at_max_batch(device, policy):
    """B == max_batch_size, one huge request among ones and zeros."""
    lens = [1, 0] * 31 + [10**6, 5]
    attn = _attn(device, policy, 2, len(lens), 6)
    plan = attn.plan(torch.tensor(lens, device=device), torch.zeros(len(lens), 64, dtype=torch.int32, device=device))
    assert plan.batch_size == len(lens) == attn.max_batch_size
    if policy == "balanced":
        _stream_invariants(*_check_stream(device, lens, 2, 6), 2, 6)
    else:
        _check_fa3(device, lens, 2)


def test_plan_clamps_lengths_to_page_table(device):
    """A length beyond the page table is clamped on the GPU (no host check without debug):
    the kernels never index past a page-table row."""
    want, _ = _check_stream(device, [10**6, 5], 2, 4, max_pages=4, page_size=16)
    assert want["seq_lens"].tolist() == [64, 5]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("swa", [False, True], ids=["full-pool", "hybrid-pool"])
def test_page_tables_from_token_table(device, page_size, swa):
    """SGLang's page tables from its req_to_token rows, one launch: each request's entries up to
    its length (capped at the table width) are its tokens' slots / page_size (and, for a
    hybrid pool, those slots mapped to the window pool); entries past its length are left as
    they were; a row id outside the token table, a negative slot or a slot outside the mapping
    gives -1, and nothing outside the token table or the mapping is read."""
    from evenkv.kernels.plan_launch import launch_page_tables

    gen = torch.Generator().manual_seed(page_size)
    rows, cols, width, num_slots = 5, 40, 6, 200
    table = torch.randint(0, num_slots, (rows, cols), generator=gen, dtype=torch.int32)
    table[1, 0] = -1  # a negative slot
    table[3, 4 * page_size] = num_slots + 50  # past the mapping
    mapping = torch.randint(-1, 60, (num_slots + page_size + 1,), generator=gen)
    row_ids = torch.tensor([3, 0, 7, 1, -2, 2])  # rows 7 and -2 lie outside the table
    lens = torch.tensor([5 * page_size + 1, 0, 2 * page_size, 10**6, 3 * page_size, 2**63 - 2])
    out = torch.full((len(row_ids), width), -7, dtype=torch.int32)
    swa_out = torch.full_like(out, -9)
    launch_page_tables(table.to(device), row_ids.to(device), lens.to(device), out_dev := out.to(device),
                       page_size=page_size, swa_mapping=mapping.to(device) if swa else None,
                       swa_out=(swa_dev := swa_out.to(device)) if swa else None)
    want, want_swa = out.clone(), swa_out.clone()
    for b, (row, n) in enumerate(zip(row_ids.tolist(), lens.tolist())):
        used = min(-(-n // page_size), width)  # Python ints: no wrap
        for j in range(used):
            slot = int(table[row, j * page_size]) if 0 <= row < rows else -1
            want[b, j] = slot // page_size if slot >= 0 else -1
            mapped = int(mapping[slot]) if 0 <= slot < mapping.shape[0] else -1
            want_swa[b, j] = mapped // page_size if mapped >= 0 else -1
    assert torch.equal(out_dev.cpu(), want)
    # The cases are there: a request of length 0 untouched, rows outside the table and a negative
    # slot as -1, a length past the width capped at it.
    assert (want[1] == -7).all() and (want[2, :2] == -1).all() and (want[2, 2:] == -7).all()
    assert want[3, 0] == -1 and (want[3, 1:] >= 0).all() and (want[4, :3] == -1).all() and (want[5] >= 0).all()
    if swa:
        assert want_swa[0, 4] == -1  # its slot lies past the mapping
        assert torch.equal(swa_dev.cpu(), want_swa)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_query_row_guard_matches_a_running_max(device, dtype):
    """The query-row guard: each entry clamped to [-1, 2**31 - 1] and raised to the largest one
    before it, across the kernel's chunks (2,500 entries), flagged exactly where that changed an
    entry; a non-decreasing cu from >= 0 comes back as it is, unflagged."""
    from evenkv.kernels import plan_launch

    rng = np.random.default_rng(5)
    steps = rng.integers(0, 9, size=2500)
    steps[rng.random(2500) < 0.01] = -40  # ranges going back
    steps[[1024, 2048]] = -40  # at the first entry of a chunk: raised to the chunks before
    well_formed = np.concatenate([[0], np.cumsum(np.abs(steps[1:]))])
    hostile = np.cumsum(steps) - 3
    if dtype == torch.int64:
        hostile[1800:] += 2**32  # past int32: clamped, never wrapped
    for cu, flagged in ((well_formed, False), (hostile, True)):
        evenkv.errors.error_flag(device).zero_()
        out = torch.full((cu.size,), -7, dtype=torch.int32, device=device)
        plan_launch.launch_guard_query_rows(torch.tensor(cu, dtype=dtype, device=device), out,
                                            evenkv.errors.error_flag(device))
        want = np.maximum.accumulate(np.clip(cu, -1, 2**31 - 1))
        assert out.cpu().numpy().tolist() == want.tolist()
        assert bool(evenkv.errors.error_flag(device).item()) == flagged
    evenkv.errors.error_flag(device).zero_()
