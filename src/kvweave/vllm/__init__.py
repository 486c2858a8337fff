"""kvweave inside vLLM: attention backends over vLLM's paged KV cache (docs/vllm.md).

A vLLM general plugin (entry point ``vllm.general_plugins: kvweave = kvweave.vllm:register``, installed by the
``kvweave[vllm]`` extra). Nothing in the core package imports this one, and importing it does not import vLLM:
only :func:`register` (called by vLLM in each of its processes) and :mod:`kvweave.vllm.backend` do.

The method is chosen by the environment variable ``KVWEAVE_VLLM_METHOD`` (inherited by vLLM's worker
processes), e.g. ``quant:bits=4``, ``depthweave`` or ``pages:top_blocks=8`` (:mod:`kvweave.vllm.config`). When it is set,
:func:`register` points vLLM's ``CPU_ATTN`` backend at the kvweave backend — vLLM's CPU platform always picks
``CPU_ATTN`` and ignores ``--attention-backend`` — and always registers it as ``CUSTOM`` too (for platforms
that honour ``--attention-backend CUSTOM``). Unset: vLLM runs unchanged.
"""

from __future__ import annotations

import os

from kvweave.vllm.config import ENV_METHOD, VllmMethod

BACKEND_PATH = "kvweave.vllm.backend.KvweaveAttentionBackend"

__all__ = ["BACKEND_PATH", "ENV_METHOD", "VllmMethod", "register"]


def register() -> None:
    """vLLM plugin entry point: register the kvweave backend (idempotent; vLLM calls it once per process)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    spec = os.environ.get(ENV_METHOD, "").strip()
    if spec:
        VllmMethod.parse(spec)  # a bad spec fails here, in the front-end process, with its one-line message
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
