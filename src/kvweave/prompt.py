"""How a prompt reaches the cache: the token ids of every forward pass, the tokenizer, the chat template.

Content-aware methods (DepthWeave's router and ``protect``) read the prompt's token ids and what the tokenizer
says each id is. Every path a user takes must give them the same: ``kvweave.generate``, ``make_cache`` +
``model.generate``, the prefix pattern, a loaded cache. So nobody has to hand them over:

- :func:`install_hook` (called by :func:`kvweave.prepare`) puts a forward pre-hook on the model's decoder.
  Each forward pass hands its ``input_ids`` to the kvweave cache it was given (``KVCache.observe_input_ids``),
  which appends them at the positions they fill. A pass with ``inputs_embeds`` only has no ids: the method
  warns once.
- The tokenizer is the one :func:`kvweave.load_model` returned (:func:`remember_tokenizer`), the one given to
  ``make_cache(..., tokenizer=)``, or else the one saved beside a local model folder (:func:`tokenizer_for`).

``cache.set_prompt(ids, tokenizer)`` stays as an override: ids given there are kept, and the hook only appends
what comes after them.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch

_HOOK_ATTR = "_kvweave_input_ids_hook"
_tokenizers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def remember_tokenizer(model: Any, tokenizer: Any) -> None:
    """Record ``tokenizer`` as ``model``'s (what :func:`tokenizer_for` returns), as long as the model lives."""
    _tokenizers[model] = tokenizer


def tokenizer_for(model: Any) -> Any:
    """``model``'s tokenizer: the one :func:`remember_tokenizer` recorded, else the one in the local folder the
    model was loaded from (read once), else ``None``."""
    if model in _tokenizers:
        return _tokenizers[model]
    tokenizer = None
    folder = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if folder and os.path.isdir(folder) and _has_tokenizer_files(folder):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError):  # an unreadable tokenizer is the same as none: the method warns
            tokenizer = None
    _tokenizers[model] = tokenizer
    return tokenizer


def _has_tokenizer_files(folder: str) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    return any(os.path.exists(os.path.join(folder, name)) for name in names)


def install_hook(model: Any) -> None:
    """Hand every forward pass's ``input_ids`` to the kvweave cache it runs with (idempotent)."""
    if getattr(model, _HOOK_ATTR, None) is not None:
        return
    decoder = getattr(model, "base_model", None) or model
    handle = decoder.register_forward_pre_hook(_observe_inputs, with_kwargs=True)
    setattr(model, _HOOK_ATTR, handle)


def remove_hook(model: Any) -> None:
    """Undo :func:`install_hook`."""
    handle = getattr(model, _HOOK_ATTR, None)
    if handle is not None:
        handle.remove()
        delattr(model, _HOOK_ATTR)


def _observe_inputs(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    cache = kwargs.get("cache")
    if cache is None:
        cache = kwargs.get("past_key_values")
    observe = getattr(cache, "observe_input_ids", None)
    if observe is None:
        return
    ids = kwargs.get("input_ids")
    if ids is None and args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
        ids = args[0]
    observe(ids)
    before = getattr(cache, "before_forward", None)
    if before is not None:
        before(module)


def chat_text(tokenizer: Any, content: str) -> str | None:
    """``content`` as one user turn of the tokenizer's chat template, ready for the answer; ``None`` when the
    tokenizer has no template. The one place kvweave applies a chat template (``generate``, ``eval``, CLI)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    text: str = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    return text


def chat_ids(tokenizer: Any, prompt: str, chat: bool = True) -> torch.Tensor:
    """``[1, N]`` token ids of ``prompt``: as one user turn of the chat template when the tokenizer has one
    (and ``chat``), else the plain text with the tokenizer's special tokens."""
    text = chat_text(tokenizer, prompt) if chat else None
    if text is not None:
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    return tokenizer(prompt, return_tensors="pt").input_ids
