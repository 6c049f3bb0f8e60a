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

Speculative decoding (``--speculative-algorithm NGRAM | EAGLE | EAGLE3 | STANDALONE``): the target
model's verify batches run on evenkv (``speculative_verify``). An EAGLE-family draft model's
attention runs on the backend named by ``--speculative-draft-attention-backend``. SGLang builds
a draft worker's backends from a fixed table of its own (``DraftBackendFactory``,
``sglang/srt/speculative/draft_utils.py``); ``register`` wraps its two builders (SGLang's plugin
hooks) so that the name ``evenkv`` builds evenkv's: the draft model runner's own backend for
its prefill and DRAFT_EXTEND_V2 batches, and ``sglang_draft.EvenKVMultiStepDraftBackend`` for its
decode steps (chains at any page size; trees of ``speculative_eagle_topk`` > 1 at page size 1).
Where evenkv is the target's backend and that flag is not given, ``register`` makes it
``triton`` (a hook before a ServerArgs is resolved), which serves every draft shape.

gpt-oss (``GptOssForCausalLM``; Gemma 4 and Llama 4 likewise) cannot select evenkv: SGLang
asserts that both attention backends are in a list literal of built-in names (0.5.17:
``ServerArgs._handle_model_specific_adjustments`` in ``sglang/srt/server_args.py``; 0.5.23:
``handle_model_specific_adjustments`` in ``sglang/srt/arg_groups/model_hook.py``), with no
registry or choices hook a plugin could extend.

Tested with SGLang 0.5.17 and 0.5.23.
"""

from __future__ import annotations

import logging
import os

NAME = "evenkv"
POLICY_ENV = "EVENKV_POLICY"
# SGLang's names of the algorithms whose target-model verify evenkv runs (NEXTN is EAGLE's alias).
SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM")
# Those with a draft model, and the SGLang backend its attention runs on unless the operator names
# one: SGLang's Triton backend, which every GPU has (no extra package, no arch limit) and which
# takes draft trees at any page size and the hybrid SWA pool.
DRAFT_MODEL_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")
DEFAULT_DRAFT_ATTENTION = "triton"

logger = logging.getLogger(__name__)


def register() -> None:
    """Make ``evenkv`` a valid SGLang attention backend in this process (idempotent)."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    # The choices list is shared by --attention-backend, --prefill-attention-backend and
    # --decode-attention-backend (argparse keeps a reference), so one append covers all three.
    if NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([NAME])
    _declare_deterministic()
    _hook_draft_backends()
    if ATTENTION_BACKENDS.get(NAME) is not create_backend:
        register_attention_backend(NAME)(create_backend)


def server_args_resolution() -> str:
    """The ServerArgs method that resolves a record from its raw fields, as a hook target:
    ``resolve_once`` where SGLang has it (0.5.23: launchers call it; construction only records),
    else ``__post_init__`` (0.5.17: construction resolves)."""
    from sglang.srt.server_args import ServerArgs

    method = "resolve_once" if hasattr(ServerArgs, "resolve_once") else "__post_init__"
    return f"sglang.srt.server_args.ServerArgs.{method}"


DRAFT_BACKEND_FACTORY = "sglang.srt.speculative.draft_utils.DraftBackendFactory"


def _hook_draft_backends() -> None:
    """SGLang's plugin hooks (registered while ``load_plugins`` runs this module's ``register``,
    applied after it, before any ServerArgs is built), once per process: ``default_draft_attention``
    before every ServerArgs is resolved; ``draft_decode_backend`` and ``draft_extend_backend``
    around the draft worker's backend builders."""
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError:  # an SGLang without plugin hooks: its draft worker names the flag when it refuses
        return
    for target, hook, kind in ((server_args_resolution(), default_draft_attention, HookType.BEFORE),
                               (f"{DRAFT_BACKEND_FACTORY}.create_decode_backend", draft_decode_backend,
                                HookType.AROUND),
                               (f"{DRAFT_BACKEND_FACTORY}.create_draft_extend_backend", draft_extend_backend,
                                HookType.AROUND)):
        if not any(registered is hook for _, registered, _ in HookRegistry._hooks.get(target, ())):
            HookRegistry.register(target, hook, kind)


def draft_decode_backend(create, factory, *args, **kwargs):
    """``DraftBackendFactory.create_decode_backend`` with evenkv among its backends: where the
    draft attention backend is evenkv, the multi-step backend of the draft's decode steps (None
    for one step, as SGLang's own rule has it), else SGLang's own choice."""
    if factory.draft_attn_backend != NAME:
        return create(factory, *args, **kwargs)
    if factory.speculative_num_steps <= 1:
        return None
    from evenkv.integrations.sglang_draft import EvenKVMultiStepDraftBackend

    return EvenKVMultiStepDraftBackend(_draft_runner_backend(factory), factory.topk, factory.speculative_num_steps)


def draft_extend_backend(create, factory, *args, **kwargs):
    """``DraftBackendFactory.create_draft_extend_backend`` with evenkv among its backends: where
    the draft attention backend is evenkv, the draft model runner's own evenkv backend (its
    DRAFT_EXTEND_V2 batches are extend batches to it), else SGLang's own choice."""
    if factory.draft_attn_backend != NAME:
        return create(factory, *args, **kwargs)
    return _draft_runner_backend(factory)


def _draft_runner_backend(factory):
    """The draft model runner's evenkv backend: the one SGLang built for it from the registry
    (its --speculative-draft-attention-backend names evenkv), else a new one."""
    from evenkv.integrations.sglang_backend import EvenKVAttnBackend

    runner = factory.draft_model_runner
    backend = getattr(runner, "attn_backend", None)
    return backend if isinstance(backend, EvenKVAttnBackend) else create_backend(runner)


def default_draft_attention(server_args, *args, **kwargs) -> None:
    """Where evenkv serves a speculative target with a draft model and the operator named no
    ``speculative_draft_attention_backend``, set it to DEFAULT_DRAFT_ATTENTION, which serves
    every draft shape (evenkv's draft backend: not trees on pages of several tokens)."""
    algorithm = str(getattr(server_args, "speculative_algorithm", None) or "").upper()
    backends = {getattr(server_args, field, None)
                for field in ("attention_backend", "decode_attention_backend", "prefill_attention_backend")}
    if algorithm in DRAFT_MODEL_ALGORITHMS and NAME in backends and \
            getattr(server_args, "speculative_draft_attention_backend", None) is None:
        server_args.speculative_draft_attention_backend = DEFAULT_DRAFT_ATTENTION
        logger.info("evenkv: the %s draft model's attention runs on SGLang's %s backend "
                    "(--speculative-draft-attention-backend evenkv runs the draft on evenkv)",
                    algorithm, DEFAULT_DRAFT_ATTENTION)


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
    from evenkv.checks import FP8_KV_DTYPES, PAGE_SIZES, SUPPORTED_DTYPES
    from evenkv.decode_attention import POLICIES

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
    # SGLang's Llama 4 argument check covers --attention-backend only, so a decode-only evenkv
    # would otherwise run the chunked layers (use_irope) over the whole context.
    chunk = getattr(model_runner, "attention_chunk_size", None)
    if chunk:
        reasons.append(f"chunked local attention (attention_chunk_size={chunk}: Llama 4's iRoPE layers) is not "
                       "supported; evenkv's kernels attend to the whole context or a sliding window")

    # Speculative decoding: the target model's verify batches only.
    reasons += _speculative_reasons(model_runner)

    # Serving modes evenkv does not implement.
    if getattr(args, "dllm_algorithm", None) is not None:
        reasons.append(f"diffusion LLM decoding ({args.dllm_algorithm}) is not supported (block-bidirectional "
                       "attention)")
    if getattr(args, "enable_pdmux", False):
        reasons.append("PD multiplexing (--enable-pdmux, SPLIT_PREFILL batches) is not supported")
    for field, what in (("attn_dcp_size", "decode context parallelism"), ("attn_cp_size", "context parallelism")):
        size = _parallel_size(field)
        if size is not None and size > 1:
            reasons.append(f"{what} ({field}={size}) is not supported")

    # KV cache: a plain token pool (or SGLang's hybrid SWA pool of two) in the model dtype, NHD
    # layout, identity slot ids.
    pool = model_runner.token_to_kv_pool
    token_pools, pool_reasons = _token_pools(pool)
    reasons += pool_reasons
    for name, token_pool in token_pools:
        reasons += [f"{name}{reason}" for reason in _token_pool_reasons(token_pool)]
    model_dtype = getattr(model_runner, "dtype", None)
    if model_dtype is not None and token_pools and model_dtype != pool.dtype and pool.dtype not in FP8_KV_DTYPES:
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


def speculative_verify(server_args) -> tuple[int, bool]:
    """(query tokens of each target-verify request, whether verify rows carry a tree mask) under
    ``server_args``' speculative decoding; (0, False) without it. A request verifies
    ``speculative_num_draft_tokens`` tokens (EAGLE: the root and the drafts); NGRAM's drafts and
    EAGLE's with ``speculative_eagle_topk`` > 1 form trees, EAGLE's with topk 1 a chain (causal)."""
    algorithm = getattr(server_args, "speculative_algorithm", None)
    if algorithm is None:
        return 0, False
    q_len = int(getattr(server_args, "speculative_num_draft_tokens", None) or 0)
    tree = algorithm == "NGRAM" or int(getattr(server_args, "speculative_eagle_topk", None) or 1) > 1
    return q_len, tree


def draft_topk(server_args) -> int:
    """Branches a draft step grows per request (``speculative_eagle_topk``; 1: a chain)."""
    return int(getattr(server_args, "speculative_eagle_topk", None) or 1)


def _speculative_reasons(model_runner) -> list[str]:
    args = model_runner.server_args
    algorithm = getattr(args, "speculative_algorithm", None)
    if getattr(model_runner, "is_draft_worker", False):
        return _draft_reasons(model_runner)
    if algorithm is None:
        return []
    if algorithm not in SPECULATIVE_ALGORITHMS:
        return [f"speculative decoding with {algorithm} is not supported (evenkv verifies for "
                f"{', '.join(SPECULATIVE_ALGORITHMS)})"]
    from evenkv.decode_attention import MAX_DECODE_Q_LEN

    reasons = []
    q_len, tree = speculative_verify(args)
    if not 1 <= q_len <= MAX_DECODE_Q_LEN:
        reasons.append(f"speculative_num_draft_tokens={q_len}: evenkv verifies 1 to {MAX_DECODE_Q_LEN} tokens "
                       "per request")
    page_size = getattr(model_runner, "page_size", 1) or 1
    if algorithm != "NGRAM" and tree and page_size > 1:
        # NGRAM's drafts take D page-consistent slots after the prefix at any page size (its
        # tree lives in the mask only); EAGLE's topk > 1 copies the prefix's last page per branch.
        reasons.append(f"EAGLE draft trees (topk {getattr(args, 'speculative_eagle_topk', None)}) with page size "
                       f"{page_size}: SGLang lays them out per page (the prefix's last page copied per branch) "
                       "only for its own backends; use --page-size 1")
    if tree:
        from evenkv.integrations.sglang_backend import model_layer_kinds

        kinds, _ = model_layer_kinds(model_runner.model)
        short = sorted({kind.window for kind in kinds.values() if kind.window and kind.window < q_len})
        if short:
            reasons.append(f"draft trees ({algorithm}) of {q_len} tokens under sliding windows of {short} keys: a "
                           "tree token's ancestors must lie in its window (evenkv's tree-masked verify rows bound "
                           "only the prefix by it)")
    return reasons


def _draft_reasons(model_runner) -> list[str]:
    """Why evenkv cannot serve ``model_runner``'s draft model ([] = it can)."""
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    args = model_runner.server_args
    algorithm = str(getattr(args, "speculative_algorithm", None) or "").upper()
    if algorithm not in DRAFT_MODEL_ALGORITHMS:
        return [f"a draft model under speculative algorithm {algorithm or None} (evenkv drafts for "
                f"{', '.join(DRAFT_MODEL_ALGORITHMS)})"]
    reasons = []
    topk, page_size = draft_topk(args), getattr(model_runner, "page_size", 1) or 1
    if topk > 1 and page_size > 1:
        reasons.append(f"draft trees (speculative_eagle_topk={topk}) in the draft model with page size {page_size}: "
                       "SGLang lays each branch on pages of its own (the prefix's last page copied per branch) "
                       f"for its own backends only; use --page-size 1 or --speculative-draft-attention-backend "
                       f"{DEFAULT_DRAFT_ATTENTION}")
    window = getattr(args, "speculative_draft_window_size", None)
    if window:
        from evenkv.integrations.sglang_backend import model_layer_kinds

        kinds, _ = model_layer_kinds(model_runner.model)
        if not kinds or any(kind.window is None for kind in kinds.values()):
            # SGLang's draft decode backends then read sink tokens and the last N (0.5.23); a draft
            # model whose layers carry the window (Llama EAGLE-3 takes the flag as its own) is served.
            reasons.append(f"speculative_draft_window_size={window} on a draft model whose layers have no sliding "
                           "window of their own (evenkv reads the layers' windows only); pass "
                           f"--speculative-draft-attention-backend {DEFAULT_DRAFT_ATTENTION}")
    if isinstance(model_runner.token_to_kv_pool, SWAKVPool):
        reasons.append("a draft model on the hybrid SWA pool (its draft steps would write each step's token to "
                       "the sliding-window pool too); pass --speculative-draft-attention-backend "
                       f"{DEFAULT_DRAFT_ATTENTION}")
    return reasons


def _token_pools(pool) -> tuple[list, list[str]]:
    """The MHA token pools behind SGLang's ``token_to_kv_pool`` as [(name, pool)] (the pool
    itself; or the full and sliding-window sub-pools of the hybrid ``SWAKVPool``), and the
    reasons the pool is refused."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    if isinstance(pool, MHATokenToKVPool):
        return [("", pool)], []
    if not isinstance(pool, SWAKVPool):
        return [], [f"KV pool {type(pool).__name__} is not supported (evenkv reads MHATokenToKVPool's [slots, heads, "
                    "head_dim] buffers, alone or as the two token pools of the hybrid SWAKVPool; linear, MLA and "
                    "per-request-window pools are not)"]
    reasons = []
    if getattr(pool, "full_to_swa_index_mapping", None) is None:
        reasons.append(f"hybrid pool {type(pool).__name__} has no full->SWA index mapping (evenkv translates "
                       "req_to_token slots through it for the sliding-window layers)")
    for field in ("swa_req_ring_size", "request_window"):  # SGLang >= 0.5.23 window layouts
        if getattr(pool, field, None) is not None:
            reasons.append(f"hybrid pool with {field}={getattr(pool, field)!r} (per-request SWA windows) is not "
                           "supported")
    if getattr(pool, "swa_uses_full_indices", False):
        reasons.append("hybrid pool whose SWA layers index the full pool's slots is not supported")
    subs = [("full-attention pool: ", pool.full_kv_pool), ("sliding-window pool: ", pool.swa_kv_pool)]
    for name, sub in subs:
        if not isinstance(sub, MHATokenToKVPool):
            reasons.append(f"{name}{type(sub).__name__} is not supported (evenkv reads MHATokenToKVPool buffers)")
        elif (sub.head_num, sub.head_dim) != (pool.head_num, pool.head_dim):
            reasons.append(f"{name}(heads, head_dim) = ({sub.head_num}, {sub.head_dim}) differ from the model's "
                           f"({pool.head_num}, {pool.head_dim}) (per-pool head shapes are not supported)")
    return [(name, sub) for name, sub in subs if isinstance(sub, MHATokenToKVPool)], reasons


def _token_pool_reasons(pool) -> list[str]:
    """Why evenkv cannot read one MHA token pool ([] = it can)."""
    from evenkv.checks import FP8_KV_DTYPES, SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS

    reasons = []
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


__all__ = ["NAME", "SPECULATIVE_ALGORITHMS", "create_backend", "register", "speculative_verify",
           "unsupported_reasons"]
