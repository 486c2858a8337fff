"""Entropy temperature control (seed ``000`` §四.3, DK-Cache's decode-side companion), as a ``LogitsProcessor``.

The seed measures next-token entropy rising with context length (1.27 nats at 8K to 2.41 at 128K) and lowers
the sampling temperature when the entropy is high: ``T_new = T_base − β·(H(p) − H_th)`` for ``H > H_th``
(``H_th = 1.6``), clamped to ``[T_min, T_base]``. Its code uses a step instead (``T = 0.85`` above the
threshold, else ``1.0``); ``mode="step"`` reproduces that. Entropy is per batch row, in nats, of the scores
this processor receives. The default ``β = 0.2`` puts the seed's 128K entropy (2.41) at ``T ≈ 0.84``, next
to the step rule's 0.85.

    processor = EntropyTemperatureProcessor()
    model.generate(..., do_sample=True, logits_processor=[processor])   # leave generate's temperature at 1
    processor.trace   # [{"step": 0, "entropy": [...], "temperature": [...]}, ...] per batch row
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessor

SEED_THRESHOLD = 1.6  # H_th, nats (seed §四.3)
SEED_STEP_TEMPERATURE = 0.85  # the seed code's temperature above the threshold


def entropy(scores: torch.Tensor) -> torch.Tensor:
    """``[B]`` entropy in nats of ``softmax(scores: [B, V])`` (``-inf`` scores count as probability 0)."""
    log_probs = torch.log_softmax(scores.float(), dim=-1)
    probs = log_probs.exp()
    return -torch.where(probs > 0, probs * log_probs, torch.zeros_like(probs)).sum(-1)


class EntropyTemperatureProcessor(LogitsProcessor):
    """Divide the scores by a temperature that falls when the next-token entropy is above a threshold."""

    def __init__(
        self,
        base_temperature: float = 1.0,
        beta: float = 0.2,
        threshold: float = SEED_THRESHOLD,
        min_temperature: float = 0.5,
        mode: str = "linear",
        step_temperature: float = SEED_STEP_TEMPERATURE,
    ) -> None:
        if not base_temperature > 0:
            raise ValueError(f"base_temperature={base_temperature!r} is out of range; allowed (0, inf)")
        if not 0 < min_temperature <= base_temperature:
            raise ValueError(
                f"min_temperature={min_temperature!r} is out of range; allowed "
                f"(0, base_temperature={base_temperature}]"
            )
        if not beta >= 0:
            raise ValueError(f"beta={beta!r} is out of range; allowed [0, inf)")
        if not threshold >= 0:
            raise ValueError(f"threshold={threshold!r} is out of range; allowed [0, inf) nats")
        if mode not in ("linear", "step"):
            raise ValueError(f"mode={mode!r} is not allowed; choose one of ['linear', 'step']")
        if not step_temperature > 0:
            raise ValueError(f"step_temperature={step_temperature!r} is out of range; allowed (0, inf)")
        self.base_temperature = base_temperature
        self.beta = beta
        self.threshold = threshold
        self.min_temperature = min_temperature
        self.mode = mode
        self.step_temperature = step_temperature
        self._entropies: list[torch.Tensor] = []
        self._temperatures: list[torch.Tensor] = []

    def temperature(self, entropies: torch.Tensor) -> torch.Tensor:
        """``[B]`` temperature for ``[B]`` entropies (nats)."""
        high = entropies > self.threshold
        if self.mode == "step":
            return torch.where(high, self.step_temperature, self.base_temperature).to(torch.float32)
        lowered = self.base_temperature - self.beta * (entropies - self.threshold)
        lowered = lowered.clamp(self.min_temperature, self.base_temperature)
        return torch.where(high, lowered, torch.full_like(lowered, self.base_temperature))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        """``scores: [B, V]`` -> ``scores / T`` per row; records the entropy and temperature of this step."""
        entropies = entropy(scores)
        temperatures = self.temperature(entropies)
        self._entropies.append(entropies.detach())
        self._temperatures.append(temperatures.detach())
        return scores / temperatures.to(scores.dtype).unsqueeze(-1)

    @property
    def trace(self) -> list[dict[str, Any]]:
        """Per step: ``{"step", "entropy": [per row], "temperature": [per row]}`` (JSON-able)."""
        return [
            {"step": i, "entropy": h.tolist(), "temperature": t.tolist()}
            for i, (h, t) in enumerate(zip(self._entropies, self._temperatures, strict=True))
        ]

    def reset(self) -> None:
        """Forget the trace (reuse the processor for another generation)."""
        self._entropies, self._temperatures = [], []
