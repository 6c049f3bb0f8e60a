"""Input validation shared by every public entry point.

Every failure raises ``TypeError`` (not a tensor, wrong dtype) or ``ValueError`` (wrong
rank, shape, device, value) with the argument's name, what was expected and what was
given. Never ``assert``: asserts vanish under ``python -O``.
"""

import math

import torch

from .configs import is_interpreter

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
PAGE_SIZES = (1, 8, 16, 32, 64, 128)
SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)
INDEX_DTYPES = (torch.int32, torch.int64)
# KV caches may also hold FP8 (e4m3) with a per-tensor scale: real value = stored * scale.
FP8_KV_DTYPES = (torch.float8_e4m3fn,)
SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_tensor(name: str, value, *, shape: tuple | None = None, dtypes: tuple | None = None,
                 device: torch.device | None = None, last_dim_contiguous: bool = False) -> torch.Tensor:
    """Check ``value`` is a tensor of ``shape`` (None entries match any size), one of
    ``dtypes``, on ``device``; return it."""
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
    return value


def output_like(q: torch.Tensor, out) -> torch.Tensor:
    """``out`` checked to match the (already checked) ``q``: same shape, dtype and device,
    unit stride in the last dim; a new tensor like q when ``out`` is None."""
    if out is None:
        return torch.empty_like(q)
    return check_tensor("out", out, shape=tuple(q.shape), dtypes=(q.dtype,), device=q.device,
                        last_dim_contiguous=True)


def check_positive_int(name: str, value, *, allowed: tuple | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected int, got {type(value).__name__}")
    if allowed is not None and value not in allowed:
        raise ValueError(f"{name}: expected one of {allowed}, got {value}")
    if value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value}")
    return value


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
    if not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale: expected a finite scale > 0, got {sm_scale}")
    return float(sm_scale)


def resolve_kv_dtype(kv_dtype, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype: ``dtype`` (q's) when ``kv_dtype`` is None, else ``kv_dtype`` checked
    to be ``dtype`` itself or an FP8 dtype of FP8_KV_DTYPES."""
    if kv_dtype is None:
        return dtype
    if kv_dtype != dtype and kv_dtype not in FP8_KV_DTYPES:
        raise TypeError(f"kv_dtype: expected None, {dtype} (q's dtype) or "
                        f"{' or '.join(map(str, FP8_KV_DTYPES))}, got {kv_dtype}")
    return kv_dtype


def check_fp8_capable(kv_dtype: torch.dtype, device: torch.device) -> None:
    """An FP8 cache on a GPU needs compute capability 8.9 or newer: Triton converts e4m3
    only there (an A100 cannot widen it)."""
    if kv_dtype in FP8_KV_DTYPES and device.type == "cuda" and not is_interpreter():
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(f"kv_dtype: {kv_dtype} needs a GPU of compute capability 8.9 or newer, got "
                             f"{capability[0]}.{capability[1]}")


def check_kv_scale(name: str, value) -> float:
    """A per-tensor KV dequantization scale (real = stored * scale): a finite host float > 0.
    A tensor is refused: reading it would sync the host with the GPU on every call."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a host float (real value = stored value x {name}), got "
                        f"{type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected a finite scale > 0, got {value}")
    return float(value)


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
    if not math.isfinite(logit_cap) or logit_cap < 0:
        raise ValueError(f"logit_cap: expected None, 0 (no cap) or a finite cap > 0, got {logit_cap}")
    return float(logit_cap) or None


def check_page_table(page_table, batch: int, device: torch.device) -> torch.Tensor:
    """page_table: [batch, max_pages] int32 on ``device``, unit stride in the last dim."""
    check_tensor("page_table", page_table, shape=(batch, None), dtypes=(torch.int32,), device=device)
    if batch > 0 and page_table.shape[1] > 1 and page_table.stride(1) != 1:
        raise ValueError(f"page_table: expected unit stride in the last dim, got strides {page_table.stride()}")
    return page_table


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
        raise ValueError(f"seq_lens: batch size {batch} exceeds max_batch_size={max_batch_size}")
    if page_table.shape[1] > max_pages_per_request:
        raise ValueError(f"page_table: expected at most max_pages_per_request={max_pages_per_request} "
                         f"columns, got {page_table.shape[1]}")


def resolve_device(device) -> torch.device:
    """torch.device(device), with a bare "cuda" pinned to the current device index.

    evenkv's kernels run on CUDA GPUs, or on the CPU under Triton's interpreter; any other
    device is refused here, before a kernel fails inside Triton."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device: expected a CUDA device that torch can see, got 'cuda' but "
                             "torch.cuda.is_available() is False (a CPU-only torch build, or no GPU); on a CPU "
                             "set TRITON_INTERPRET=1 before importing evenkv and pass device='cpu'")
        return torch.device("cuda", torch.cuda.current_device()) if device.index is None else device
    if device.type == "cpu":
        if not is_interpreter():
            raise ValueError("device: expected a CUDA device, got 'cpu': evenkv's Triton kernels run on the CPU "
                             "only in Triton's interpreter; set TRITON_INTERPRET=1 before importing evenkv (slow, "
                             "for tests and demos) or use a CUDA GPU")
        return device
    raise ValueError(f"device: expected a CUDA device (or 'cpu' under TRITON_INTERPRET=1), got {device}")


def same_device(a: torch.device, b: torch.device) -> bool:
    """Device equality where ``cuda`` and ``cuda:<current>`` are the same device."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


def _fmt(shape: tuple) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
