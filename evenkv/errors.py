"""The device-side error flag: bad batch data found by the kernels, without a host sync.

The kernels never read or write outside the caches and tensors they are given, whatever the
page table, slots and lengths say: a page id outside the KV cache is never dereferenced
(its tokens' K and V read as zeros), a slot outside the cache is not
written, lengths are clamped to the page table (negatives count as 0; an extend row's
seq_len is raised to its q_len), and query rows are clamped to ``q`` and made non-decreasing
(``plan.guard_query_rows_kernel``: no request runs on another's rows). Each of these sets a
bit of one int32 flag per device, which a host can read when it chooses:

    evenkv.check_errors()        # syncs; raises EvenKVError naming what was wrong, and clears
    evenkv.errors.peek(device)   # syncs; the reasons, without raising or clearing
    ErrorWatcher(device).poll()  # no sync: reports what an earlier step's copy brought back

``EVENKV_DEBUG=1`` (or ``debug=True``) instead checks the data on the host before each launch
and raises at once, naming the argument (it syncs).
"""

import logging

import torch

from evenkv.kernels import error_bits

from .configs import graph_capturing

PAGE_OUT_OF_RANGE = error_bits.PAGE_OUT_OF_RANGE.value
SLOT_OUT_OF_RANGE = error_bits.SLOT_OUT_OF_RANGE.value
LENGTH_OUT_OF_RANGE = error_bits.LENGTH_OUT_OF_RANGE.value
QUERY_OUT_OF_RANGE = error_bits.QUERY_OUT_OF_RANGE.value
INVARIANCE_LOST = error_bits.INVARIANCE_LOST.value
SEQ_LEN_BELOW_Q_LEN = error_bits.SEQ_LEN_BELOW_Q_LEN.value

REASONS = {
    PAGE_OUT_OF_RANGE: "page_table: a page id outside the KV cache in a used entry (never read: those tokens' K "
                       "and V were taken as zeros, or on an engine's prefill kernel that request read no keys, so "
                       "its result is wrong)",
    SLOT_OUT_OF_RANGE: "slot_mapping: a slot >= the KV cache's slots (that token was not written)",
    LENGTH_OUT_OF_RANGE: "seq_lens: a length < 0 or past the page table's capacity (clamped)",
    QUERY_OUT_OF_RANGE: "cu_seqlens_q / max_q_len: a query range outside q, longer than max_q_len or (decode rows) "
                        "than its seq_len, off its row (plain decode) or starting before row 0: that request ran on "
                        "the rows left inside those bounds (none for a range starting before row 0; for a range going "
                        "back before an earlier request's end, its rows past that end) and its other rows were not "
                        "written, so its output is wrong; no request's rows were written by another",
    SEQ_LEN_BELOW_Q_LEN: "seq_lens: a length below its request's q_len (seq_lens count the new tokens too; read as "
                         "q_len, so its queries saw only the first q_len positions)",
    INVARIANCE_LOST: "deterministic decode: a batch held more tokens than max_total_tokens (shared prefix pages?); "
                     "it was split by its total, so it is correct but not bitwise batch invariant",
}

_FLAGS: dict[torch.device, torch.Tensor] = {}
logger = logging.getLogger("evenkv")


class EvenKVError(RuntimeError):
    """Bad batch data seen by a kernel (see ``REASONS``)."""


def _key(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def error_flag(device) -> torch.Tensor:
    """The [1] int32 flag of ``device``, allocated on first use. Objects that plan under CUDA
    graphs take it at construction, so the graphs hold its address."""
    key = _key(device)
    flag = _FLAGS.get(key)
    if flag is None:
        flag = _FLAGS[key] = torch.zeros(1, dtype=torch.int32, device=key)
    return flag


def reasons(bits: int) -> list[str]:
    return [text for bit, text in REASONS.items() if bits & bit]


def peek(device=None) -> list[str]:
    """The reasons recorded on ``device`` (default: the current CUDA device, else the CPU); syncs."""
    return reasons(int(error_flag(_default(device)).item()))


def check_errors(device=None, *, clear: bool = True) -> None:
    """Raise EvenKVError if a kernel on ``device`` saw bad batch data since the last clear; syncs."""
    flag = error_flag(_default(device))
    bits = int(flag.item())
    if clear:
        flag.zero_()
    if bits:
        raise EvenKVError("evenkv kernels saw bad batch data: " + "; ".join(reasons(bits)))


def _default(device) -> torch.device:
    if device is not None:
        return _key(device)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class ErrorWatcher:
    """Reports the flag once per call of ``poll`` without ever waiting on the GPU: each poll
    starts a copy of the flag to pinned host memory and reads the copy an earlier poll
    started, once the GPU has finished it. A report logs at ERROR level (logger ``evenkv``)
    and clears the flag. Engine adapters call ``poll`` once per step."""

    def __init__(self, device):
        self.device = _key(device)
        self.flag = error_flag(self.device)
        self._on_gpu = self.device.type == "cuda"
        self._host = torch.zeros(1, dtype=torch.int32, pin_memory=self._on_gpu)
        self._event = None

    def poll(self) -> list[str]:
        """The reasons an earlier step recorded ([] if none, or if its copy is not back yet)."""
        if not self._on_gpu:
            bits = int(self.flag.item())
            if bits:
                self.flag.zero_()
            return self._report(bits)
        if graph_capturing():
            return []
        found = []
        if self._event is not None and self._event.query():
            found = self._report(int(self._host.item()))
            if found:
                self.flag.zero_()
            self._event = None
        if self._event is None:
            self._host.copy_(self.flag, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        return found

    @staticmethod
    def _report(bits: int) -> list[str]:
        found = reasons(bits)
        if found:
            logger.error("evenkv: the kernels saw bad batch data (nothing outside the caches was read or written; "
                         "the affected rows are not meaningful): %s", "; ".join(found))
        return found


__all__ = ["EvenKVError", "ErrorWatcher", "check_errors", "error_flag", "peek", "reasons", "REASONS",
           "PAGE_OUT_OF_RANGE", "SLOT_OUT_OF_RANGE", "LENGTH_OUT_OF_RANGE", "QUERY_OUT_OF_RANGE", "INVARIANCE_LOST",
           "SEQ_LEN_BELOW_Q_LEN"]
