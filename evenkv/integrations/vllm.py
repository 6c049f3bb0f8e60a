"""vLLM plugin: ``--attention-backend CUSTOM`` (or ``LLM(..., attention_backend="CUSTOM")``).

vLLM loads the entry point ``vllm.general_plugins`` -> ``evenkv.integrations.vllm:register``
in every one of its processes (the CLI and API server, the engine core, each worker), so
``register`` is cheap and idempotent: it stores the class path of the backend under vLLM's
``CUSTOM`` slot and imports nothing else. vLLM imports the class only when the operator
selects ``CUSTOM``; the class then validates the configuration and, in the workers, builds
the evenkv kernels (``evenkv.integrations.vllm_backend``).

``CUSTOM`` rather than a name of our own: ``get_name()`` must return an
``AttentionBackendEnum`` member, and members that vLLM 0.33 creates at run time for new
names do not unpickle in a process that has not loaded the plugin yet.

Knobs: ``EVENKV_POLICY`` = ``balanced`` (default) | ``fa3`` | ``none`` picks the decode
schedule (``evenkv.DecodeAttention``'s ``policy``); ``EVENKV_DEBUG=1`` validates lengths
and page ids on the host before each launch (syncs; for debugging only);
``EVENKV_DETERMINISTIC=1`` makes decode batch invariant (``DecodeAttention(deterministic=True)``).

Tested with vLLM 0.26.0 and 0.33.0.
"""

from __future__ import annotations

import logging

BACKEND_CLASS_PATH = "evenkv.integrations.vllm_backend.EvenKVBackend"
_EXPORTS = ("EvenKVBackend", "EvenKVImpl", "EvenKVMetadata", "EvenKVMetadataBuilder")

logger = logging.getLogger(__name__)


def register() -> None:
    """Make ``CUSTOM`` resolve to evenkv in this process (idempotent).

    Touches only vLLM's backend registry: the backend module (and with it vLLM's attention
    interfaces, torch and triton kernels) is imported when the backend is selected.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    try:
        current = AttentionBackendEnum.CUSTOM.get_path()
    except ValueError:  # CUSTOM not registered yet: the usual case
        current = None
    if current == BACKEND_CLASS_PATH:
        return
    if current is not None:
        # Plugins load in entry-point order, so the last one wins; say so instead of
        # letting the operator find out from the kernels that run.
        logger.warning("evenkv: vLLM's CUSTOM attention backend was registered to %s; "
                       "re-registering it to %s", current, BACKEND_CLASS_PATH)
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_CLASS_PATH)


def __getattr__(name: str):
    # ``from evenkv.integrations.vllm import EvenKVBackend`` works, yet importing this
    # module (what the entry point does) stays free of vLLM's attention interfaces.
    if name in _EXPORTS:
        from evenkv.integrations import vllm_backend

        return getattr(vllm_backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["register", "BACKEND_CLASS_PATH", *_EXPORTS]
