"""Attention-output probes: how far attention over a chunk as stored is from attention over it exact."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvweave.ops.attention import masked_softmax

if TYPE_CHECKING:
    from kvweave.methods.depthweave.chunk import Chunk


class Probe:
    """Attention-output probe of one chunk: queries of every group layer attend over the chunk's tokens.

    ``error(keys, values, keep)`` is the mean over layers of ``‖O − Ô‖ / ‖O‖``, ``O`` being attention over the
    exact chunk and ``Ô`` over the given (stored) keys and values with evicted tokens left out.
    """

    def __init__(
        self, queries: list[torch.Tensor], query_slots: torch.Tensor, chunk: Chunk, scalings: list[float]
    ) -> None:
        h = chunk.keys[0].shape[0]
        self.packed = [q.reshape(h, -1, q.shape[-1]) for q in queries]  # [H, g·p, D]
        g = queries[0].shape[0] // h
        causal = chunk.slots.view(1, -1) <= query_slots.view(-1, 1)  # [p, n]
        self.causal = causal.repeat(g, 1)
        self.scalings = scalings
        self.tp = chunk.tp
        self.exact = [
            self.attend(i, k.float(), v.float(), None)
            for i, (k, v) in enumerate(zip(chunk.keys, chunk.values, strict=True))
        ]

    def attend(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor | None
    ) -> torch.Tensor:
        return self.weights(layer, keys, keep) @ values

    def weights(self, layer: int, keys: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """``[H, g·p, n]`` attention weights of the probe queries over ``keys`` (tokens not in ``keep`` unseen)."""
        visible = self.causal if keep is None else self._visible(keep)
        logits = self.packed[layer] @ keys.transpose(-1, -2) * self.scalings[layer]
        return masked_softmax(logits, visible)

    def _visible(self, keep: torch.Tensor) -> torch.Tensor:
        """``causal & keep``, computed once per ``keep`` (every layer and every probed rank share it)."""
        if getattr(self, "_visible_keep", None) is not keep:
            self._visible_keep = keep
            self._visible_mask = self.causal & keep.view(1, -1)
        return self._visible_mask

    def exact_key_weights(self, keys: list[torch.Tensor], keep: torch.Tensor) -> list[torch.Tensor]:
        """The weights over the exact keys for ``keep``, computed once: probing value ranks changes only the
        values, so every value-rank probe of a chunk reuses them."""
        if getattr(self, "_weights_keep", None) is not keep:
            self._weights_keep = keep
            self._weights = [self.weights(i, k, keep) for i, k in enumerate(keys)]
        return self._weights

    def error(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        keep: torch.Tensor,
        exact_keys: bool = False,
    ) -> float:
        """Mean relative output error; ``exact_keys``: ``keys`` are the chunk's exact keys (a value-rank probe),
        so their weights are computed once per ``keep`` and reused."""
        if self.tp is not None:
            return self.error_over_ranks(keys, values, keep)
        errors = []
        weights = self.exact_key_weights(keys, keep) if exact_keys else None
        for i, exact in enumerate(self.exact):
            approx = (
                (weights[i] @ values[i]) if weights is not None else self.attend(i, keys[i], values[i], keep)
            )
            errors.append(((approx - exact).norm() / exact.norm().clamp_min(1e-12)).item())
        return sum(errors) / len(errors)

    def error_over_ranks(
        self, keys: list[torch.Tensor], values: list[torch.Tensor], keep: torch.Tensor
    ) -> float:
        """:meth:`error` under tensor parallelism, all-reduced: each rank holds some of the heads, so the squared
        norms of ``O − Ô`` and ``O`` are summed over the ranks and every rank gets the error over all heads (and
        chooses the same ranks, and refreshes at the same folds)."""
        squares = []
        for i, exact in enumerate(self.exact):
            approx = self.attend(i, keys[i], values[i], keep)
            error, norm = (approx - exact).double().square().sum(), exact.double().square().sum()
            squares.append(torch.stack([error, norm]))
        total = self.tp.all_reduce(torch.stack(squares))  # type: ignore[union-attr]  # [layers, 2]
        return float((total[:, 0].sqrt() / total[:, 1].sqrt().clamp_min(1e-12)).mean())
