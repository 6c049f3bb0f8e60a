"""SGLang plugin: ``--attention-backend evenkv`` (and ``--decode-attention-backend evenkv``).

SGLang loads the entry point ``sglang.srt.plugins`` -> ``evenkv.integrations.sglang:register``
in every one of its processes (the CLI, ``Engine.__init__`` and each spawned scheduler), so
``register`` is cheap and idempotent: it adds ``evenkv`` to the argparse choices and registers a
factory. The factory runs in the scheduler when the model runner builds its attention backends;
it checks the configuration first and refuses, with every reason at once, what evenkv does not
support, then imports the backend class (``evenkv.integrations.sglang_backend``) lazily.

Knob: ``EVENKV_POLICY`` = ``balanced`` (default) | ``fa3`` | ``none`` picks the decode
schedule (``evenkv.DecodeAttention``'s ``policy``); ``EVENKV_DETERMINISTIC=1`` makes decode
batch invariant (``DecodeAttention(deterministic=True)``).

Tested with SGLang 0.5.17 and 0.5.23.
"""

from __future__ import annotations

import os

NAME = "evenkv"
POLICY_ENV = "EVENKV_POLICY"


def register() -> None:
    """Make ``evenkv`` a valid SGLang attention backend in this process (idempotent)."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    # The choices list is shared by --attention-backend, --prefill-attention-backend and
    # --decode-attention-backend (argparse keeps a reference), so one append covers all three.
    if NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([NAME])
    _declare_deterministic()
    if ATTENTION_BACKENDS.get(NAME) is not create_backend:
        register_attention_backend(NAME)(create_backend)


def _declare_deterministic() -> None:
    """--enable-deterministic-inference accepts evenkv (with and without the radix cache): its
    deterministic decode is batch invariant and its prefill does not depend on the chunking."""
    import sglang.srt.server_args as server_args

    for table, add in (("DETERMINISTIC_ATTENTION_BACKEND_CHOICES", "add_deterministic_attention_backend_choices"),
                       ("RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND",
                        "add_radix_supported_deterministic_attention_backend_choices")):
        choices = getattr(server_args, table, None)
        if choices is not None and NAME not in choices:
            getattr(server_args, add)([NAME])


def create_backend(model_runner):
    """The registry's factory: validate, then build the backend for ``model_runner``.

    Raises NotImplementedError listing every unsupported feature of the configuration.
    """
    reasons = unsupported_reasons(model_runner)
    if reasons:
        raise NotImplementedError(
            "evenkv attention backend cannot serve this configuration:\n  - " + "\n  - ".join(reasons)
            + "\nUse another --attention-backend (e.g. triton), or evenkv only for decode with "
            "--decode-attention-backend evenkv where the unsupported part is prefill-only.")
    from evenkv.integrations.sglang_backend import EvenKVAttnBackend  # lazy: keeps CLI processes light

    return EvenKVAttnBackend(model_runner, policy=os.environ.get(POLICY_ENV, "balanced"))


def unsupported_reasons(model_runner) -> list[str]:
    """Every reason evenkv cannot serve ``model_runner``'s configuration ([] = supported)."""
    from evenkv.checks import PAGE_SIZES
    from evenkv.decode_attention import POLICIES
    from evenkv.checks import FP8_KV_DTYPES, SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS

    reasons = []
    args = model_runner.server_args
    cfg = model_runner.model_config

    policy = os.environ.get(POLICY_ENV, "balanced")
    if policy not in POLICIES:
        reasons.append(f"{POLICY_ENV}={policy!r}: expected one of {POLICIES}")

    # Model architecture.
    if getattr(model_runner, "use_mla_backend", False) or _is_mla(cfg):
        reasons.append("MLA models (DeepSeek-style latent attention) are not supported; evenkv is MHA/GQA only")
    if getattr(cfg, "is_encoder_decoder", False):
        reasons.append("encoder-decoder models (cross attention) are not supported")

    # Serving modes evenkv does not implement.
    if getattr(args, "speculative_algorithm", None) is not None:
        reasons.append(f"speculative decoding ({args.speculative_algorithm}) is not supported: evenkv implements "
                       "no target-verify / draft-extend metadata")
    if getattr(model_runner, "is_draft_worker", False):
        reasons.append("draft workers (speculative decoding) are not supported")
    if getattr(args, "dllm_algorithm", None) is not None:
        reasons.append(f"diffusion LLM decoding ({args.dllm_algorithm}) is not supported (block-bidirectional "
                       "attention)")
    if getattr(args, "enable_pdmux", False):
        reasons.append("PD multiplexing (--enable-pdmux, SPLIT_PREFILL batches) is not supported")
    for field, what in (("attn_dcp_size", "decode context parallelism"), ("attn_cp_size", "context parallelism")):
        size = _parallel_size(field)
        if size is not None and size > 1:
            reasons.append(f"{what} ({field}={size}) is not supported")

    # KV cache: a plain token pool in the model dtype, NHD layout, identity slot ids.
    pool = model_runner.token_to_kv_pool
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    if not isinstance(pool, MHATokenToKVPool):
        hint = (" (a sliding-window model: add --disable-hybrid-swa-memory, so every layer reads the one "
                "token pool)" if getattr(model_runner, "is_hybrid_swa", False) else "")
        reasons.append(f"KV pool {type(pool).__name__} is not supported (evenkv reads MHATokenToKVPool's "
                       f"[slots, heads, head_dim] buffers; hybrid SWA/linear/MLA pools are not){hint}")
    else:
        if getattr(pool, "kv_cache_layout", "nhd") != "nhd":
            reasons.append(f"KV cache layout {pool.kv_cache_layout!r} is not supported (only NHD; unset "
                           "SGLANG_USE_HND_KVCACHE)")
        if getattr(pool, "is_quantized_kv_cache", False) or pool.dtype not in SUPPORTED_DTYPES + FP8_KV_DTYPES:
            reasons.append(f"KV cache dtype {pool.dtype} is not supported (fp16/bf16, or fp8_e4m3 with per-tensor "
                           "scales; no fp8_e5m2/fp4 KV cache)")
        if pool.head_dim not in SUPPORTED_HEAD_DIMS:
            reasons.append(f"head_dim {pool.head_dim} is not supported (evenkv: {SUPPORTED_HEAD_DIMS})")
        if pool.v_head_dim != pool.head_dim:
            reasons.append(f"v_head_dim {pool.v_head_dim} != head_dim {pool.head_dim} is not supported")
    model_dtype = getattr(model_runner, "dtype", None)
    if model_dtype is not None and isinstance(pool, MHATokenToKVPool) and model_dtype != pool.dtype \
            and pool.dtype not in FP8_KV_DTYPES:
        reasons.append(f"model dtype {model_dtype} differs from KV cache dtype {pool.dtype}")
    if model_dtype is not None and model_dtype not in SUPPORTED_DTYPES:
        reasons.append(f"model dtype {model_dtype} is not supported (evenkv: fp16/bf16)")
    allocator = getattr(model_runner, "token_to_kv_pool_allocator", None)
    if getattr(allocator, "translate_kv_loc", None) is not None:
        reasons.append(f"KV allocator {type(allocator).__name__} maps virtual to physical slots "
                       "(unified pools); evenkv reads req_to_token slots as physical")
    translator = getattr(model_runner, "kv_index_translator", None)  # SGLang >= 0.5.23
    if getattr(translator, "is_translating", False):
        reasons.append("the KV index translator maps virtual to physical slots; evenkv reads req_to_token slots "
                       "as physical")
    page_size = getattr(model_runner, "page_size", 1) or 1
    if page_size not in PAGE_SIZES:
        reasons.append(f"page size {page_size} is not supported (evenkv: {PAGE_SIZES})")
    return reasons


def _is_mla(model_config) -> bool:
    from sglang.srt.configs.model_config import AttentionArch

    return getattr(model_config, "attention_arch", None) == AttentionArch.MLA


def _parallel_size(field: str) -> int | None:
    """A parallel size from SGLang's runtime context, or None where the group is not set up."""
    from sglang.srt.runtime_context import get_parallel

    try:
        return int(getattr(get_parallel(), field))
    except (AssertionError, AttributeError, RuntimeError, TypeError, ValueError):
        return None


__all__ = ["NAME", "register", "create_backend", "unsupported_reasons"]
