"""vLLM integration (evenkv.integrations.vllm*) against the real vLLM classes.

CPU lane: needs vLLM installed (``bash tests/envs/vllm.sh VENV``, vLLM 0.26.0 or 0.33.0
with --no-deps on a CPU torch); skipped, saying so, when ``vllm`` is not importable. Real
``load_general_plugins``, ``AttentionConfig``, ``AttentionSelectorConfig``,
``VllmConfig`` (local config-only checkpoints), ``SpeculativeConfig`` (n-gram, EAGLE,
EAGLE-3, MTP), ``ParallelConfig`` with the attention modules of Qwen3 and Llama built as
one rank of a tensor-parallel group, ``FullAttentionSpec``, ``CommonAttentionMetadata``
and ``split_decodes_and_prefills``; kernels run in the Triton interpreter, tiny shapes.
The KV cache is allocated the way vLLM's model runner does it (logical shape permuted by
the backend's stride order); expected outputs come from the fp32 oracle
``extend_reference`` over a plain slot cache the test fills itself, with the tolerance
rule of helpers.py. Start-up compiles are counted by recording the launchers
(``test_specialization``).

GPU lane (``pytest -m gpu``, on the device with the vLLM kit sourced): the same batch at
bf16, a decode step and a verify step captured in a CUDA graph and replayed after a
re-plan, and Triton's compile count over random steps after the dummy run.

vLLM's CUDA wheel on a CPU torch: ``CUDA_VISIBLE_DEVICES`` must be empty before vLLM is
imported (else ``vllm.triton_utils`` sees no active driver and disables triton), and a
``VllmConfig`` needs the CPU platform.
"""

import importlib.metadata
import importlib.util
import logging
import os
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed; the vLLM lane needs `bash tests/envs/vllm.sh VENV` "
                "(vllm 0.26.0 + CPU torch) and that venv's python", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import numpy as np  # noqa: E402
import vllm  # noqa: E402
import vllm.plugins  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from evenkv.configs import is_interpreter  # noqa: E402
from evenkv.integrations import vllm as plugin  # noqa: E402
from evenkv.integrations.vllm_backend import (EvenKVBackend, EvenKVImpl, EvenKVMetadataBuilder,  # noqa: E402
                                              KV_CACHE_STRIDE_ORDERS, LayerKind, kv_cache_page_views,
                                              verify_q_len)
from evenkv.kernels.reference import extend_reference, kv_write_reference  # noqa: E402
from helpers import TOLERANCE_FLOOR  # noqa: E402

VLLM_VERSION = tuple(int(x) for x in vllm.__version__.split(".")[:2])
HQ, HKV, D, BLOCK = 4, 2, 64, 16  # G = 2
MAX_MODEL_LEN, MAX_NUM_SEQS = 256, 8
NULL_BLOCK = 0  # vLLM reserves block 0 for padded rows


# -- plugin and selection ------------------------------------------------------------


def test_entry_point_declared():
    eps = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "evenkv"]
    assert [e.value for e in eps] == ["evenkv.integrations.vllm:register"]


def test_load_general_plugins_registers_custom(monkeypatch):
    AttentionBackendEnum.CUSTOM.clear_override()
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    vllm.plugins.load_general_plugins()
    assert AttentionBackendEnum.CUSTOM.get_path() == plugin.BACKEND_CLASS_PATH
    assert AttentionBackendEnum.CUSTOM.get_class() is EvenKVBackend
    plugin.register()  # idempotent
    assert AttentionBackendEnum.CUSTOM.get_path() == plugin.BACKEND_CLASS_PATH


def test_register_takes_over_a_foreign_custom_backend(caplog):
    from vllm.v1.attention.backends.registry import register_backend

    register_backend(AttentionBackendEnum.CUSTOM, "someone.else.Backend")
    plugin.register()
    assert AttentionBackendEnum.CUSTOM.get_path() == plugin.BACKEND_CLASS_PATH
    assert "someone.else.Backend" in caplog.text


def test_module_exports_lazily():
    assert plugin.EvenKVBackend is EvenKVBackend
    with pytest.raises(AttributeError):
        plugin.NoSuchThing  # noqa: B018


@pytest.mark.parametrize("spelling", ["CUSTOM", "custom"])
def test_attention_config_custom_resolves_to_evenkv(spelling):
    from vllm.config import AttentionConfig

    plugin.register()
    cfg = AttentionConfig(backend=spelling)
    assert cfg.backend is AttentionBackendEnum.CUSTOM
    cls = cfg.backend.get_class()
    assert cls is EvenKVBackend
    # What Attention.__init__ does with the selected class.
    assert AttentionBackendEnum[cls.get_name()] is AttentionBackendEnum.CUSTOM
    assert cls.get_impl_cls() is EvenKVImpl and cls.get_builder_cls() is EvenKVMetadataBuilder
    assert cls.forward_includes_kv_cache_update is False


# -- validate_configuration ------------------------------------------------------------


def _selector_kwargs(**overrides):
    """The keyword arguments vLLM's CUDA platform passes: a real AttentionSelectorConfig."""
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.selector import AttentionSelectorConfig

    fields = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16, use_mla=False,
                  has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
                  attn_type="decoder")
    capability = overrides.pop("device_capability", DeviceCapability(9, 0))
    fields.update(overrides)
    known = AttentionSelectorConfig._fields
    cfg = AttentionSelectorConfig(**{k: v for k, v in fields.items() if k in known})
    return dict(device_capability=capability, **cfg._asdict())


@pytest.mark.parametrize("overrides", [
    {}, {"dtype": torch.float16}, {"head_size": 64}, {"head_size": 256}, {"head_size": 96}, {"block_size": None},
    {"block_size": 32}, {"block_size": 64}, {"block_size": 128}, {"block_size": 48}, {"kv_cache_dtype": "bfloat16"},
    {"use_kv_connector": True}, {"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "fp8_e4m3"}, {"has_sink": True},
    {"has_sliding_window": True},
])
def test_validate_configuration_accepts(overrides):
    kwargs = _selector_kwargs(**overrides)
    assert EvenKVBackend.validate_configuration(**kwargs) == []


def test_validate_configuration_on_sm80_and_sm75():
    from vllm.platforms.interface import DeviceCapability

    assert EvenKVBackend.validate_configuration(**_selector_kwargs(device_capability=DeviceCapability(8, 0))) == []
    reasons = EvenKVBackend.validate_configuration(**_selector_kwargs(device_capability=DeviceCapability(7, 5)))
    assert len(reasons) == 1 and "compute capability 7.5" in reasons[0]


@pytest.mark.parametrize("overrides,needle", [
    ({"head_size": 72}, "head_size 72"),
    ({"dtype": torch.float32}, "dtype torch.float32"),
    ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype 'fp8_e5m2'"),
    ({"kv_cache_dtype": "float16"}, "differs from the model dtype"),
    ({"block_size": 8}, "block_size 8"),
    ({"use_mla": True}, "MLA"),
    ({"use_sparse": True}, "sparse"),
    ({"use_mm_prefix": True}, "multimodal"),
    ({"attn_type": "encoder_only"}, "attention type encoder_only"),
    ({"use_non_causal": True}, "non-causal"),
    ({"use_pcp": True}, "prefill context parallelism"),
])
def test_validate_configuration_refuses_with_reason(overrides, needle):
    reasons = EvenKVBackend.validate_configuration(**_selector_kwargs(**overrides))
    assert len(reasons) == 1, reasons
    assert needle in reasons[0]


def test_batch_invariant_mode_selects_deterministic_decode(vllm_config, device, monkeypatch, caplog):
    """vLLM's batch-invariant mode is accepted (the backend declares it) and makes the
    builder's Attention deterministic: batch-invariant decode, prefill on vLLM's FA3 with one KV
    split where it imports (a GPU with the FA3 build), else on evenkv's Triton extend kernel; the
    start-up line says both."""
    from evenkv.integrations.prefill import vllm_flash_attention

    import vllm.envs

    assert EvenKVBackend.supports_batch_invariance()
    assert EvenKVBackend.validate_configuration(**_selector_kwargs(use_batch_invariant=True)) == []
    monkeypatch.setattr(vllm.envs, "VLLM_BATCH_INVARIANT", True, raising=False)
    # The adapter logs under vLLM's logger, which vLLM 0.33 keeps from propagating to the root.
    start_up = logging.getLogger("vllm.evenkv")
    start_up.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="vllm.evenkv"):
            builder = EvenKVMetadataBuilder(_spec(torch.bfloat16), ["l0"], vllm_config, device)
    finally:
        start_up.removeHandler(caplog.handler)
    assert attention_of(builder).deterministic and attention_of(builder).decode.deterministic
    assert "decode on evenkv's kernels (balanced: the balanced plan; deterministic:" in caplog.text
    engine_fa = vllm_flash_attention(device)
    if engine_fa is None:
        assert attention_of(builder).prefill_kernel is None
        assert "prefill and extend rows run on evenkv's Triton extend kernel" in caplog.text
    else:
        assert attention_of(builder).prefill_kernel.num_splits == 1
        assert "one KV split) (the engine's prefill kernel, batch and chunking invariant" in caplog.text


def test_validate_configuration_returns_every_reason():
    reasons = EvenKVBackend.validate_configuration(**_selector_kwargs(
        head_size=72, dtype=torch.float32, kv_cache_dtype="fp8_e5m2", block_size=8, use_sparse=True,
        use_non_causal=True))
    assert len(reasons) == 6, reasons


def test_validate_configuration_refuses_flags_of_later_vllm():
    # vLLM 0.33 adds use_dcp / use_adaptive_verification / use_rswa; an unknown switch that is
    # set is refused rather than ignored.
    extra = dict(use_dcp=True, use_adaptive_verification=True, use_rswa=True, use_something_new=True)
    reasons = EvenKVBackend.validate_configuration(**{**_selector_kwargs(), **extra})
    assert len(reasons) == 4, reasons
    assert any("decode context parallelism" in r for r in reasons)
    assert any("use_something_new" in r for r in reasons)
    assert EvenKVBackend.validate_configuration(**{**_selector_kwargs(), **{k: False for k in extra}}) == []


def test_declared_capabilities():
    assert EvenKVBackend.get_name() == "CUSTOM"
    assert EvenKVBackend.get_supported_kernel_block_sizes() == [16, 32, 64, 128]
    assert EvenKVBackend.get_supported_kernel_block_sizes(None) == [16, 32, 64, 128]  # 0.33 passes the spec
    assert EvenKVBackend.get_preferred_block_size(16) == 16
    assert EvenKVBackend.get_kv_cache_shape(10, 16, 2, 64) == (10, 2, 16, 128)


@pytest.mark.skipif(VLLM_VERSION >= (0, 33), reason="vLLM 0.33 resolves layouts itself (supported_kv_cache_layouts)")
def test_kv_cache_stride_order_follows_vllm_layout_026(vllm_config):
    """vLLM 0.26: the stride order is the layout vLLM resolved (the operator's
    VLLM_KV_CACHE_LAYOUT, a connector's), per layer and for a cross-layer allocation."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.utils import set_kv_cache_layout

    want = {("NHD", False): (0, 2, 1, 3), ("HND", False): (0, 1, 2, 3), ("NHD", True): (1, 0, 3, 2, 4),
            ("HND", True): (1, 2, 0, 3, 4)}
    try:
        for (layout, layers), order in want.items():
            set_kv_cache_layout(layout)
            assert EvenKVBackend.get_kv_cache_stride_order(include_num_layers_dimension=layers) == order
    finally:
        set_kv_cache_layout(None)
    with set_current_vllm_config(vllm_config):  # no connector, no VLLM_KV_CACHE_LAYOUT: NHD
        assert EvenKVBackend.get_kv_cache_stride_order() == (0, 2, 1, 3)
    assert EvenKVBackend.get_required_kv_cache_layout() is None  # no override of the operator's layout


@pytest.mark.skipif(VLLM_VERSION < (0, 33), reason="KVCacheLayout exists from vLLM 0.33 on")
def test_supported_kv_cache_layouts_033():
    assert EvenKVBackend.supported_kv_cache_layouts() is None  # any layout


@pytest.mark.parametrize("kwargs,needle", [
    ({"alibi_slopes": [1.0] * HQ}, "ALiBi"),
    ({"sinks": torch.zeros(HQ + 1)}, "sinks"),
    ({"kv_cache_dtype": "fp8_e5m2"}, "fp8_e5m2"),
    ({"chunk_lookback": 4}, "chunk_lookback"),
])
def test_impl_refuses_what_the_kernels_would_ignore(kwargs, needle):
    with pytest.raises(NotImplementedError, match=needle):
        EvenKVImpl(HQ, D, D ** -0.5, HKV, **kwargs)


def test_impl_layer_kind():
    """A layer's window, soft-cap and sinks make its kind: the builder plans once per kind."""
    plain = EvenKVImpl(HQ, D, D ** -0.5, HKV)
    gpt_oss_like = EvenKVImpl(HQ, D, D ** -0.5, HKV, sliding_window=128, sinks=torch.zeros(HQ))
    capped = EvenKVImpl(HQ, D, D ** -0.5, HKV, logits_soft_cap=30.0, kv_cache_dtype="fp8")
    assert plain.kind == LayerKind()
    assert gpt_oss_like.kind == LayerKind(window=128, sinks=True)
    assert capped.kind == LayerKind(logit_cap=30.0)


def test_impl_accepts_off_values_of_extra_switches():
    impl = EvenKVImpl(HQ, D, D ** -0.5, HKV, None, None, "auto", None, "decoder", None,
                      sinks=None, use_alibi_sqrt=False, chunk_lookback=-1)
    assert impl.num_kv_heads == HKV and impl.logits_soft_cap is None


# -- builder: the decode/extend split ------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_platform():
    """vLLM's CPU platform while the module's configs are built and used: the CUDA wheel
    cannot infer a device type on a CPU torch."""
    import vllm.platforms

    saved = vllm.platforms._current_platform
    if not torch.cuda.is_available():
        import vllm.platforms.cpu

        vllm.platforms._current_platform = vllm.platforms.cpu.CpuPlatform()
    yield
    vllm.platforms._current_platform = saved


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Config-only checkpoints (no weights, no tokenizer), by name: the Qwen3 target (HQ/HKV/D
    as above), a Llama target with an EAGLE and an EAGLE-3 draft of the same attention
    shape, a GLM-4.5-style target with one MTP layer; and the head counts of Qwen3-8B (32 q /
    8 KV heads), Llama-3-70B (64 / 8) and Qwen3-235B-A22B (64 / 4)."""
    from transformers import Glm4MoeConfig, LlamaConfig, Qwen3Config

    small = dict(vocab_size=256, intermediate_size=128, num_hidden_layers=1, max_position_embeddings=MAX_MODEL_LEN)
    heads = dict(hidden_size=HQ * D, num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D)
    configs = {
        "qwen3": Qwen3Config(**small, **heads, architectures=["Qwen3ForCausalLM"]),
        "llama": LlamaConfig(**small, **heads, architectures=["LlamaForCausalLM"]),
        "eagle": LlamaConfig(**small, **heads, architectures=["EagleLlamaForCausalLM"]),
        "eagle3": LlamaConfig(**small, **heads, architectures=["LlamaForCausalLMEagle3"]),
        "glm-mtp": Glm4MoeConfig(**small, **heads, moe_intermediate_size=64, n_routed_experts=4,
                                 num_experts_per_tok=2, first_k_dense_replace=1, num_nextn_predict_layers=1,
                                 architectures=["Glm4MoeForCausalLM"]),
        "qwen3-8b-heads": Qwen3Config(**small, hidden_size=32 * 128, num_attention_heads=32, num_key_value_heads=8,
                                      head_dim=128, architectures=["Qwen3ForCausalLM"]),
        "llama-70b-heads": LlamaConfig(**small, hidden_size=64 * 128, num_attention_heads=64, num_key_value_heads=8,
                                       head_dim=128, architectures=["LlamaForCausalLM"]),
        "qwen3-235b-heads": Qwen3Config(**small, hidden_size=64 * 128, num_attention_heads=64, num_key_value_heads=4,
                                        head_dim=128, architectures=["Qwen3ForCausalLM"]),
    }
    root = tmp_path_factory.mktemp("checkpoints")
    for name, config in configs.items():
        config.save_pretrained(root / name)
    return {name: str(root / name) for name in configs}


def make_vllm_config(model_dir, *, speculative=None, tensor_parallel_size=1, max_num_seqs=MAX_NUM_SEQS,
                     attention_backend=None, dtype="float16"):
    """A real VllmConfig (needs the ``cpu_platform`` fixture on a CPU machine); speculative: the
    SpeculativeConfig's arguments, as ``--speculative-config`` takes them, or None."""
    from vllm.config import AttentionConfig, ModelConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig

    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype=dtype, max_model_len=MAX_MODEL_LEN)
    parallel = ParallelConfig(tensor_parallel_size=tensor_parallel_size)
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max(MAX_MODEL_LEN, max_num_seqs),
                            max_model_len=MAX_MODEL_LEN, is_encoder_decoder=False)
    spec = None if speculative is None else SpeculativeConfig(
        **speculative, target_model_config=model, target_parallel_config=parallel)
    return VllmConfig(model_config=model, scheduler_config=sched, parallel_config=parallel, speculative_config=spec,
                      attention_config=AttentionConfig(backend=attention_backend))


@pytest.fixture(scope="module")
def vllm_config(cpu_platform, checkpoints):
    """A real VllmConfig for the config-only Qwen3 (HQ/HKV/D as above), no speculation."""
    return make_vllm_config(checkpoints["qwen3"])


def _spec(dtype):
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=HKV, head_size=D, dtype=dtype)


def _cam(q_lens, seq_lens, device, *, block_table=None, num_tokens=None, num_reqs_padding=0):
    """A CommonAttentionMetadata as the V1 runner makes it: padded requests (q_len 0,
    seq_len 0, NULL_BLOCK rows) after the real ones and padding tokens past the last query."""
    q_lens = list(q_lens) + [0] * num_reqs_padding
    seq_lens = list(seq_lens) + [0] * num_reqs_padding
    b = len(q_lens)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    real = int(qsl[-1])
    num_tokens = real if num_tokens is None else num_tokens
    if block_table is None:
        width = -(-MAX_MODEL_LEN // BLOCK)
        block_table = torch.arange(1, 1 + b * width, dtype=torch.int32).view(b, width)
    block_table = block_table.clone()
    block_table[b - num_reqs_padding:] = NULL_BLOCK
    slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64)
    for r, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        for i in range(ql):
            pos = sl - ql + i
            slot_mapping[int(qsl[r]) + i] = int(block_table[r, pos // BLOCK]) * BLOCK + pos % BLOCK
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32,
                                                                                        device=device),
        num_reqs=b, num_actual_tokens=num_tokens, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        block_table_tensor=block_table.to(device), slot_mapping=slot_mapping.to(device), causal=True,
        seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32))


@pytest.fixture()
def builder(vllm_config, device):
    return EvenKVMetadataBuilder(_spec(torch.bfloat16), ["model.layers.0.self_attn.attn"], vllm_config,
                                 device)


def attention_of(builder, kind=None):
    """The builder's Attention for a layer kind (plain by default: the fixtures register no layers)."""
    return builder.attentions[kind or LayerKind()]


def test_builder_init(builder):
    assert builder.reorder_batch_threshold == 1 and attention_of(builder).max_decode_q_len == 1
    assert attention_of(builder).max_batch_size == MAX_NUM_SEQS
    assert attention_of(builder).max_pages_per_request == MAX_MODEL_LEN // BLOCK
    assert (attention_of(builder).num_q_heads, attention_of(builder).num_kv_heads, attention_of(builder).head_dim) == (HQ, HKV, D)
    assert attention_of(builder).page_size == BLOCK and attention_of(builder).decode is not None


@pytest.mark.parametrize("q_lens,seq_lens,num_tokens,padded_reqs,expect", [
    # (num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)
    ([1, 1, 1], [40, 3, 17], None, 0, (3, 0, 3, 0)),                       # pure decode
    ([1, 1, 5, 7], [40, 3, 21, 7], None, 0, (2, 2, 2, 12)),                # decodes + prefills
    ([1, 1, 5, 7], [40, 3, 21, 7], 18, 0, (2, 2, 2, 16)),                  # + padding tokens
    ([1, 5, 1], [40, 21, 9], None, 0, (1, 2, 1, 6)),                       # first non-decode ends decodes
    ([9, 1], [9, 30], None, 0, (0, 2, 0, 10)),                             # prefill first: no decodes
    ([1, 1], [12, 30], 4, 2, (4, 0, 4, 0)),                                # padded uniform decode (graph)
    ([1, 6], [12, 30], 8, 1, (1, 2, 1, 7)),                                # padded request after a prefill
])
def test_builder_splits_decodes_and_prefills(builder, device, q_lens, seq_lens, num_tokens, padded_reqs, expect):
    cam = _cam(q_lens, seq_lens, device, num_tokens=num_tokens, num_reqs_padding=padded_reqs)
    md = builder.build(0, cam)
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens, md.num_prefill_tokens) == expect
    assert md.num_actual_tokens == cam.num_actual_tokens
    (_, plan), = md.plans.values()
    assert plan.batch_size == cam.num_reqs and plan.num_decodes == expect[0]
    if expect[1] == 0:
        assert plan.extend is None and plan.delegated is None
    elif plan.delegated is not None:  # vLLM's FA3 imports (a GPU): the prefill rows are its
        assert plan.extend is None and plan.delegated.first_row == expect[2]
        assert plan.delegated.max_q_len >= max(q_lens)
    else:
        assert plan.extend.req_begin == expect[0] and plan.extend.max_q_len >= max(q_lens)
    # The decode plan reads vLLM's (persistent) block table in place, not a copy.
    assert md.block_table.data_ptr() == cam.block_table_tensor.data_ptr()


def test_builder_cudagraph_capture_is_decode_only(builder, device):
    md = builder.build_for_cudagraph_capture(_cam([1] * 4, [1] * 4, device, num_tokens=6, num_reqs_padding=2))
    assert (md.num_decodes, md.num_prefills) == (6, 0)
    with pytest.raises(RuntimeError, match="full graphs of uniform decode batches only"):
        builder.build_for_cudagraph_capture(_cam([1, 3], [5, 9], device))


def test_builder_refuses_non_causal(builder, device):
    cam = _cam([1, 2], [5, 9], device)
    cam.causal = False
    with pytest.raises(NotImplementedError, match="causal"):
        builder.build(0, cam)


def test_builder_logs_bad_batch_data_the_kernels_flagged(builder, device, caplog):
    """The builder polls evenkv's device-side error flag once per step and logs what a kernel
    recorded (on the GPU one poll later: the poll never waits), then clears it."""

    from evenkv import errors

    errors.check_errors(device)
    errors.error_flag(device)[0] = errors.SLOT_OUT_OF_RANGE
    with caplog.at_level(logging.ERROR, logger="evenkv"):
        for _ in range(3):
            builder.build(0, _cam([1, 1], [5, 9], device))
            if device.type == "cuda":
                torch.cuda.synchronize()
    assert "slot_mapping: a slot >= the KV cache's slots" in caplog.text
    assert errors.peek(device) == []


def test_builder_policy_knob(vllm_config, device, monkeypatch):
    monkeypatch.setenv("EVENKV_POLICY", "fa3")
    b = EvenKVMetadataBuilder(_spec(torch.bfloat16), ["l0"], vllm_config, device)
    assert attention_of(b).decode.policy == "fa3"
    monkeypatch.setenv("EVENKV_POLICY", "nope")
    with pytest.raises(ValueError, match="EVENKV_POLICY"):
        EvenKVMetadataBuilder(_spec(torch.bfloat16), ["l0"], vllm_config, device)


# -- impl: KV write and forward on a mixed batch in vLLM's KV layout ------------------------


def _vllm_kv_cache(num_blocks, dtype, device, hkv=HKV, d=D, layout="NHD", layers=False):
    """Allocate as vLLM 0.26's runner does: physical = logical shape permuted by the stride order
    of ``layout``; with ``layers``, layer 1 of a 3-layer cross-layer allocation (every other
    layer NaN, so a read of the wrong layer shows). A vLLM 0.33 ``KVCacheLayout`` as ``layout``:
    layer 1 of a 3-layer buffer laid out as vLLM 0.33 lays it out (``compute_layout_strides``),
    the other layers' bytes 0xFF (NaN in bf16 and in e4m3)."""
    if not isinstance(layout, str):
        from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes, compute_layout_strides

        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=hkv, head_size=d, dtype=dtype)
        shape = (3, *compute_layer_kv_cache_shape_bytes(spec, num_blocks))
        raw = torch.full((int(np.prod(shape)),), 0xFF, dtype=torch.uint8, device=device)
        layer = torch.as_strided(raw, shape, compute_layout_strides(spec, num_blocks, 3, layout))[1].view(dtype)
        return layer.zero_()
    shape = EvenKVBackend.get_kv_cache_shape(num_blocks, BLOCK, hkv, d)
    if layers:
        shape = (3, *shape)
    order = KV_CACHE_STRIDE_ORDERS[layout][layers]
    physical = torch.full(tuple(shape[i] for i in order), float("nan") if layers else 0, device=device).to(dtype)
    logical = physical.permute(*[order.index(i) for i in range(len(order))])
    if layers:
        logical[1] = 0
        return logical[1]
    return logical


class MixedBatch:
    """A mixed step: decode rows, a chunked prefill on a cached prefix, a fresh prefill,
    padding tokens (and padding requests: q_len 0, seq_len 0); old tokens written into the
    cache directly, new ones through the impl. heads: (Hq, Hkv, D)."""

    def __init__(self, q_lens, seq_lens, dtype, device, *, num_tokens=None, num_blocks=None, seed=0,
                 num_reqs_padding=0, heads=(HQ, HKV, D), layout="NHD", layers=False):
        hq, hkv, d = heads
        gen = torch.Generator().manual_seed(seed)
        b = len(q_lens)
        pages = [-(-s // BLOCK) for s in seq_lens]
        num_blocks = num_blocks or 1 + sum(pages) + 3
        perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).int()  # block 0 = NULL_BLOCK, never used
        width = MAX_MODEL_LEN // BLOCK
        table = torch.full((b, width), NULL_BLOCK, dtype=torch.int32)
        used = 0
        for r, n in enumerate(pages):
            table[r, :n] = perm[used:used + n]
            used += n
        table = torch.cat([table, torch.zeros(num_reqs_padding, width, dtype=torch.int32)])
        self.cam = _cam(q_lens, seq_lens, device, block_table=table, num_tokens=num_tokens,
                        num_reqs_padding=num_reqs_padding)
        t = self.cam.num_actual_tokens
        self.layout = dict(layout=layout, layers=layers)
        self.kv_cache = _vllm_kv_cache(num_blocks, dtype, device, hkv, d, **self.layout)
        self.ref_k = torch.zeros(num_blocks * BLOCK, hkv, d, dtype=dtype, device=device)
        self.ref_v = torch.zeros_like(self.ref_k)
        for r, (ql, sl) in enumerate(zip(q_lens, seq_lens)):  # cached prefix: positions < sl - ql
            for pos in range(sl - ql):
                blk, off = int(table[r, pos // BLOCK]), pos % BLOCK
                k = torch.randn(hkv, d, generator=gen).to(dtype)
                v = torch.randn(hkv, d, generator=gen).to(dtype)
                self.kv_cache[blk, :, off, :d] = k.to(device)
                self.kv_cache[blk, :, off, d:] = v.to(device)
                self.ref_k[blk * BLOCK + off] = k.to(device)
                self.ref_v[blk * BLOCK + off] = v.to(device)
        self.query = torch.randn(t, hq, d, generator=gen).to(dtype).to(device)
        self.key = torch.randn(t, hkv, d, generator=gen).to(dtype).to(device)
        self.value = torch.randn(t, hkv, d, generator=gen).to(dtype).to(device)
        sm = self.cam.slot_mapping
        keep = sm >= 0
        self.ref_k[sm[keep]] = self.key[keep]
        self.ref_v[sm[keep]] = self.value[keep]

    def reference(self, compute_dtype=torch.float32, sm_scale=None, **terms):
        c = self.cam
        return extend_reference(self.query, self.ref_k, self.ref_v, c.query_start_loc, c.seq_lens,
                                c.block_table_tensor, BLOCK, compute_dtype=compute_dtype, sm_scale=sm_scale, **terms)

    def to_fp8(self, k_scale: float, v_scale: float) -> None:
        """Make the cache vLLM's FP8 one (uint8, stored = real / scale) holding the same prefix;
        the reference caches become what the KV write will store."""
        fp8 = torch.float8_e4m3fn
        real = self.kv_cache
        self.kv_cache = _vllm_kv_cache(real.shape[0], torch.uint8, real.device, **self.layout)
        stored = self.kv_cache.view(fp8)
        for half, scale in ((slice(0, D), k_scale), (slice(D, 2 * D), v_scale)):
            stored[..., half] = (real[..., half].float() / scale).clamp(-448, 448).to(fp8)
        ref_k, ref_v = torch.empty_like(self.ref_k, dtype=fp8), torch.empty_like(self.ref_v, dtype=fp8)
        slots = torch.arange(ref_k.shape[0], device=ref_k.device)
        kv_write_reference(ref_k, ref_v, self.ref_k, self.ref_v, slots, k_scale=k_scale, v_scale=v_scale)
        self.ref_k, self.ref_v = ref_k, ref_v


def _run_step(builder, impl, batch, layer=None, draft_index=None):
    """One step: the KV write, the build (a drafter's with ``draft_index``), the layer's forward."""
    impl.do_kv_cache_update(layer, batch.key, batch.value, batch.kv_cache, batch.cam.slot_mapping)
    md = (builder.build(0, batch.cam) if draft_index is None else
          builder.build_for_drafting(batch.cam, draft_index=draft_index))
    output = torch.full_like(batch.query, 7.0)  # rows past the last query must keep this
    impl.forward(layer, batch.query, batch.key, batch.value, batch.kv_cache, md, output)
    return md, output


def _assert_cache_holds(batch):
    """The cache holds, at each (block, offset), what the test's own slot caches hold."""
    for half, ref in zip(kv_cache_page_views(batch.kv_cache, D), (batch.ref_k, batch.ref_v)):
        got = half.reshape(ref.shape)
        if ref.dtype == torch.float8_e4m3fn:
            got, ref = got.view(torch.uint8), ref.view(torch.uint8)
        assert torch.equal(got, ref)


def _assert_matches_reference(batch, output, sm_scale=None, **terms):
    _assert_within_tolerance(batch, output, batch.reference(sm_scale=sm_scale, **terms),
                             batch.reference(compute_dtype=batch.query.dtype, sm_scale=sm_scale, **terms))


def _assert_within_tolerance(batch, output, ref, lowp):
    """output within 2x the error of torch's own low-precision baseline ``lowp`` (+ the floor) of the
    fp32 ``ref``, on the step's query rows; rows past them (padding tokens) not written."""
    real = int(batch.cam.query_start_loc_cpu[-1])
    err = (output[:real].float() - ref[:real]).abs().max().item()
    base = (lowp[:real].float() - ref[:real]).abs().max().item()
    bound = 2 * base + TOLERANCE_FLOOR[batch.query.dtype]
    assert err <= bound, f"max abs error {err:.3e} > bound {bound:.3e} (torch {batch.query.dtype} error {base:.3e})"
    assert torch.all(output[real:] == 7.0), "padding rows were written"


MIXED = {
    # decode rows (one long, one on a page boundary), a chunked prefill on a cached
    # prefix, a fresh prefill, 3 padding tokens
    "mixed": ([1, 1, 5, 7], [70, 16, 21, 7], 16),
    "decode_only": ([1, 1, 1, 1, 1], [33, 1, 100, 17, 64], None),
    "prefill_only": ([12, 3], [12, 40], None),
}


@pytest.mark.parametrize("kind", list(MIXED))
def test_forward_matches_reference(builder, device, kind):
    q_lens, seq_lens, num_tokens = MIXED[kind]
    dtype = torch.bfloat16
    batch = MixedBatch(q_lens, seq_lens, dtype, device, num_tokens=num_tokens, seed=len(q_lens))
    impl = EvenKVImpl(HQ, D, D ** -0.5, HKV, None, None, "auto", None, "decoder", None)
    md, output = _run_step(builder, impl, batch)
    # The KV write put every new token where the test's own slot cache has it.
    _assert_cache_holds(batch)
    assert torch.all(batch.kv_cache[NULL_BLOCK] == 0), "a padding token (slot -1) was written"
    _assert_matches_reference(batch, output)


@pytest.mark.parametrize("layout,layers,kv", [("HND", False, "bf16"), ("NHD", True, "bf16"), ("HND", True, "bf16"),
                                             ("HND", False, "fp8")],
                         ids=["hnd", "nhd-cross-layer", "hnd-cross-layer", "hnd-fp8"])
def test_forward_in_every_kv_layout(builder, vllm_config, device, monkeypatch, layout, layers, kv):
    """The KV write and a mixed step's forward over vLLM's HND cache and a KV connector's
    cross-layer allocations: the same tokens land in the same (block, offset), the rows match
    the reference (the FP8 step as ``test_fp8_kv_cache``)."""
    dtype, layer, scales = torch.bfloat16, None, {}
    impl = EvenKVImpl(HQ, D, D ** -0.5, HKV, None, None, "auto", None, "decoder", None)
    if kv == "fp8":
        monkeypatch.setenv("EVENKV_PREFILL", "triton")
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HKV, head_size=D, dtype=torch.uint8)
        builder = EvenKVMetadataBuilder(spec, ["l0"], vllm_config, device)
        dtype, layer = torch.float16, SimpleNamespace(_k_scale_float=0.25, _v_scale_float=0.5)
        impl, scales = EvenKVImpl(HQ, D, D ** -0.5, HKV, kv_cache_dtype="fp8"), dict(k_scale=0.25, v_scale=0.5)
    batch = MixedBatch(*MIXED["mixed"][:2], dtype, device, num_tokens=MIXED["mixed"][2], seed=3, layout=layout,
                       layers=layers)
    if kv == "fp8":
        batch.to_fp8(0.25, 0.5)
    _, output = _run_step(builder, impl, batch, layer)
    _assert_cache_holds(batch)
    _assert_matches_reference(batch, output, **scales)


@pytest.mark.skipif(VLLM_VERSION < (0, 33), reason="KVCacheLayout exists from vLLM 0.33 on")
def test_forward_in_every_kv_cache_layout_033(builder, device):
    """vLLM 0.33 lays each layer's cache out in one of its KVCacheLayouts (evenkv takes any): the
    KV write and a mixed step's forward match the reference in every one."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    impl = EvenKVImpl(HQ, D, D ** -0.5, HKV, None, None, "auto", None, "decoder", None)
    for layout in KVCacheLayout:
        batch = MixedBatch(*MIXED["mixed"][:2], torch.bfloat16, device, num_tokens=MIXED["mixed"][2], seed=4,
                           layout=layout)
        _, output = _run_step(builder, impl, batch)
        _assert_cache_holds(batch)
        _assert_matches_reference(batch, output)


def test_forward_reuses_plan_across_layers_and_rejects_stale_metadata(builder, device):
    dtype = torch.bfloat16
    impl = EvenKVImpl(HQ, D, D ** -0.5, HKV, None, None, "auto", None, "decoder", None)
    batch = MixedBatch(*MIXED["mixed"][:2], dtype, device, num_tokens=MIXED["mixed"][2], seed=3)
    md, first = _run_step(builder, impl, batch)
    second = torch.empty_like(first)  # a second layer on the same metadata
    impl.forward(None, batch.query, batch.key, batch.value, batch.kv_cache, md, second)
    real = int(batch.cam.query_start_loc_cpu[-1])
    assert torch.equal(first[:real], second[:real])
    builder.build(0, _cam([1], [5], device))  # the next step
    with pytest.raises(ValueError, match="latest plan"):
        impl.forward(None, batch.query, batch.key, batch.value, batch.kv_cache, md, second)


def test_forward_without_metadata_writes_zeros(device):
    impl = EvenKVImpl(HQ, D, D ** -0.5, HKV)
    out = torch.full((3, HQ, D), 5.0, device=device)
    res = impl.forward(None, out.clone(), None, None, torch.empty(0), None, out)
    assert res is out and torch.all(out == 0)


def test_layers_of_one_plan_use_their_own_scales(builder, device):
    """One plan per step serves every layer; each layer's softmax scale is its own."""
    batch = MixedBatch(*MIXED["mixed"][:2], torch.bfloat16, device, num_tokens=MIXED["mixed"][2], seed=5)
    md, _ = _run_step(builder, EvenKVImpl(HQ, D, D ** -0.5, HKV), batch)
    output = torch.full_like(batch.query, 7.0)
    EvenKVImpl(HQ, D, 0.3, HKV).forward(None, batch.query, batch.key, batch.value, batch.kv_cache, md, output)
    _assert_matches_reference(batch, output, sm_scale=0.3)


def test_builder_plans_each_layer_kind(vllm_config, device, monkeypatch):
    """gpt-oss-like group: full layers and 8-token sliding-window layers with sinks. One plan
    per kind and step; each layer runs its own kind's plan with its window and sinks."""
    from evenkv.integrations import vllm_backend

    full, windowed = LayerKind(), LayerKind(window=8, sinks=True)
    monkeypatch.setattr(vllm_backend, "layer_kinds",
                        lambda config, names: {full: {names[0]: None}, windowed: {names[1]: None}})
    builder = EvenKVMetadataBuilder(_spec(torch.bfloat16), ["l0", "l1"], vllm_config, device)
    assert set(builder.attentions) == {full, windowed}
    assert builder.attentions[windowed].sliding_window == 8
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=device)
    impl_full = EvenKVImpl(HQ, D, D ** -0.5, HKV)
    impl_windowed = EvenKVImpl(HQ, D, D ** -0.5, HKV, sliding_window=8, sinks=sinks)
    batch = MixedBatch(*MIXED["mixed"][:2], torch.bfloat16, device, num_tokens=MIXED["mixed"][2], seed=11)
    md, output = _run_step(builder, impl_full, batch)
    assert set(md.plans) == {full, windowed}
    _assert_matches_reference(batch, output)
    output = torch.full_like(batch.query, 7.0)
    impl_windowed.forward(None, batch.query, batch.key, batch.value, batch.kv_cache, md, output)
    _assert_matches_reference(batch, output, sliding_window=8, sinks=sinks)


def test_fp8_kv_cache(vllm_config, device, monkeypatch):
    """--kv-cache-dtype fp8: the uint8 cache is read as e4m3 with the layer's scales; the KV
    write quantizes the new tokens as the reference does (stored = real / scale). Extend rows on
    evenkv's Triton extend (q in 16 bits, this file's tolerance): on a GPU with vLLM's FA3 a bf16
    model's would run its 8-bit path, which tests/gpu/test_prefill_gpu.py checks to its own tolerance."""
    monkeypatch.setenv("EVENKV_PREFILL", "triton")
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HKV, head_size=D, dtype=torch.uint8)
    builder = EvenKVMetadataBuilder(spec, ["l0"], vllm_config, device)
    attention = attention_of(builder)
    assert attention.kv_dtype == torch.float8_e4m3fn and attention.dtype == vllm_config.model_config.dtype
    layer = SimpleNamespace(_k_scale_float=0.25, _v_scale_float=0.5)
    batch = MixedBatch(*MIXED["mixed"][:2], torch.float16, device, num_tokens=MIXED["mixed"][2], seed=12)
    batch.to_fp8(0.25, 0.5)
    impl = EvenKVImpl(HQ, D, D ** -0.5, HKV, kv_cache_dtype="fp8")
    _, output = _run_step(builder, impl, batch, layer)
    _assert_cache_holds(batch)
    _assert_matches_reference(batch, output, k_scale=0.25, v_scale=0.5)


def test_page_views(device):
    """vLLM's [blocks, Hkv, block_size, 2D] cache in any layout -> [blocks, block_size, Hkv, D]
    K and V views of its memory, without a copy; a cache of another shape is refused."""
    for layout in ("NHD", "HND"):
        cache = _vllm_kv_cache(4, torch.float16, device, layout=layout)
        k, v = kv_cache_page_views(cache, D)
        assert k.shape == v.shape == (4, BLOCK, HKV, D) and k.stride() == v.stride()
        k[1, 3, 0, 5] = 1.0
        v[2, 0, 1, 7] = 2.0
        assert cache[1, 0, 3, 5] == 1.0 and cache[2, 1, 0, D + 7] == 2.0
    with pytest.raises(ValueError, match=rf"kv_cache: expected \[num_blocks, Hkv, block_size, 2\*{D}\]"):
        kv_cache_page_views(torch.zeros(4, HKV, BLOCK, D, device=device), D)


# -- speculative decoding: verify rows are decode rows --------------------------------------

# name: (target checkpoint, --speculative-config with draft checkpoints by name)
SPECULATIVE = {
    "ngram": ("qwen3", dict(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4, prompt_lookup_min=2)),
    "ngram-k7": ("qwen3", dict(method="ngram", num_speculative_tokens=7, prompt_lookup_max=4)),
    "eagle": ("llama", dict(method="eagle", model="eagle", num_speculative_tokens=3)),
    "eagle-parallel": ("llama", dict(method="eagle", model="eagle", num_speculative_tokens=3,
                                     parallel_drafting=True)),
    "eagle3": ("llama", dict(method="eagle3", model="eagle3", num_speculative_tokens=5)),
    "mtp": ("glm-mtp", dict(method="mtp", num_speculative_tokens=2)),
}


def speculative_config(checkpoints, name, target=None, **overrides):
    """A VllmConfig speculating as SPECULATIVE[name] (on another target checkpoint with ``target``)."""
    default_target, speculative = SPECULATIVE[name]
    target = target or default_target
    speculative = {**speculative, **overrides}
    if "model" in speculative:
        speculative["model"] = checkpoints[speculative["model"]]
    return make_vllm_config(checkpoints[target], speculative=speculative)


@pytest.fixture(scope="module")
def ngram_config(cpu_platform, checkpoints):
    return speculative_config(checkpoints, "ngram")


@pytest.fixture()
def ngram_builder(ngram_config, device):
    return EvenKVMetadataBuilder(_spec(torch.bfloat16), ["l0"], ngram_config, device)


@pytest.mark.parametrize("name", list(SPECULATIVE))
def test_speculative_configs_make_verify_rows_decode_rows(cpu_platform, checkpoints, device, name):
    """Each method's verify step (1 + k query tokens per request; 1 + 2k with parallel
    drafting) is a decode batch: vLLM's reorder threshold, evenkv's decode rows and full
    CUDA graphs of uniform verify batches (UNIFORM_BATCH) all take 1 + k."""
    from vllm.v1.attention.backend import AttentionCGSupport

    config = speculative_config(checkpoints, name)
    spec = config.speculative_config
    q_len, reason = verify_q_len(config)
    # vLLM's own count: 1 + k, or 1 + 2k under the V1 runner's parallel drafting.
    assert q_len == 1 + (2 if spec.parallel_drafting and not config.use_v2_model_runner else 1) * \
        spec.num_speculative_tokens
    assert f"verify rows of up to {q_len} query tokens run on the decode kernels" in reason
    kv_spec = _spec(torch.bfloat16)
    assert EvenKVMetadataBuilder.get_cudagraph_support(config, kv_spec) is AttentionCGSupport.UNIFORM_BATCH
    builder = EvenKVMetadataBuilder(kv_spec, ["l0"], config, device)
    assert builder.reorder_batch_threshold == q_len  # vLLM's _init_reorder_batch_threshold agrees
    assert attention_of(builder).max_decode_q_len == q_len
    # A uniform verify batch padded as vLLM pads it for a full graph: decode rows only.
    cam = _cam([q_len] * 2, [40, q_len], device, num_reqs_padding=2)
    md = builder.build_for_cudagraph_capture(cam)
    assert (md.num_decodes, md.num_prefills, md.decode_q_len) == (4, 0, q_len)


def test_without_speculation_decode_rows_have_one_token(vllm_config, builder):
    from vllm.v1.attention.backend import AttentionCGSupport

    assert verify_q_len(vllm_config) == (1, "no speculative decoding")
    assert builder.get_cudagraph_support(vllm_config, _spec(torch.bfloat16)) is \
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert builder.reorder_batch_threshold == 1 and attention_of(builder).max_decode_q_len == 1


def test_verify_rows_past_the_decode_kernels_run_with_the_prefill_rows(cpu_platform, checkpoints, device):
    """16 draft tokens make verify rows of 17: more than a decode row takes. They stay extend
    rows (reorder threshold 1), full graphs only for single-token steps, and the start-up
    log says why; a verify batch still matches the reference."""
    from vllm.v1.attention.backend import AttentionCGSupport

    config = speculative_config(checkpoints, "ngram", num_speculative_tokens=16)
    q_len, reason = verify_q_len(config)
    assert q_len == 1 and "verify rows of 17 query tokens run with the prefill rows" in reason
    assert EvenKVMetadataBuilder.get_cudagraph_support(config, _spec(torch.bfloat16)) is \
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    builder = EvenKVMetadataBuilder(_spec(torch.bfloat16), ["l0"], config, device)
    assert builder.reorder_batch_threshold == 1
    batch = MixedBatch([1, 17, 5], [30, 60, 20], torch.bfloat16, device, seed=21)
    md, output = _run_step(builder, EvenKVImpl(HQ, D, D ** -0.5, HKV), batch)
    assert (md.num_decodes, md.num_prefills, md.decode_q_len) == (1, 2, 1)
    _assert_matches_reference(batch, output)


def test_verify_rows_too_tall_for_the_decode_tiles_are_refused(cpu_platform, checkpoints, device):
    """16 verify tokens x 16 query heads per KV head (Qwen3-235B) are more tile rows than a
    decode tile holds: the builder refuses, saying so in vLLM's terms; 8 tokens fit."""
    kv_spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=128, dtype=torch.bfloat16)
    config = speculative_config(checkpoints, "ngram", target="qwen3-235b-heads", num_speculative_tokens=15)
    with pytest.raises(NotImplementedError, match="verify rows of up to 16 query tokens.*use fewer speculative"):
        EvenKVMetadataBuilder(kv_spec, ["l0"], config, device)
    config = speculative_config(checkpoints, "ngram-k7", target="qwen3-235b-heads")
    assert attention_of(EvenKVMetadataBuilder(kv_spec, ["l0"], config, device)).max_decode_q_len == 8


@pytest.mark.parametrize("q_lens,seq_lens,num_tokens,padded_reqs,expect", [
    # (num_decodes, num_prefills, decode_q_len, the decode rows' query tokens)
    ([4, 4, 4], [40, 9, 17], None, 0, (3, 0, 4, 12)),                     # uniform verify step
    ([1, 4, 2, 3, 1], [40, 9, 17, 5, 3], None, 0, (5, 0, 4, 11)),          # verify rows of any length
    ([1, 3, 2, 9, 4], [40, 9, 17, 30, 8], 24, 0, (3, 2, 3, 6)),            # + a prefill: decodes end there
    ([1, 1, 1], [40, 9, 17], None, 0, (3, 0, 1, 3)),                       # no drafts this step: plain decode
    ([4, 4], [12, 30], 24, 4, (6, 0, 4, 8)),                               # padded for a full graph
    ([6, 4], [12, 30], None, 0, (0, 2, 1, 0)),                             # prefill first: no decodes
])
def test_builder_splits_verify_rows(ngram_builder, device, q_lens, seq_lens, num_tokens, padded_reqs, expect):
    cam = _cam(q_lens, seq_lens, device, num_tokens=num_tokens, num_reqs_padding=padded_reqs)
    md = ngram_builder.build(0, cam)
    (_, plan), = md.plans.values()
    assert (md.num_decodes, md.num_prefills, md.decode_q_len, plan.num_decode_tokens) == expect
    assert plan.num_decodes == expect[0]


@pytest.mark.parametrize("q_lens,seq_lens,num_tokens,padded_reqs", [
    ([1, 4, 2, 3, 1, 9], [70, 16, 21, 7, 3, 9], 24, 0),    # verify rows of 1-4 tokens, a fresh prefill, padding
    ([4, 4, 2, 8], [33, 4, 2, 40], None, 0),                # a 2-token prefill is a short decode row; a chunk
    ([4, 4], [50, 9], 24, 4),                               # uniform verify step padded to 6 requests
    ([3, 1, 2], [3, 1, 2], None, 0),                        # new requests: verify-sized prompts from position 0
])
def test_verify_batch_matches_reference(ngram_builder, device, q_lens, seq_lens, num_tokens, padded_reqs):
    """Verify rows (causal among their new tokens, on a cached prefix) next to prefill rows,
    through the builder and the impl, against the fp32 oracle."""
    batch = MixedBatch(q_lens, seq_lens, torch.bfloat16, device, num_tokens=num_tokens, num_reqs_padding=padded_reqs,
                       seed=sum(q_lens))
    md, output = _run_step(ngram_builder, EvenKVImpl(HQ, D, D ** -0.5, HKV), batch)
    assert md.decode_q_len > 1
    _assert_matches_reference(batch, output)


def test_verify_rows_on_every_layer_kind(cpu_platform, checkpoints, device, monkeypatch):
    """Verify rows under a sliding window with sinks (gpt-oss-like) and under a soft-cap."""
    from evenkv.integrations import vllm_backend

    full, windowed, capped = LayerKind(), LayerKind(window=8, sinks=True), LayerKind(logit_cap=10.0)
    monkeypatch.setattr(vllm_backend, "layer_kinds", lambda config, names: {
        full: {names[0]: None}, windowed: {names[1]: None}, capped: {names[2]: None}})
    builder = EvenKVMetadataBuilder(_spec(torch.bfloat16), ["l0", "l1", "l2"], speculative_config(
        checkpoints, "eagle3"), device)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=device)
    batch = MixedBatch([6, 1, 3, 11], [70, 30, 3, 20], torch.bfloat16, device, seed=31)
    md, output = _run_step(builder, EvenKVImpl(HQ, D, D ** -0.5, HKV), batch)
    assert (md.num_decodes, md.decode_q_len) == (3, 6)
    _assert_matches_reference(batch, output)
    for impl, terms in ((EvenKVImpl(HQ, D, D ** -0.5, HKV, sliding_window=8, sinks=sinks),
                         dict(sliding_window=8, sinks=sinks)),
                        (EvenKVImpl(HQ, D, D ** -0.5, HKV, logits_soft_cap=10.0), dict(logit_cap=10.0))):
        output = torch.full_like(batch.query, 7.0)
        impl.forward(None, batch.query, batch.key, batch.value, batch.kv_cache, md, output)
        _assert_matches_reference(batch, output, **terms)


def test_verify_rows_over_an_fp8_cache(ngram_config, device):
    """--kv-cache-dtype fp8 with speculation: verify rows read the e4m3 cache with the layer's scales."""
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HKV, head_size=D, dtype=torch.uint8)
    builder = EvenKVMetadataBuilder(spec, ["l0"], ngram_config, device)
    layer = SimpleNamespace(_k_scale_float=0.25, _v_scale_float=0.5)
    batch = MixedBatch([1, 4, 3, 7], [70, 16, 21, 7], torch.float16, device, num_tokens=20, seed=13)
    batch.to_fp8(0.25, 0.5)
    md, output = _run_step(builder, EvenKVImpl(HQ, D, D ** -0.5, HKV, kv_cache_dtype="fp8"), batch, layer)
    assert (md.num_decodes, md.decode_q_len) == (3, 4)
    _assert_matches_reference(batch, output, k_scale=0.25, v_scale=0.5)


def test_drafting_builds(cpu_platform, checkpoints, device, caplog):
    """An EAGLE drafter's steps (``build_for_drafting``: fast_build) as vLLM's V1 proposer
    makes them: the target's verify batch first, then one query token per request on
    query_start_loc = arange, seq_lens grown on the GPU. Each is planned like a step; the
    error poll is the target's alone (the flag stays set through a drafting build)."""

    from evenkv import errors

    builder = EvenKVMetadataBuilder(_spec(torch.bfloat16), ["draft"], speculative_config(checkpoints, "eagle"),
                                    device)
    impl = EvenKVImpl(HQ, D, D ** -0.5, HKV)
    verify = MixedBatch([4, 4, 4], [40, 9, 100], torch.bfloat16, device, seed=41)
    impl.do_kv_cache_update(None, verify.key, verify.value, verify.kv_cache, verify.cam.slot_mapping)
    md = builder.build_for_drafting(verify.cam, draft_index=0)
    assert (md.num_decodes, md.decode_q_len) == (3, 4)
    output = torch.full_like(verify.query, 7.0)
    impl.forward(None, verify.query, verify.key, verify.value, verify.kv_cache, md, output)
    _assert_matches_reference(verify, output)
    step = MixedBatch([1, 1, 1], [41, 10, 101], torch.bfloat16, device, seed=42)
    errors.check_errors(device)
    errors.error_flag(device)[0] = errors.SLOT_OUT_OF_RANGE
    with caplog.at_level(logging.ERROR, logger="evenkv"):
        md, output = _run_step(builder, impl, step, draft_index=1)
        assert (md.num_decodes, md.decode_q_len, md.num_prefills) == (3, 1, 0)
        assert errors.peek(device) != [] and "slot_mapping" not in caplog.text
        builder.build(0, step.cam)
    assert "slot_mapping: a slot >= the KV cache's slots" in caplog.text
    _assert_matches_reference(step, output)


def test_builder_refuses_other_index_dtypes(builder, device):
    """Start-up compiles the kernels for vLLM's int32 lengths; other lengths are refused."""
    cam = _cam([1, 1], [5, 9], device)
    cam.seq_lens = cam.seq_lens.long()
    with pytest.raises(TypeError, match="seq_lens: expected vLLM's torch.int32"):
        builder.build(0, cam)


# -- chunked-local attention (Llama 4): vLLM's wrapper around this backend -----------------------

CHUNK = 32  # C: a multiple of BLOCK, as vLLM requires


def chunked_local_builder(config, device, monkeypatch, chunk=CHUNK):
    """The builder of a chunked-local layer, made as vLLM's ChunkedLocalAttention makes it: this
    backend wrapped by ``create_chunked_local_attention_backend`` (a builder subclass that plans
    ``make_local_attention_virtual_batches``' batch, CUDA graphs NEVER), on the layer's
    ``ChunkedLocalAttentionSpec``."""
    import vllm.utils.torch_utils
    from vllm.model_executor.layers.attention.chunked_local_attention import create_chunked_local_attention_backend
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    # vLLM stages the virtual batch in pinned host memory, which a CPU torch lacks.
    monkeypatch.setattr(vllm.utils.torch_utils, "PIN_MEMORY", torch.cuda.is_available())
    backend = create_chunked_local_attention_backend(EvenKVBackend, chunk)
    spec = ChunkedLocalAttentionSpec(block_size=BLOCK, num_kv_heads=HKV, head_size=D, dtype=torch.bfloat16,
                                     attention_chunk_size=chunk)
    builder = backend.get_builder_cls()(spec, ["model.layers.0.self_attn.attn"], config, device)
    assert isinstance(builder, EvenKVMetadataBuilder) and type(builder) is not EvenKVMetadataBuilder
    return builder


def chunked_local_reference(batch, chunk, compute_dtype=torch.float32):
    """Chunked-local attention over the test's slot caches and the step's own block table: the
    query at absolute position p of a request sees that request's keys at [p // C * C, p]."""
    c, q = batch.cam, batch.query
    out = torch.zeros(q.shape, dtype=compute_dtype, device=q.device)
    cu = c.query_start_loc_cpu.tolist()
    group = q.shape[1] // batch.ref_k.shape[1]
    for r, seq_len in enumerate(c.seq_lens.tolist()):
        q_len = cu[r + 1] - cu[r]
        for i in range(q_len):
            p = seq_len - q_len + i
            pos = torch.arange(p // chunk * chunk, p + 1, device=q.device)
            slots = c.block_table_tensor[r, pos // BLOCK].long() * BLOCK + pos % BLOCK
            k = batch.ref_k[slots].to(compute_dtype).repeat_interleave(group, dim=1)  # [L, Hq, D]
            v = batch.ref_v[slots].to(compute_dtype).repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,lhd->hl", q[cu[r] + i].to(compute_dtype), k) * D ** -0.5
            out[cu[r] + i] = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), v)
    return out


def _chunked_local_step(builder, batch):
    """_run_step, with no bad batch data flagged by the kernels (a virtual request is an ordinary one)."""
    from evenkv import errors

    device = batch.query.device
    errors.check_errors(device)
    md, output = _run_step(builder, EvenKVImpl(HQ, D, D ** -0.5, HKV), batch)
    assert errors.peek(device) == []
    return md, output


def _assert_matches_chunked_local(batch, output, chunk=CHUNK):
    _assert_within_tolerance(batch, output, chunked_local_reference(batch, chunk),
                             chunked_local_reference(batch, chunk, batch.query.dtype))


def test_chunked_local_builder_is_sized_for_virtual_batches(vllm_config, device, monkeypatch):
    """vLLM's wrapper declares no CUDA graphs (the layers run eagerly); the plan takes the most
    virtual requests a step can make: 2 per request plus one per C batched tokens."""
    from vllm.v1.attention.backend import AttentionCGSupport

    builder = chunked_local_builder(vllm_config, device, monkeypatch)
    assert type(builder).get_cudagraph_support(vllm_config, builder.kv_cache_spec) is AttentionCGSupport.NEVER
    scheduler = vllm_config.scheduler_config
    assert attention_of(builder).max_batch_size == 2 * MAX_NUM_SEQS + scheduler.max_num_batched_tokens // CHUNK
    assert attention_of(builder).max_pages_per_request == MAX_MODEL_LEN // BLOCK


CHUNKED_LOCAL = {
    # decode rows whose context crosses two chunk boundaries, one (the query the first token of
    # its chunk), one (the last token); a chunked prefill whose first virtual request is one
    # token (a decode row); a chunked prefill across a boundary; a fresh prefill longer than C;
    # 3 padding tokens. 9 virtual requests.
    "mixed": ([1, 1, 1, 6, 10, 45], [70, 33, 64, 37, 40, 45], 67),
    # decode rows only, in chunks 1, 0, 3, 0 (its last token) and 6; 3 padding tokens
    "decode_only": ([1, 1, 1, 1, 1], [33, 1, 100, 32, 200], 8),
}


@pytest.mark.parametrize("case", list(CHUNKED_LOCAL))
def test_chunked_local_forward_matches_reference(vllm_config, device, monkeypatch, case):
    """A step through vLLM's wrapper (its virtual batch) and the impl's forward on a real cache,
    against chunked-local attention computed from the original block table."""
    q_lens, seq_lens, num_tokens = CHUNKED_LOCAL[case]
    builder = chunked_local_builder(vllm_config, device, monkeypatch)
    batch = MixedBatch(q_lens, seq_lens, torch.bfloat16, device, num_tokens=num_tokens, seed=len(q_lens))
    md, output = _chunked_local_step(builder, batch)
    (_, plan), = md.plans.values()
    assert plan.batch_size == sum(1 + (s - 1) // CHUNK - (s - q) // CHUNK for q, s in zip(q_lens, seq_lens))
    _assert_cache_holds(batch)
    _assert_matches_chunked_local(batch, output)
    # The reference with one chunk past every position is full causal attention.
    assert torch.allclose(chunked_local_reference(batch, MAX_MODEL_LEN), batch.reference(), atol=1e-5)


def test_chunked_local_virtual_requests_past_max_num_seqs(vllm_config, device, monkeypatch):
    """MAX_NUM_SEQS requests whose queries cross chunk boundaries (C = 16) make 17 virtual
    requests, more than max_num_seqs: one plan, every row right."""
    q_lens, seq_lens = [2] * 6 + [20, 40], [17] * 6 + [40, 40]
    builder = chunked_local_builder(vllm_config, device, monkeypatch, chunk=16)
    batch = MixedBatch(q_lens, seq_lens, torch.bfloat16, device, seed=17)
    md, output = _chunked_local_step(builder, batch)
    (_, plan), = md.plans.values()
    assert len(q_lens) == MAX_NUM_SEQS and plan.batch_size == 17
    _assert_matches_chunked_local(batch, output, chunk=16)


def test_chunked_local_verify_rows_split_at_chunk_boundaries(ngram_config, device, monkeypatch):
    """Speculative decoding (n-gram, 3 draft tokens): a verify row across a chunk boundary becomes
    two shorter verify rows, still decode rows; with a prefill after them, and alone."""
    builder = chunked_local_builder(ngram_config, device, monkeypatch)
    batch = MixedBatch([4, 4, 4, 1, 40], [34, 66, 20, 97, 50], torch.bfloat16, device, num_tokens=56, seed=19)
    md, output = _chunked_local_step(builder, batch)
    # Virtual requests: 2 + 2, 2 + 2, 4, 1 (decode rows), then 22 + 18.
    assert (md.num_decodes, md.decode_q_len, md.num_prefills) == (6, 4, 2)
    _assert_matches_chunked_local(batch, output)
    batch = MixedBatch([4, 4, 3], [34, 8, 65], torch.bfloat16, device, seed=20)
    md, output = _chunked_local_step(builder, batch)
    # 2 + 2, 4, 2 + 1: verify rows only.
    assert (md.num_decodes, md.decode_q_len, md.num_prefills) == (5, 4, 0)
    _assert_matches_chunked_local(batch, output)


# -- tensor parallelism: each rank's share of the heads --------------------------------------


def _attention_layer_of_rank(config, model: str, tp: int, monkeypatch):
    """The model's real attention module (Qwen3Attention or LlamaAttention), built as one rank
    of a tensor-parallel group of ``tp`` builds it: the layer divides the heads by vLLM's TP
    world size (a stand-in group, no process group started) and selects ``CUSTOM`` the way
    vLLM's CUDA platform does (validate_configuration, here for an SM90 device). Returns its
    ``vllm.model_executor.layers.attention.Attention``, registered under its name."""
    import vllm.platforms
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.platforms.interface import DeviceCapability
    from vllm.utils.torch_utils import set_default_torch_dtype

    def select_like_cuda(selected_backend, attn_selector_config, num_heads=None):
        backend = selected_backend.get_class()
        reasons = backend.validate_configuration(device_capability=DeviceCapability(9, 0),
                                                 **attn_selector_config._asdict())
        if reasons:
            raise ValueError(f"Selected backend {selected_backend} is not valid: {reasons}")
        return ".".join(backend.full_cls_name())

    plugin.register()
    monkeypatch.setattr(parallel_state, "_TP", SimpleNamespace(world_size=tp, rank_in_group=0))
    if not torch.cuda.is_available():
        monkeypatch.setattr(vllm.platforms._current_platform, "get_attn_backend_cls", select_like_cuda)
    hf = config.model_config.hf_config
    with set_current_vllm_config(config), set_default_torch_dtype(config.model_config.dtype):
        if model.startswith("qwen3"):
            from vllm.model_executor.models.qwen3 import Qwen3Attention

            module = Qwen3Attention(hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads,
                                    rope_parameters=hf.rope_parameters, max_position=MAX_MODEL_LEN,
                                    head_dim=hf.head_dim, cache_config=config.cache_config,
                                    prefix="model.layers.0.self_attn")
        else:
            from vllm.model_executor.models.llama import LlamaAttention

            module = LlamaAttention(hf, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads,
                                    max_position_embeddings=MAX_MODEL_LEN, cache_config=config.cache_config,
                                    prefix="model.layers.0.self_attn")
    return module.attn


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("model,heads", [("qwen3-8b-heads", (32, 8)), ("llama-70b-heads", (64, 8))])
def test_tensor_parallel_rank_shapes(cpu_platform, checkpoints, device, monkeypatch, model, heads, tp):
    """One rank of a tensor-parallel deployment: the model's attention layer holds Hq / TP query
    heads and its KV-cache spec Hkv / TP KV heads; the builder plans for those (read from the
    layer), binds its plan to the layer's impl, and a mixed batch through that impl matches
    the reference."""
    import dataclasses

    config = make_vllm_config(checkpoints[model], tensor_parallel_size=tp, attention_backend="CUSTOM",
                              dtype="bfloat16")
    layer = _attention_layer_of_rank(config, model, tp, monkeypatch)
    hq, hkv = heads[0] // tp, heads[1] // tp
    parallel = config.parallel_config
    assert (config.model_config.get_num_attention_heads(parallel), config.model_config.get_num_kv_heads(parallel)) \
        == (hq, hkv)
    impl = layer.impl
    assert isinstance(impl, EvenKVImpl) and (impl.num_heads, impl.num_kv_heads) == (hq, hkv)
    kv_spec = dataclasses.replace(layer.get_kv_cache_spec(config), block_size=BLOCK)  # a kernel block size
    assert kv_spec.num_kv_heads == hkv
    d = kv_spec.head_size
    builder = EvenKVMetadataBuilder(kv_spec, [layer.layer_name], config, device)
    attention = attention_of(builder)
    assert impl.attentions == [attention]
    assert (attention.num_q_heads, attention.num_kv_heads, attention.group_size) == (hq, hkv, heads[0] // heads[1])
    assert (attention.decode.num_q_heads, attention.decode.num_kv_heads) == (hq, hkv)
    batch = MixedBatch([1, 1, 3], [40, 17, 20], torch.bfloat16, device, seed=tp, heads=(hq, hkv, d))
    md, output = _run_step(builder, impl, batch, layer)
    (_, plan), = md.plans.values()
    assert (plan.batch_size, plan.num_decodes, plan.decode.batch_size) == (3, 2, 2)
    assert output.shape == (5, hq, d)
    _assert_matches_reference(batch, output, sm_scale=impl.scale)


# -- start-up: what warm-up compiles, and nothing after -------------------------------------


class _EnginePrefill:
    """Stands in for vLLM's FlashAttention (``prefill.VllmFlashAttention``), which the builder
    gets on a CUDA device with ``vllm.vllm_flash_attn`` (the H200 kit): extend rows are then
    the engine's, and evenkv compiles no extend kernel."""

    name = "FA3 (stand-in)"
    fp8_cache_dtypes = ()

    def takes_sinks(self, num_q_heads):
        return True

    def __call__(self, q, k_cache, v_cache, out, **kwargs):
        pass


def _random_steps(builder, impl, layer, gen, device, *, steps, hq, hkv, d, num_blocks, drafts):
    """vLLM-like steps (build, KV write, forward) of random shapes: decode rows of 1 to
    reorder_batch_threshold query tokens first (verify rows, with ``drafts``), then prefill
    chunks on cached prefixes; sometimes padded as for a full graph (q_len 0, seq_len 0);
    sometimes a drafter's build (fast_build); batch sizes up to max_num_seqs."""
    threshold = builder.reorder_batch_threshold
    max_reqs = builder.vllm_config.scheduler_config.max_num_seqs
    width = builder.max_pages
    for step in range(steps):
        batch = int(torch.randint(1, max_reqs + 1, (1,), generator=gen))
        decodes = batch if step % 3 == 0 else int(torch.randint(0, batch + 1, (1,), generator=gen))
        q_lens = torch.randint(1, threshold + 1, (decodes,), generator=gen).tolist()
        if drafts and step % 3 == 0:
            q_lens = [threshold] * decodes  # a uniform verify step, as full graphs replay it
        q_lens += torch.randint(threshold + 1, 3 * threshold + 3, (batch - decodes,), generator=gen).tolist()
        seq_lens = [q + int(torch.randint(0, MAX_MODEL_LEN - q + 1, (1,), generator=gen)) for q in q_lens]
        padding = int(torch.randint(0, 4, (1,), generator=gen)) if decodes == batch else 0
        table = torch.randint(1, num_blocks, (batch + padding, width), generator=gen, dtype=torch.int32)
        cam = _cam(q_lens, seq_lens, device, block_table=table, num_reqs_padding=padding)
        tokens = cam.num_actual_tokens
        md = (builder.build_for_drafting(cam, draft_index=step % 2) if drafts and step % 4 == 1 else
              builder.build(0, cam))
        query = torch.zeros(tokens, hq, d, dtype=torch.bfloat16, device=device)
        new = torch.zeros(tokens, hkv, d, dtype=torch.bfloat16, device=device)
        kv_cache = layer.kv_cache[0] if isinstance(layer.kv_cache, list) else layer.kv_cache
        impl.do_kv_cache_update(layer, new, new, kv_cache, cam.slot_mapping)
        impl.forward(layer, query, new, new, kv_cache, md, torch.empty_like(query))


@pytest.mark.skipif(not is_interpreter(), reason="the recorder stands in for compiles under the interpreter; with "
                    "compiled kernels test_gpu_no_compile_after_dummy_run counts real ones")
@pytest.mark.parametrize("prefill", ["engine", "triton"])
@pytest.mark.parametrize("speculation", [None, "ngram"])
def test_startup_compiles_only_reachable_kernels(cpu_platform, checkpoints, device, monkeypatch,
                                                 recorder, prefill, speculation):  # noqa: F811
    """A Qwen3-8B attention layer (32 q / 8 KV heads of 128, bf16, pages of 16) under vLLM's
    H200 defaults (max_num_seqs 1024): the dummy run before serving compiles what evenkv can
    launch for vLLM's batches (counted below, kernel by kernel), and no later step, with or
    without speculation (n-gram, 3 draft tokens), launches anything else."""
    import collections
    import dataclasses

    from evenkv.configs import extend_configs
    from evenkv.integrations import vllm_backend
    from evenkv.kernels.plan_launch import plan_block_buckets

    if prefill == "engine":
        monkeypatch.setattr(vllm_backend, "vllm_flash_attention", lambda device: _EnginePrefill())
    speculative = None if speculation is None else dict(SPECULATIVE[speculation][1])
    config = make_vllm_config(checkpoints["qwen3-8b-heads"], attention_backend="CUSTOM", dtype="bfloat16",
                              max_num_seqs=1024, speculative=speculative)
    layer = _attention_layer_of_rank(config, "qwen3", 1, monkeypatch)
    impl = layer.impl
    kv_spec = dataclasses.replace(layer.get_kv_cache_spec(config), block_size=BLOCK)
    builder = EvenKVMetadataBuilder(kv_spec, [layer.layer_name], config, device)
    hq, hkv, d = 32, 8, 128
    num_blocks = 64
    layer.kv_cache = _vllm_kv_cache(num_blocks, torch.bfloat16, device, hkv, d)
    # vLLM's dummy run after the KV cache is allocated: no metadata, real tensors.
    tokens = 64
    qkv = torch.zeros(tokens, (hq + 2 * hkv) * d, dtype=torch.bfloat16, device=device)
    query, key = qkv[:, :hq * d].view(tokens, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)
    slots = torch.full((tokens,), -1, dtype=torch.int64, device=device)
    impl.do_kv_cache_update(layer, key, key, layer.kv_cache, slots)
    impl.forward(layer, query, key, key, layer.kv_cache, None, torch.empty_like(query))
    assert attention_of(builder).warmed_up
    # What can run, for vLLM's int32 lengths and int64 slots only (under the interpreter both
    # decode configs have one grid, so their plan kernels coincide):
    chunks = len(plan_block_buckets(1024))  # the plan kernels' batch chunks: 128 and 1024
    row_kinds = 1 if speculation is None else 2  # single-token rows, + verify rows (1-4 tokens)
    expected = {
        "kv_write_kernel": 1,
        "guard_query_rows_kernel": 1,  # the plans' guard of cu_seqlens_q
        "audit_pages_kernel": chunks,
        "plan_stream_kernel": chunks * row_kinds,
        # single-token rows: the decode row and the many-segments row; verify rows of 2 and
        # of 4 tokens (x G = 4 heads) share one 16-row tile
        "decode_stream_kernel": 1 + row_kinds,
        "merge_stream_kernel": row_kinds,
    }
    if prefill == "triton":  # each extend config a batch can pick, its plan and kernel
        configs = len(extend_configs(attention_of(builder).arch, 128, 4))
        expected.update(extend_plan_kernel=configs, extend_kernel=configs)
    else:  # the bounds of the engine prefill kernel's rows: the guard, and the audit that zeroes a bad request
        expected.update(audit_pages_kernel=2 * chunks, guard_prefill_rows_kernel=1)
    assert collections.Counter(name for name, _, _ in recorder.compiled) == expected
    _random_steps(builder, impl, layer, torch.Generator().manual_seed(0), device, steps=30, hq=hq, hkv=hkv, d=d,
                  num_blocks=num_blocks, drafts=speculation is not None)
    missing = {key for key in recorder.launched if key not in recorder.compiled}
    assert recorder.launched and not missing, f"launched but not compiled at start-up: {sorted(missing)[:3]}"


def test_first_build_warms_up_on_the_bound_cache(cpu_platform, checkpoints, device, monkeypatch, recorder):  # noqa: F811
    """vLLM builds a warm-up run's metadata before its forward: the builder's first build warms
    its Attention up on a bound cache of its layers (so that the warm-up builds every kernel in
    one batch, the grids' decode kernels with the rest), and leaves it to the forward while
    the layers hold vLLM's placeholder."""
    import dataclasses

    config = make_vllm_config(checkpoints["qwen3-8b-heads"], attention_backend="CUSTOM", dtype="bfloat16")
    layer = _attention_layer_of_rank(config, "qwen3", 1, monkeypatch)
    kv_spec = dataclasses.replace(layer.get_kv_cache_spec(config), block_size=BLOCK)
    builder = EvenKVMetadataBuilder(kv_spec, [layer.layer_name], config, device)
    cam = _cam([1, 1], [20, 33], device)
    builder.build(0, cam)  # placeholder cache: nothing to warm up on
    assert not attention_of(builder).warmed_up and not recorder.compiled
    layer.kv_cache = _vllm_kv_cache(64, torch.bfloat16, device, 8, 128)
    builder.build(0, cam)
    assert attention_of(builder).warmed_up
    assert {"decode_stream_kernel", "merge_stream_kernel", "plan_stream_kernel"} <= {k[0] for k in recorder.compiled}


# -- GPU lane ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_mixed_batch_bf16(vllm_config):
    dev = torch.device("cuda")
    builder = EvenKVMetadataBuilder(_spec(torch.bfloat16), ["l0"], vllm_config, dev)
    impl = EvenKVImpl(HQ, D, D ** -0.5, HKV)
    batch = MixedBatch([1, 1, 1, 40, 3], [200, 1, 255, 100, 3], torch.bfloat16, dev, num_tokens=50, seed=7)
    _, output = _run_step(builder, impl, batch)
    _assert_matches_reference(batch, output)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_decode_cuda_graph_replay_after_replan(vllm_config):
    """What UNIFORM_SINGLE_TOKEN_DECODE promises: capture a padded decode step once, then for
    a later step with other lengths run only build() (outside the graph) and replay."""
    dev = torch.device("cuda")
    builder = EvenKVMetadataBuilder(_spec(torch.bfloat16), ["l0"], vllm_config, dev)
    impl = EvenKVImpl(HQ, D, D ** -0.5, HKV)
    num_blocks = 1 + 4 * (MAX_MODEL_LEN // BLOCK)  # fixed, so every step's cache has one shape
    first = MixedBatch([1] * 4, [9, 200, 33, 1], torch.bfloat16, dev, num_blocks=num_blocks, seed=1)
    # Persistent inputs, as vLLM's runner keeps them: refilled in place each step.
    cam = first.cam
    query, output = first.query.clone(), torch.empty_like(first.query)
    md = builder.build_for_cudagraph_capture(cam)
    impl.forward(None, query, None, None, first.kv_cache, md, output)  # warm-up (compiles)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(None, query, None, None, first.kv_cache, md, output)
    for seed, lens in ((2, [255, 2, 17, 64]), (3, [1, 1, 130, 250])):
        step = MixedBatch([1] * 4, lens, torch.bfloat16, dev, num_blocks=num_blocks, seed=seed)
        first.kv_cache.copy_(step.kv_cache)  # same block count: same shape
        impl.do_kv_cache_update(None, step.key, step.value, first.kv_cache, step.cam.slot_mapping)
        cam.seq_lens.copy_(step.cam.seq_lens)
        cam.block_table_tensor.copy_(step.cam.block_table_tensor)
        query.copy_(step.query)
        builder.build(0, cam)  # re-plan into the same buffers, outside the graph
        graph.replay()
        torch.cuda.synchronize()
        step.kv_cache = first.kv_cache
        _assert_matches_reference(step, output)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_verify_cuda_graph_replay_after_replan(ngram_config):
    """What UNIFORM_BATCH promises with speculation: capture a verify step (4 requests of 1 + 3
    query tokens, as vLLM captures it), then for later steps, one with other lengths and
    one padded as vLLM pads a smaller batch (requests of q_len 0 and seq_len 0), run only
    build() (outside the graph) and replay."""
    dev = torch.device("cuda")
    builder = EvenKVMetadataBuilder(_spec(torch.bfloat16), ["l0"], ngram_config, dev)
    impl = EvenKVImpl(HQ, D, D ** -0.5, HKV)
    num_blocks = 1 + 4 * (MAX_MODEL_LEN // BLOCK)
    first = MixedBatch([4] * 4, [9, 200, 33, 4], torch.bfloat16, dev, num_blocks=num_blocks, seed=1)
    cam = first.cam
    query, output = first.query.clone(), torch.empty_like(first.query)
    md = builder.build_for_cudagraph_capture(cam)
    assert (md.num_decodes, md.decode_q_len) == (4, 4)
    impl.forward(None, query, None, None, first.kv_cache, md, output)  # warm-up (compiles)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(None, query, None, None, first.kv_cache, md, output)
    for seed, q_lens, lens, padding in ((2, [4] * 4, [255, 5, 17, 64], 0), (3, [4], [130], 3)):
        step = MixedBatch(q_lens, lens, torch.bfloat16, dev, num_blocks=num_blocks, seed=seed, num_tokens=16,
                          num_reqs_padding=padding)
        first.kv_cache.copy_(step.kv_cache)
        impl.do_kv_cache_update(None, step.key, step.value, first.kv_cache, step.cam.slot_mapping)
        for name in ("query_start_loc", "query_start_loc_cpu", "seq_lens", "block_table_tensor"):
            getattr(cam, name).copy_(getattr(step.cam, name))
        query.copy_(step.query)
        output.fill_(7.0)
        builder.build(0, cam)
        graph.replay()
        torch.cuda.synchronize()
        step.kv_cache = first.kv_cache
        real = int(step.cam.query_start_loc_cpu[-1])
        output[real:] = 7.0  # rows of padding requests are the graph's to write or not
        _assert_matches_reference(step, output)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("speculation", [None, "ngram"])
def test_gpu_no_compile_after_dummy_run(cpu_platform, checkpoints, monkeypatch, compiles,  # noqa: F811
                                        speculation):
    """The compile count for real: after the dummy run, random vLLM-like steps (decode, verify,
    prefill rows; padded; drafting builds) run on the GPU and Triton builds no kernel."""
    import dataclasses

    speculative = None if speculation is None else dict(SPECULATIVE[speculation][1])
    config = make_vllm_config(checkpoints["qwen3-8b-heads"], attention_backend="CUSTOM", dtype="bfloat16",
                              max_num_seqs=1024, speculative=speculative)
    dev = torch.device("cuda")
    layer = _attention_layer_of_rank(config, "qwen3", 1, monkeypatch)
    impl = layer.impl
    kv_spec = dataclasses.replace(layer.get_kv_cache_spec(config), block_size=BLOCK)
    builder = EvenKVMetadataBuilder(kv_spec, [layer.layer_name], config, dev)
    hq, hkv, d, num_blocks, tokens = 32, 8, 128, 64, 64
    layer.kv_cache = _vllm_kv_cache(num_blocks, torch.bfloat16, dev, hkv, d)
    qkv = torch.zeros(tokens, (hq + 2 * hkv) * d, dtype=torch.bfloat16, device=dev)
    query, key = qkv[:, :hq * d].view(tokens, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)
    slots = torch.full((tokens,), -1, dtype=torch.int64, device=dev)
    impl.do_kv_cache_update(layer, key, key, layer.kv_cache, slots)
    impl.forward(layer, query, key, key, layer.kv_cache, None, torch.empty_like(query))
    torch.cuda.synchronize()
    compiles.clear()
    _random_steps(builder, impl, layer, torch.Generator().manual_seed(1), dev, steps=40, hq=hq, hkv=hkv, d=d,
                  num_blocks=num_blocks, drafts=speculation is not None)
    torch.cuda.synchronize()
    assert compiles == [], f"kernels compiled after the dummy run: {compiles}"


# -- prefill on vLLM's own FlashAttention -----------------------------------------------------


def test_flash_attention_prefill_choice(monkeypatch):
    """FA3 on SM90, FA2 elsewhere, none without a build, a CUDA device, or with EVENKV_PREFILL=triton;
    the call passes the extend rows to flash_attn_varlen_func as vLLM's FLASH_ATTN backend does."""
    import sys
    import types

    from evenkv.integrations import prefill

    calls = []
    fake = types.ModuleType("vllm.vllm_flash_attn.flash_attn_interface")
    fake.flash_attn_varlen_func = lambda **kw: calls.append(kw)
    fake.is_fa_version_supported = lambda version: version in (2, 3)
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn.flash_attn_interface", fake)
    monkeypatch.delenv("EVENKV_PREFILL", raising=False)
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    kernel = prefill.vllm_flash_attention(gpu)
    assert kernel.fa_version == 3 and kernel.name.startswith("FA3")
    q, cu, lens, pt = torch.zeros(5, 4, 64), torch.tensor([0, 5]), torch.tensor([9]), torch.zeros(1, 2)
    kernel(q, q, q, q, cu_seqlens_q=cu, seq_lens=lens, page_table=pt, max_q_len=5, max_seq_len=9, sm_scale=0.1)
    assert calls[0]["seqused_k"] is lens and calls[0]["block_table"] is pt and calls[0]["causal"]
    assert (calls[0]["max_seqlen_q"], calls[0]["max_seqlen_k"], calls[0]["fa_version"]) == (5, 9, 3)
    assert calls[0]["k_descale"] is None and calls[0]["q"] is q and calls[0]["s_aux"] is None
    # FA3 reads sinks (s_aux) as bf16 only, for up to 64 query heads.
    sinks = torch.tensor([0.1, -1.0, 2.5, 3.3])
    kernel(q, q, q, q, cu_seqlens_q=cu, seq_lens=lens, page_table=pt, max_q_len=5, max_seq_len=9, sm_scale=0.1,
           sinks=sinks)
    assert calls[-1]["s_aux"].dtype == torch.bfloat16 and torch.equal(calls[-1]["s_aux"], sinks.bfloat16())
    kernel(q, q, q, q, cu_seqlens_q=cu, seq_lens=lens, page_table=pt, max_q_len=5, max_seq_len=9, sm_scale=0.1,
           sinks=sinks.bfloat16())
    assert calls[-1]["s_aux"].dtype == torch.bfloat16
    assert kernel.takes_sinks(64) and not kernel.takes_sinks(65)
    assert kernel.fp8_cache_dtypes == kernel.invariant().fp8_cache_dtypes == (torch.bfloat16,)  # as FLASH_ATTN
    k8 = torch.zeros(2, 16, 2, 64, dtype=torch.float8_e4m3fn)
    q[0, 0, 0] = 1000.0  # past e4m3's largest value: saturates
    kernel(q, k8, k8, q, cu_seqlens_q=cu, seq_lens=lens, page_table=pt, max_q_len=5, max_seq_len=9, sm_scale=0.1,
           k_scale=0.05, v_scale=0.25)
    call = calls[-1]
    assert call["q"].dtype == torch.float8_e4m3fn and call["q"][0, 0, 0].float() == 448.0
    assert call["k_descale"].shape == (1, 2) and call["k_descale"].dtype == torch.float32
    assert call["k_descale"].eq(0.05).all() and call["v_descale"].eq(0.25).all()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    fa2 = prefill.vllm_flash_attention(gpu)
    assert fa2.fa_version == 2 and fa2.fp8_cache_dtypes == () and not fa2.takes_sinks(8)
    assert prefill.vllm_flash_attention(torch.device("cpu")) is None
    fake.is_fa_version_supported = lambda version: False
    assert prefill.vllm_flash_attention(gpu) is None
    fake.is_fa_version_supported = lambda version: True
    monkeypatch.setenv("EVENKV_PREFILL", "triton")
    assert prefill.vllm_flash_attention(gpu) is None
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn.flash_attn_interface", None)  # import fails
    monkeypatch.setenv("EVENKV_PREFILL", "auto")
    assert prefill.vllm_flash_attention(gpu) is None
