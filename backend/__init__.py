"""evenkv: decode attention whose time follows the KV bytes read.

Public API:
    DecodeAttention  plan once per batch, run once per layer (CUDA-graph capturable)
    decode           one-shot functional decode for scripts
    write_kv         scatter new K/V into the paged cache
    extend           prefill / extend attention over the paged prefix (q_len >= 1, causal)
    MixedAttention   decode rows and extend rows of one batch, one plan
"""

from .arch import DecodeConfig, decode_config, resolve_arch
from .decode import POLICIES, DecodeAttention, decode, write_kv
from .extend import extend
from .mixed import MixedAttention
from .schedule import DecodePlan, StreamSchedule, UnitSchedule

__version__ = "0.1.0"

__all__ = ["DecodeAttention", "decode", "write_kv", "extend", "MixedAttention", "DecodeConfig", "decode_config", "resolve_arch",
           "DecodePlan", "StreamSchedule", "UnitSchedule", "POLICIES"]
