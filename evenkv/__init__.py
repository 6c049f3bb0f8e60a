"""evenkv: paged attention for LLM serving whose decode time follows the KV bytes read.

Public API:
    Attention        decode rows + extend rows of one batch: plan once per batch, run per layer
                     (what the SGLang and vLLM adapters drive; CUDA-graph capturable)
    DecodeAttention  decode only: plan once per batch, run per layer
    decode           one-shot functional decode for scripts
    extend           one-shot prefill / extend attention over the paged prefix (q_len >= 1, causal)
    write_kv         scatter new K/V into the paged cache
    check_errors     raise if a kernel saw bad batch data (out-of-range pages, slots, lengths)
"""

from .attention import Attention, AttentionPlan
from .configs import DecodeConfig, ExtendConfig, decode_config, extend_config, resolve_arch
from .decode_attention import POLICIES, DecodeAttention, DecodePlan, decode
from .errors import EvenKVError, check_errors
from .extend_attention import extend
from .kv_cache import write_kv
from .planning import StreamSchedule, UnitSchedule

__version__ = "0.2.0"

__all__ = ["Attention", "AttentionPlan", "DecodeAttention", "DecodePlan", "decode", "extend", "write_kv",
           "check_errors", "EvenKVError",
           "DecodeConfig", "ExtendConfig", "decode_config", "extend_config", "resolve_arch", "StreamSchedule",
           "UnitSchedule", "POLICIES"]
