"""``kvweave.generate``: one call from a prompt to the generated text, through a compressed cache.

It does what ``kvweave generate`` on the command line does: the chat template when the tokenizer has one,
greedy decoding by default, the cache passed under the keyword this transformers version expects (no
deprecation warning on any supported version), and the text of the new tokens only::

    model, tokenizer = kvweave.load_model("qwen2.5-coder-0.5b")
    result = kvweave.generate(model, tokenizer, "…a long document… What is the pass key?", "depthweave")
    print(result.text, result.cache.nbytes())
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvweave._compat import cache_kwarg
from kvweave.cache import KVCache, make_cache
from kvweave.prompt import chat_ids


@dataclasses.dataclass
class Generated:
    """What :func:`generate` returns: the text of the new tokens, the cache that held the prompt and them,
    and the token counts."""

    text: str
    cache: KVCache
    prompt_tokens: int
    new_tokens: int


def generate(
    model: Any,
    tokenizer: Any,
    prompt: str,
    method: str = "full",
    max_new_tokens: int = 32,
    chat: bool = True,
    **generate_kwargs: Any,
) -> Generated:
    """Generate from ``prompt`` with a ``method`` cache (any spec, e.g. ``"window:ratio=0.125"``).

    Greedy unless ``generate_kwargs`` say otherwise (they go to ``model.generate``); ``chat=False`` skips the
    chat template. Raises ``ValueError`` for an empty prompt or a bad method spec (before any work)."""
    if not prompt:
        raise ValueError("kvweave.generate: the prompt is empty; pass the text to continue or answer")
    if max_new_tokens < 1:
        raise ValueError(f"kvweave.generate: max_new_tokens={max_new_tokens} must be at least 1")
    cache = make_cache(method, model, tokenizer=tokenizer)
    ids = chat_ids(tokenizer, prompt, chat).to(model.device)
    options = {"do_sample": False, "max_new_tokens": max_new_tokens, **generate_kwargs}
    if not options.get("do_sample"):  # greedy: no sampling knobs (transformers warns about unused ones)
        options.update(temperature=None, top_p=None, top_k=None)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            **{cache_kwarg(model): cache},
            **options,
        )
    new = out[0, ids.shape[1] :]
    return Generated(tokenizer.decode(new, skip_special_tokens=True), cache, ids.shape[1], len(new))
