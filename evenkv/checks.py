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


def check_page_table(page_table, batch: int, device: torch.device) -> torch.Tensor:
    """page_table: [batch, max_pages] int32 on ``device``, unit stride in the last dim."""
    check_tensor("page_table", page_table, shape=(batch, None), dtypes=(torch.int32,), device=device)
    if batch > 0 and page_table.shape[1] > 1 and page_table.stride(1) != 1:
        raise ValueError(f"page_table: expected unit stride in the last dim, got strides {page_table.stride()}")
    return page_table


def check_attention_layout(num_q_heads, num_kv_heads, page_size, dtype, max_batch_size,
                           max_pages_per_request) -> None:
    """Constructor arguments shared by DecodeAttention and MixedAttention (head_dim is
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
