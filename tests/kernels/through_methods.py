"""Driving a kernel through its method: ``make_cache`` + ``model.generate`` once per ``kernel=`` backend."""

from __future__ import annotations

import torch

import kvweave
from conftest import tiny_model
from kvweave._compat import cache_kwarg


def generate_per_backend(
    spec: str, device: str, tokens: int, new_tokens: int, padded_row: int, pad: int, seed: int
) -> tuple[dict[str, torch.Tensor], dict[str, kvweave.KVCache]]:
    """Greedy tokens and caches of ``spec.format(backend)`` for ``torch`` and ``triton`` on a tiny Llama, batch
    2, row ``padded_row`` left-padded by ``pad`` tokens."""
    model = tiny_model("llama").to(device)
    torch.manual_seed(seed)
    ids = torch.randint(3, 150, (2, tokens), device=device)
    mask = torch.ones_like(ids)
    mask[padded_row, :pad] = 0
    outputs, caches = {}, {}
    for backend in ("torch", "triton"):
        cache = kvweave.make_cache(spec.format(backend), model)
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                **{cache_kwarg(model): cache},
            )
        outputs[backend], caches[backend] = out[:, tokens:], cache
    return outputs, caches
