"""EntropyTemperatureProcessor: the seed's linear rule, its clamps, the step rule, the trace, validation."""

from __future__ import annotations

import math

import pytest
import torch

from kvweave.sampling import EntropyTemperatureProcessor, entropy


def _scores_with_entropy(target: float, vocab: int = 64) -> torch.Tensor:
    """``[1, vocab]`` scores whose softmax has entropy ``target`` nats (bisection on a temperature)."""
    base = -torch.arange(vocab, dtype=torch.float32)
    low, high = 1e-3, 1e3
    for _ in range(100):
        mid = math.sqrt(low * high)
        if entropy((base / mid).view(1, -1)).item() < target:
            low = mid
        else:
            high = mid
    return (base / math.sqrt(low * high)).view(1, -1)


def test_entropy_in_nats_and_ignores_masked_tokens():
    uniform = torch.zeros(2, 8)
    torch.testing.assert_close(entropy(uniform), torch.full((2,), math.log(8)))
    masked = torch.tensor([[0.0, 0.0, float("-inf"), float("-inf")]])
    torch.testing.assert_close(entropy(masked), torch.tensor([math.log(2)]))


def test_linear_rule_above_threshold():
    processor = EntropyTemperatureProcessor(
        base_temperature=1.0, beta=0.2, threshold=1.6, min_temperature=0.5
    )
    scores = _scores_with_entropy(2.41)  # the seed's 128K entropy
    out = processor(torch.zeros(1, 3, dtype=torch.long), scores)
    temperature = 1.0 - 0.2 * (2.41 - 1.6)
    assert processor.trace[0]["temperature"][0] == pytest.approx(temperature, abs=1e-4)
    torch.testing.assert_close(out, scores / processor.trace[0]["temperature"][0])


def test_below_threshold_keeps_base_and_clamps_apply():
    processor = EntropyTemperatureProcessor(
        base_temperature=0.9, beta=2.0, threshold=1.6, min_temperature=0.4
    )
    low, high = _scores_with_entropy(1.0), _scores_with_entropy(3.5)
    processor(None, torch.cat([low, high]))
    step = processor.trace[0]
    assert step["temperature"] == pytest.approx([0.9, 0.4])  # base below H_th; 0.9 - 2*(3.5-1.6) < T_min
    assert step["entropy"] == pytest.approx([1.0, 3.5], abs=1e-3)
    assert EntropyTemperatureProcessor(beta=0.0).temperature(torch.tensor([5.0])).item() == 1.0


def test_step_mode_is_the_seed_rule():
    processor = EntropyTemperatureProcessor(mode="step")
    processor(None, torch.cat([_scores_with_entropy(1.2), _scores_with_entropy(2.0)]))
    assert processor.trace[0]["temperature"] == pytest.approx([1.0, 0.85])


def test_trace_per_step_and_row_then_reset():
    processor = EntropyTemperatureProcessor()
    for _ in range(3):
        processor(None, torch.randn(2, 32))
    trace = processor.trace
    assert [step["step"] for step in trace] == [0, 1, 2]
    assert all(len(step["entropy"]) == 2 and len(step["temperature"]) == 2 for step in trace)
    processor.reset()
    assert processor.trace == []


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"base_temperature": 0.0}, "base_temperature"),
        ({"min_temperature": 1.5}, "min_temperature"),
        ({"min_temperature": 0.0}, "min_temperature"),
        ({"beta": -0.1}, "beta"),
        ({"threshold": -1.0}, "threshold"),
        ({"mode": "cosine"}, "mode"),
        ({"step_temperature": 0.0}, "step_temperature"),
    ],
)
def test_invalid_settings_rejected(kwargs, name):
    with pytest.raises(ValueError, match=name):
        EntropyTemperatureProcessor(**kwargs)


def test_works_inside_generate():
    from conftest import tiny_model

    model = tiny_model("llama")
    processor = EntropyTemperatureProcessor()
    ids = torch.randint(3, 150, (2, 10))
    torch.manual_seed(0)
    out = model.generate(
        ids, do_sample=True, max_new_tokens=4, min_new_tokens=4, logits_processor=[processor]
    )
    assert out.shape == (2, 14) and len(processor.trace) == 4
