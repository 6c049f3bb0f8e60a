"""Input validation shared by every public entry point.

Every failure raises ``TypeError`` (not a tensor, wrong dtype) or ``ValueError`` (wrong
rank, shape, device, value) with the argument's name, what was expected and what was
given. Never ``assert``: asserts vanish under ``python -O``.
"""

import functools
import math
import weakref

import torch

from .configs import is_interpreter

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
PAGE_SIZES = (1, 8, 16, 32, 64, 128)
SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)
INDEX_DTYPES = (torch.int32, torch.int64)
# KV caches may also hold FP8 (e4m3) with a per-tensor scale: real value = stored * scale.
FP8_KV_DTYPES = (torch.float8_e4m3fn,)
SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The kernels compute in float32: a scale (or a product of scales folded into one) must be a
# finite, normal float32 there, not an overflow to inf or an underflow to 0.
FP32_NORMAL_RANGE = (torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max)


def check_tensor(name: str, value, *, shape: tuple | None = None, dtypes: tuple | None = None,
                 device: torch.device | None = None, last_dim_contiguous: bool = False,
                 contiguous: bool = False) -> torch.Tensor:
    """Check ``value`` is a tensor of ``shape`` (None entries match any size), one of
    ``dtypes``, on ``device`` (``contiguous``: a dense row-major layout, as the kernels read
    tensors they take no strides for); return it."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if shape is not None:
        if value.dim() != len(shape):
            raise ValueError(f"{name}: expected {len(shape)} dims {_fmt(shape)}, got shape {tuple(value.shape)}")
        for want, got in zip(shape, value.shape):
            if want is not None and want != got:
                raise ValueError(f"{name}: expected shape {_fmt(shape)}, got {tuple(value.shape)}")
    if dtypes is not None and value.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {value.dtype}")
    if device is not None and not same_device(value.device, device):
        raise ValueError(f"{name}: expected device {device}, got {value.device}")
    if last_dim_contiguous and value.dim() > 0 and value.shape[-1] > 1 and value.stride(-1) != 1:
        raise ValueError(f"{name}: expected unit stride in the last dim, got strides {value.stride()}")
    if contiguous and not value.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got shape {tuple(value.shape)} with strides "
                         f"{value.stride()}")
    return value


def output_like(q: torch.Tensor, out, reads: tuple = ()) -> torch.Tensor:
    """``out`` checked to match the (already checked) ``q``: same shape, dtype and device,
    unit stride in the last dim, and sharing no element with q (unless it is q itself, a
    computation in place) nor with the other tensors the kernels read (``reads``: (name,
    tensor or None) pairs); a new tensor like q when ``out`` is None."""
    if out is None:
        return torch.empty_like(q)
    check_tensor("out", out, shape=tuple(q.shape), dtypes=(q.dtype,), device=q.device, last_dim_contiguous=True)
    if not out.is_contiguous():  # a contiguous tensor's elements are distinct
        check_distinct_elements("out", out)
    if not (out.data_ptr() == q.data_ptr() and out.stride() == q.stride()):
        check_no_shared_elements("out", out, "q", q)
    for name, read in reads:
        if read is not None:
            check_no_shared_elements("out", out, name, read)
    return out


def check_no_shared_elements(written_name: str, written: torch.Tensor, read_name: str, read: torch.Tensor) -> None:
    """A tensor the kernels write must share no element with another they read or write (they
    would read values already overwritten, or write one element twice). Views of one buffer
    pass when they provably share none: their byte ranges are apart, or (same shape and
    strides) their offset is no difference of two indices, as for the K and V halves of
    vLLM's cache. Views the test cannot separate are refused, named."""
    if (written.numel() == 0 or read.numel() == 0
            or written.untyped_storage().data_ptr() != read.untyped_storage().data_ptr()):
        return
    if _may_share_elements(_layout(written), _layout(read)):
        raise ValueError(f"{written_name}, {read_name}: expected no element in common ({written_name} is written while "
                         f"{read_name} is in use), got views of one buffer at {written.data_ptr():#x} (shape "
                         f"{tuple(written.shape)}, strides {written.stride()}) and {read.data_ptr():#x} (shape "
                         f"{tuple(read.shape)}, strides {read.stride()})")


def _layout(t: torch.Tensor) -> tuple:
    """(first element's address, shape, strides, element size): all ``_may_share_elements`` reads."""
    return t.data_ptr(), tuple(t.shape), t.stride(), t.element_size()


@functools.lru_cache(maxsize=1024)
def _may_share_elements(a: tuple, b: tuple) -> bool:
    """Whether views of one buffer with ``_layout``s a and b may share an element (False only
    when provably not). Cached: an engine passes the same caches every step (vLLM's K and V
    halves to every KV write), and the search below is Python."""
    (a_ptr, shape, stride, size), (b_ptr, b_shape, b_stride, b_size) = a, b

    def byte_end(ptr, dims, strides, elem):
        return ptr + (sum((n - 1) * st for n, st in zip(dims, strides)) + 1) * elem

    if byte_end(*a) <= b_ptr or byte_end(*b) <= a_ptr:
        return False
    delta, misaligned = divmod(b_ptr - a_ptr, size)
    if shape != b_shape or stride != b_stride or size != b_size or misaligned:
        return True
    # Equal layouts share an element iff delta = sum_i c_i * stride_i with |c_i| < size_i. Taken by
    # decreasing stride, c_i must leave a remainder the smaller dims can still reach.
    dims = sorted(((st, n) for st, n in zip(stride, shape) if n > 1 and st > 0), reverse=True)
    reach = [0] * (len(dims) + 1)
    for i in range(len(dims) - 1, -1, -1):
        reach[i] = reach[i + 1] + dims[i][0] * (dims[i][1] - 1)
    budget = [10_000]  # candidate digits tried before giving up (and refusing)

    def representable(i: int, rest: int) -> bool:
        if i == len(dims):
            return rest == 0
        step, n = dims[i]
        lo, hi = max(-(n - 1), -((reach[i + 1] - rest) // step)), min(n - 1, (rest + reach[i + 1]) // step)
        for digit in range(lo, hi + 1):
            budget[0] -= 1
            if budget[0] < 0 or representable(i + 1, rest - digit * step):
                return True
        return False

    return representable(0, delta)


def check_new_tokens(k_new, v_new, rows: int | None, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                     device: torch.device) -> None:
    """The new tokens' K/V an extend takes beside the cache: both None, or both [rows, Hkv, D]
    (``rows`` None: any) of ``dtype`` on ``device`` with a unit stride in D."""
    if (k_new is None) != (v_new is None):
        raise ValueError(f"k_new, v_new: expected both or neither, got k_new={'None' if k_new is None else 'a tensor'}"
                         f" and v_new={'None' if v_new is None else 'a tensor'}")
    for name, new in (("k_new", k_new), ("v_new", v_new)):
        if new is not None:
            check_tensor(name, new, shape=(rows, num_kv_heads, head_dim), dtypes=(dtype,), device=device,
                         last_dim_contiguous=True)


def check_positive_int(name: str, value, *, allowed: tuple | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected int, got {type(value).__name__}")
    if allowed is not None and value not in allowed:
        raise ValueError(f"{name}: expected one of {allowed}, got {value}")
    if value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value}")
    return value


def check_head_dim(head_dim, where: str = "") -> int:
    """head_dim: an int of SUPPORTED_HEAD_DIMS (TypeError if not an int, ValueError if another);
    ``where`` says where the value came from, e.g. " (q's last dim)"."""
    return check_positive_int(f"head_dim{where}", head_dim, allowed=SUPPORTED_HEAD_DIMS)


def check_policy(policy, policies: tuple) -> str:
    if policy not in policies:
        raise ValueError(f"policy: expected one of {policies}, got {policy!r}")
    return policy


def resolve_sm_scale(sm_scale, head_dim: int) -> float:
    """The softmax scale: ``sm_scale`` checked (finite, > 0), or 1/sqrt(head_dim) if None."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise TypeError(f"sm_scale: expected None or float, got {type(sm_scale).__name__}")
    return check_fp32_scale("sm_scale", sm_scale)


def check_new_token_v_scale(v_scale: float, dtype: torch.dtype, kv_dtype: torch.dtype, has_new: bool) -> None:
    """Over an FP8 cache the extend kernel accumulates V in stored units, so the new tokens'
    (k_new / v_new, real values) probabilities enter it as p / v_scale, in q's ``dtype``:
    1 / v_scale must fit that dtype (fp16: v_scale >= 1 / 65504)."""
    if has_new and kv_dtype in FP8_KV_DTYPES and v_scale * torch.finfo(dtype).max < 1.0:
        raise ValueError(f"v_scale: expected >= 1 / {torch.finfo(dtype).max:g} for an FP8 cache with k_new / v_new "
                         f"and {dtype} queries (1 / v_scale must fit {dtype}), got {v_scale}")


def check_fp32_scale(name: str, value: float) -> float:
    """A host float the kernels use as a float32 factor: finite, > 0 and a normal float32."""
    lo, hi = FP32_NORMAL_RANGE
    if not (math.isfinite(value) and lo <= value <= hi):
        raise ValueError(f"{name}: expected a finite scale > 0 within float32's normal range [{lo:.3g}, {hi:.3g}], "
                         f"got {value}")
    return float(value)


def resolve_kv_dtype(kv_dtype, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype: ``dtype`` (q's) when ``kv_dtype`` is None, else ``kv_dtype`` checked
    to be ``dtype`` itself or an FP8 dtype of FP8_KV_DTYPES."""
    if kv_dtype is None:
        return dtype
    if kv_dtype != dtype and kv_dtype not in FP8_KV_DTYPES:
        raise TypeError(f"kv_dtype: expected None, {dtype} (q's dtype) or "
                        f"{' or '.join(map(str, FP8_KV_DTYPES))}, got {kv_dtype}")
    return kv_dtype


def check_fp8_capable(kv_dtype: torch.dtype, device: torch.device, name: str = "kv_dtype") -> None:
    """An FP8 cache on a GPU needs compute capability 8.9 or newer: Triton converts e4m3
    only there (an A100 can neither widen nor store it). ``name``: the argument the dtype came from."""
    if kv_dtype in FP8_KV_DTYPES and device.type == "cuda" and not is_interpreter():
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(f"{name}: {kv_dtype} needs a GPU of compute capability 8.9 or newer, got "
                             f"{capability[0]}.{capability[1]}")


def check_kv_scale(name: str, value) -> float:
    """A per-tensor KV dequantization scale (real = stored * scale): a finite host float > 0.
    A tensor is refused: reading it would sync the host with the GPU on every call."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a host float (real value = stored value x {name}), got "
                        f"{type(value).__name__}")
    return check_fp32_scale(name, value)


def check_sinks(sinks, num_q_heads: int, device: torch.device) -> torch.Tensor | None:
    """None, or the per-query-head sink logits [Hq] (float32/bfloat16/float16, contiguous, on
    ``device``): each adds exp(sink) to its head's softmax denominator (gpt-oss)."""
    if sinks is None:
        return None
    check_tensor("sinks", sinks, shape=(num_q_heads,), dtypes=SINK_DTYPES, device=device)
    if num_q_heads > 1 and sinks.stride(0) != 1:
        raise ValueError(f"sinks: expected a contiguous [Hq={num_q_heads}] tensor, got stride {sinks.stride()}")
    return sinks


def normalize_window(sliding_window) -> int | None:
    """None or 0 -> None (no window); int W >= 1 -> W: a query at position p sees keys
    [p - W + 1, p] (``evenkv.extend`` documents the engines' conventions)."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
        raise TypeError(f"sliding_window: expected None or int, got {type(sliding_window).__name__}")
    if sliding_window < 0:
        raise ValueError(f"sliding_window: expected None, 0 (no window) or a window W >= 1, got {sliding_window}")
    return sliding_window or None


def normalize_logit_cap(logit_cap) -> float | None:
    """None or 0 -> None (no cap); c > 0 -> float(c)."""
    if logit_cap is None:
        return None
    if isinstance(logit_cap, bool) or not isinstance(logit_cap, (int, float)):
        raise TypeError(f"logit_cap: expected None or float, got {type(logit_cap).__name__}")
    if logit_cap == 0:
        return None
    if logit_cap < 0:
        raise ValueError(f"logit_cap: expected None, 0 (no cap) or a finite cap > 0, got {logit_cap}")
    return check_fp32_scale("logit_cap", logit_cap)


def check_batch_metadata(seq_lens, page_table, device: torch.device, cu_seqlens_q=None, *,
                         cu_required: bool = False) -> int:
    """A batch's metadata; returns its size B, the page table's row count.

    page_table: [B, max_pages] int32 on ``device``, unit stride in the last dim.
    seq_lens: [B] int32/int64 on ``device``, contiguous. cu_seqlens_q: [B + 1] int32/int64 on
    ``device``, contiguous; None allowed unless ``cu_required``. A length that disagrees with
    the page table's rows names both shapes."""
    check_tensor("page_table", page_table, shape=(None, None), dtypes=(torch.int32,), device=device)
    if page_table.shape[0] > 0 and page_table.shape[1] > 1 and page_table.stride(1) != 1:
        raise ValueError(f"page_table: expected unit stride in the last dim, got strides {page_table.stride()}")
    batch = page_table.shape[0]
    check_tensor("seq_lens", seq_lens, shape=(None,), dtypes=INDEX_DTYPES, device=device, contiguous=True)
    if seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens: expected shape [{batch}], one length per row of page_table (shape "
                         f"{tuple(page_table.shape)}), got shape {tuple(seq_lens.shape)}")
    if cu_seqlens_q is not None or cu_required:
        check_tensor("cu_seqlens_q", cu_seqlens_q, shape=(None,), dtypes=INDEX_DTYPES, device=device, contiguous=True)
        if cu_seqlens_q.shape[0] != batch + 1:
            raise ValueError(f"cu_seqlens_q: expected shape [{batch + 1}], B + 1 for the B = {batch} rows of "
                             f"page_table (shape {tuple(page_table.shape)}), got shape {tuple(cu_seqlens_q.shape)}")
    return batch


def check_cache(name: str, cache, *, page_size: int | None, dtypes: tuple | None,
                device: torch.device | None) -> torch.Tensor:
    """A paged KV cache viewed as [num_slots, Hkv, D] (slot = page x page_size + offset) or
    [num_pages, page_size, Hkv, D], any strides but a unit stride in D, of one of ``dtypes``
    and on ``device`` (None: any). ``page_size`` (None: any) must match a 4-D cache's second dim:
    a 3-D cache cannot show its page size, so nothing can check it there."""
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(cache).__name__}")
    if cache.dim() not in (3, 4):
        raise ValueError(f"{name}: expected [num_slots, Hkv, D] or [num_pages, page_size, Hkv, D], "
                         f"got shape {tuple(cache.shape)}")
    if cache.dim() == 4 and page_size is not None and cache.shape[1] != page_size:
        raise ValueError(f"{name}: expected [num_pages, page_size={page_size}, Hkv, D], got shape "
                         f"{tuple(cache.shape)}")
    return check_tensor(name, cache, dtypes=dtypes, device=device, last_dim_contiguous=True)


def check_kv_caches(k_cache, v_cache, *, page_size: int | None, dtypes: tuple, device: torch.device | None,
                    num_kv_heads: int | None = None, head_dim: int | None = None) -> torch.device:
    """k_cache, v_cache: one paged KV cache (``check_cache``), both of one shape, k_cache of one
    of ``dtypes`` and v_cache of k_cache's; Hkv = num_kv_heads and D = head_dim where given.
    Returns the caches' device (``device``, or k_cache's when None)."""
    check_cache("k_cache", k_cache, page_size=page_size, dtypes=dtypes, device=device)
    if device is None:
        device = resolve_device(k_cache.device, "k_cache")
    hkv, d = k_cache.shape[-2:]
    if num_kv_heads not in (None, hkv) or head_dim not in (None, d):
        want = (f"Hkv{'' if num_kv_heads is None else '=' + str(num_kv_heads)}, "
                f"D{'' if head_dim is None else '=' + str(head_dim)}")
        raise ValueError(f"k_cache: expected [..., {want}], got shape {tuple(k_cache.shape)}")
    check_tensor("v_cache", v_cache, shape=tuple(k_cache.shape), dtypes=(k_cache.dtype,), device=device,
                 last_dim_contiguous=True)
    return device


def as_pages(cache: torch.Tensor, page_size: int) -> torch.Tensor:
    """A checked cache (``check_cache``) as [num_pages, page_size, Hkv, D], without a copy: a 4-D
    cache as it is (any strides: NHD or HND pages, pages of a cross-layer allocation), a 3-D
    [num_slots, Hkv, D] one as its whole pages (slot = page x page_size + offset; slots past the
    last whole page are not addressed). The kernels address a token as page x page stride +
    offset x offset stride + head x head stride."""
    if cache.dim() == 4:
        return cache
    num_pages = cache.shape[0] // page_size
    if num_pages * page_size != cache.shape[0]:
        cache = cache[:num_pages * page_size]
    return cache.view(num_pages, page_size, cache.shape[1], cache.shape[2])


def check_distinct_elements(name: str, cache: torch.Tensor) -> None:
    """A tensor written in place (a cache, an output) must not alias itself (an expanded view,
    strides that overlap): taken by increasing stride, each dim's stride must pass the largest
    offset the dims inside it reach. Sufficient, and every cache an engine allocates passes it
    (NHD or HND pages, the K and V halves of vLLM's cache, a cross-layer allocation)."""
    reach = 0
    for stride, size in sorted((st, sz) for st, sz in zip(cache.stride(), cache.shape) if sz > 1):
        if stride <= reach:
            raise ValueError(f"{name}: expected a tensor whose elements are distinct (it is written in place), got "
                             f"shape {tuple(cache.shape)} with strides {cache.stride()}")
        reach += stride * (size - 1)


def decode_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, page_size: int) -> tuple:
    """Checked caches (``check_kv_caches``) as the decode kernels read them: ``as_pages`` views;
    an FP8 cache also needs even strides and an even start, as every cache PyTorch allocates
    has, since decode reads its elements two at a time (int16)."""
    k_pages, v_pages = as_pages(k_cache, page_size), as_pages(v_cache, page_size)
    if k_pages.dtype in FP8_KV_DTYPES:
        for name, cache in (("k_cache", k_pages), ("v_cache", v_pages)):
            if any(s % 2 for s in cache.stride()[:3]) or cache.data_ptr() % 2:
                raise ValueError(f"{name}: an FP8 cache is read two elements at a time: expected even page, "
                                 f"offset and head strides and a 2-byte aligned start, got strides "
                                 f"{cache.stride()} (as pages) and address {cache.data_ptr():#x}")
    return k_pages, v_pages


class PlanRecord:
    """The plans one planning object has made, so that ``run`` can tell its latest plan from
    an older one (its buffers now hold another batch) and from another object's."""

    def __init__(self, owner: str):
        self.owner = owner
        self._made = weakref.WeakSet()

    def add(self, plan):
        self._made.add(plan)
        return plan

    def check(self, plan, plan_type: type, latest) -> None:
        """``plan`` must be ``latest``, this object's latest plan, of ``plan_type``."""
        if not isinstance(plan, plan_type):
            raise TypeError(f"plan: expected the {plan_type.__name__} returned by plan(), got {type(plan).__name__}")
        if plan is latest:
            return
        if plan in self._made:
            raise ValueError(f"plan: expected this {self.owner}'s latest plan; it has planned another batch since "
                             "(its buffers hold one plan at a time): plan this batch again")
        raise ValueError(f"plan: expected a plan made by this {self.owner}, got one made by another {self.owner} "
                         "object (a plan lives in its maker's buffers): run it there, or plan the batch here")


def check_attention_layout(num_q_heads, num_kv_heads, page_size, dtype, max_batch_size,
                           max_pages_per_request) -> None:
    """Constructor arguments shared by DecodeAttention and Attention (head_dim is
    checked by each, against the head dims its kernels support)."""
    check_positive_int("num_q_heads", num_q_heads)
    check_positive_int("num_kv_heads", num_kv_heads)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads: expected a multiple of num_kv_heads={num_kv_heads}, got {num_q_heads}")
    check_positive_int("page_size", page_size, allowed=PAGE_SIZES)
    check_positive_int("max_batch_size", max_batch_size)
    check_positive_int("max_pages_per_request", max_pages_per_request)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype: expected torch.float16 or torch.bfloat16, got {dtype}")


def check_batch_limits(batch: int, page_table: torch.Tensor, max_batch_size: int, max_pages_per_request: int) -> None:
    """A planned batch must fit the workspaces sized at construction."""
    if batch > max_batch_size:
        raise ValueError(f"page_table: expected at most max_batch_size={max_batch_size} rows (requests), got "
                         f"{batch}")
    if page_table.shape[1] > max_pages_per_request:
        raise ValueError(f"page_table: expected at most max_pages_per_request={max_pages_per_request} "
                         f"columns, got {page_table.shape[1]}")


def resolve_device(device, name: str = "device") -> torch.device:
    """torch.device(device), with a bare "cuda" pinned to the current device index.

    evenkv's kernels run on CUDA GPUs, or on the CPU under Triton's interpreter; any other
    device is refused here, before a kernel fails inside Triton. ``name``: the argument to
    blame, the ``device`` argument or the tensor whose device this is."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"{name}: expected a torch.device, 'cuda', 'cuda:N' or 'cpu', "
                         f"got {device!r} ({err})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}: expected a CUDA device that torch can see, got 'cuda' but "
                             "torch.cuda.is_available() is False (a CPU-only torch build, or no GPU); on a CPU "
                             "set TRITON_INTERPRET=1 before importing evenkv and use device 'cpu'")
        return torch.device("cuda", torch.cuda.current_device()) if device.index is None else device
    if device.type == "cpu":
        if not is_interpreter():
            raise ValueError(f"{name}: expected a CUDA device, got 'cpu': evenkv's Triton kernels run on the CPU "
                             "only in Triton's interpreter; set TRITON_INTERPRET=1 before importing evenkv (slow, "
                             "for tests and demos) or use a CUDA GPU")
        return device
    raise ValueError(f"{name}: expected a CUDA device (or 'cpu' under TRITON_INTERPRET=1), got {device}")


def same_device(a: torch.device, b: torch.device) -> bool:
    """Device equality where ``cuda`` and ``cuda:<current>`` are the same device."""
    if a == b:  # the common case, checked on every call of every layer: no device objects built
        return True
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


def _fmt(shape: tuple) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
