"""``keyformer``: key tokens by a Gumbel-regularised score (Adnan et al., MLSys 2024, arXiv:2403.09054).

Like H2O, each KV head accumulates a score per entry and keeps the top "key tokens" plus a recent window,
evicting one entry per new token once over budget. The score is not the attention itself but a Gumbel
softmax of the logits, ``softmax((logits + g) / tau)`` with ``g ~ Gumbel(0, 1)``, which the paper argues
compensates for the logits that evicted tokens no longer contribute. ``tau`` rises linearly from
``tau_init`` (prompt) to ``tau_end`` over ``steps`` generated tokens (the authors' code: 1.0 + 0.01 per
step). Defaults follow the authors' code: 30 % of the budget is the recent window.

The noise comes from a counter-based hash of (``seed``, layer, query head, query token, key token) rather
than a stateful generator: reruns are reproducible and a padded batch row draws exactly the noise of its
single-row run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvweave.methods._eviction import CHUNK_ELEMENTS, EvictingLayer, check_budget, gumbel_noise
from kvweave.ops.storage import STORAGE_CHOICES, STORAGE_HELP
from kvweave.registry import Method, option, register

if TYPE_CHECKING:
    from kvweave.cache import KVCache


@register("keyformer")
@dataclasses.dataclass
class Keyformer(Method):
    """Key tokens by accumulated Gumbel-softmax score + recent window, per KV head."""

    budget: int = option(1024, "entries kept per KV head (ignored when ratio is set)")
    ratio: float | None = option(None, "fraction of each row's prompt tokens kept (overrides budget)")
    recent: float = option(0.3, "fraction of the budget reserved for the most recent tokens")
    tau_init: float = option(1.0, "Gumbel softmax temperature at the prompt")
    tau_end: float = option(2.0, "temperature reached after `steps` generated tokens")
    steps: int = option(100, "generated tokens over which the temperature rises")
    seed: int = option(0, "seed of the Gumbel noise")
    storage: str = option("auto", STORAGE_HELP)

    evicts = True
    bounded_memory = True
    budget_options = {"ratio": "held fraction", "budget": "held tokens"}
    test_options = {"ratio": 0.4}
    invalid_options = (
        ({"budget": 0}, "budget"),
        ({"ratio": 1.5}, "ratio"),
        ({"recent": -0.1}, "recent"),
        ({"tau_init": 0.0}, "tau_init"),
        ({"tau_end": 0.0}, "tau_end"),
        ({"steps": 0}, "steps"),
        ({"seed": -1}, "seed"),
    )

    def __post_init__(self) -> None:
        check_budget(self)
        self.check_choice("storage", STORAGE_CHOICES)
        self.check_range("recent", 0.0, 1.0)
        self.check_range("tau_init", 1e-3)
        self.check_range("tau_end", 1e-3)
        self.check_range("steps", 1)
        self.check_range("seed", 0)

    def make_layer(self, cache: KVCache, layer_idx: int) -> KeyformerLayer:
        return KeyformerLayer(cache, layer_idx)


class KeyformerLayer(EvictingLayer):
    """Exact entries with their accumulated Gumbel-softmax ``scores: [B, H, T]`` (float32)."""

    state_fields = EvictingLayer.state_fields + ("prompt_tokens", "scores")
    batch_fields = EvictingLayer.batch_fields + ("prompt_tokens", "scores")

    entry_state = ("scores",)

    def __init__(self, cache: KVCache, layer_idx: int) -> None:
        super().__init__(cache, layer_idx)
        self.scores: torch.Tensor | None = None
        self.prompt_tokens = torch.zeros(0, dtype=torch.int64)  # [B] real prompt tokens (set at prefill)

    def after_attention(self, query: torch.Tensor, attention_mask: torch.Tensor | None, first: int) -> None:
        q_len = query.shape[2]
        if first == 0:
            self.set_budget()
            self.prompt_tokens = (~self.pad_entries()[:, 0]).sum(-1)
        if first == 0 or self.scores is None:
            self.scores = torch.zeros(self.rows, self.keys.shape[1], 0, device=self.device)
        new = torch.zeros(self.rows, self.keys.shape[1], q_len, device=self.device)
        # the noise hash works on int64 tensors the size of the logits: smaller chunks
        received = self.attention_received(
            query, attention_mask, first, self.gumbel_hook(first), elements=CHUNK_ELEMENTS // 8
        )
        self.scores = torch.cat([self.scores, new], dim=2) + received
        self.evict(self.scores, protected=self.recent(self.method.recent))

    def gumbel_hook(self, first: int) -> Callable[[torch.Tensor, int, int], torch.Tensor]:
        """The logits hook: ``(logits + g) / tau`` for the query rows ``first + start ..``."""
        method = self.method
        pad_count = self.pad_count if self.pad_count is not None else torch.zeros_like(self.prompt_tokens)
        pads = pad_count.view(-1, 1, 1, 1, 1)
        key_index = (self.held_slots().to(torch.int64).unsqueeze(2).unsqueeze(3) - pads).clamp(min=0)

        def hook(logits: torch.Tensor, start: int, rows: int) -> torch.Tensor:
            b, h, g = logits.shape[:3]
            query_index = torch.arange(first + start, first + start + rows, device=self.device)
            query_index = (query_index.view(1, 1, 1, -1, 1) - pads).clamp(min=0)  # [B, 1, 1, rows, 1]
            # the global query head: under tensor parallelism rank r draws the noise one process draws for its heads
            first_head = getattr(self.cache, "kv_head_offset", 0) * g
            head = torch.arange(first_head, first_head + h * g, device=self.device).view(1, h, g, 1, 1)
            noise = gumbel_noise(
                method.seed, self.layer_idx, head, query_index, key_index[..., : logits.shape[-1]]
            )
            # decode step of each query: 0 for prompt tokens, 1 for the first generated token, ...
            step = (query_index - self.prompt_tokens.view(-1, 1, 1, 1, 1) + 1).clamp(min=0)
            progress = (step.float() / method.steps).clamp(max=1.0)
            tau = method.tau_init + (method.tau_end - method.tau_init) * progress
            return (logits + noise) / tau

        return hook
