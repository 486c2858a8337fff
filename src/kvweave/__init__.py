"""kvweave: KV-cache compression for long-context inference with Hugging Face transformers.

model, tokenizer = kvweave.load_model("qwen2.5-coder-0.5b")
result = kvweave.generate(model, tokenizer, "...", "window:ratio=0.125")  # text, cache, token counts
cache = kvweave.make_cache("quant:bits=4", model)   # or drive model.generate yourself:
model.generate(ids, **{kvweave.cache_kwarg(model): cache})
cache.nbytes(), cache.stats()
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = [
    "METHODS",
    "CacheFileError",
    "EntropyTemperatureProcessor",
    "Generated",
    "KVCache",
    "Method",
    "cache_kwarg",
    "generate",
    "load_cache",
    "load_model",
    "make_cache",
    "parse_method",
    "prepare",
    "register",
    "restore",
    "save_cache",
]

_LAZY = {
    "METHODS": "kvweave.registry",
    "KVCache": "kvweave.cache",
    "Method": "kvweave.registry",
    "make_cache": "kvweave.cache",
    "parse_method": "kvweave.registry",
    "register": "kvweave.registry",
    "prepare": "kvweave.attention",
    "restore": "kvweave.attention",
    "load_model": "kvweave.models",
    "EntropyTemperatureProcessor": "kvweave.sampling",
    "save_cache": "kvweave.persist",
    "load_cache": "kvweave.persist",
    "CacheFileError": "kvweave.persist",
    "generate": "kvweave.generation",
    "Generated": "kvweave.generation",
    "cache_kwarg": "kvweave._compat",
}


def __getattr__(name: str) -> Any:
    """Import public names lazily, so ``import kvweave`` stays cheap and side-effect free."""
    if name in _LAZY:
        import importlib

        module = importlib.import_module(_LAZY[name])
        if name == "METHODS":
            importlib.import_module("kvweave.methods")
        return getattr(module, name)
    raise AttributeError(f"module 'kvweave' has no attribute {name!r}")
