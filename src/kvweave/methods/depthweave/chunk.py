"""What one fold hands the factorization: a :class:`Chunk` of tokens and the :class:`Plan` of their kinds."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvweave.distributed import TensorParallel

HI, MID, LO, EVICTED, EXACT = 0, 1, 2, 3, 4  # token kinds in a plan


@dataclasses.dataclass
class Chunk:
    """Tokens of one batch row being folded into the factorization (padding already removed)."""

    slots: torch.Tensor  # [n] token indices
    positions: torch.Tensor  # [n] RoPE positions
    x_k: torch.Tensor  # [n, G·H·D] float32 keys in factorization form (pre- or post-RoPE)
    x_v: torch.Tensor  # [n, G·H·D] float32 values
    keys: list[torch.Tensor]  # per layer [H, n, D] exact post-RoPE keys (storage dtype)
    values: list[torch.Tensor]  # per layer [H, n, D]
    attention: torch.Tensor  # [n] attention received (router signal)
    content: torch.Tensor | None  # [n] token-content signal, when token ids were given
    sink: torch.Tensor | None  # [n] bool, attention sinks (prefill only)
    # [n] how much each token looks like a value users retrieve (router.retrievable_scores; prefill, protect > 0)
    retrievable: torch.Tensor | None = None
    # tensor parallelism: the ranks holding the group's other heads, over which the probe errors and the router's
    # novelty are all-reduced (kvweave.distributed); None in one process
    tp: TensorParallel | None = None

    @property
    def size(self) -> int:
        return int(self.slots.numel())


@dataclasses.dataclass
class Plan:
    """Kind of each chunk token (:data:`HI`, :data:`MID`, :data:`LO`, :data:`EVICTED`, :data:`EXACT`)."""

    kind: torch.Tensor  # [n] int64

    def index(self, *kinds: int) -> torch.Tensor:
        return torch.isin(self.kind, torch.tensor(kinds, device=self.kind.device)).nonzero().squeeze(1)

    def counts(self) -> dict[str, int]:
        names = {HI: "hi", MID: "mid", LO: "lo", EVICTED: "evicted", EXACT: "exact"}
        return {name: int((self.kind == k).sum()) for k, name in names.items()}
