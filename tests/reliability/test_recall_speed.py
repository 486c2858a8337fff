"""benchmarks/recall_speed.py: its summaries (ratios to the reference taken round by round) and its refusals."""

from __future__ import annotations

import pytest
from test_soak_copy import script


def test_summaries_take_each_ratio_within_its_round() -> None:
    speed = script("recall_speed")
    rows = []
    for round_, (full_ms, dw_ms) in enumerate([(100.0, 50.0), (300.0, 200.0), (120.0, 100.0)]):
        for method, ms, rebuilt in (("full", full_ms, 0), ("depthweave:recall=8", dw_ms, 2)):
            for phase in speed.PHASES:
                rows.append(
                    {"kind": "round", "round": round_, "method": method, "phase": phase, "ms_mean": ms,
                     "rebuilds": rebuilt if phase == "copy" else 0, "loss": 1.0 + round_,
                     "ms_question": 10.0 * (round_ + 1) if phase == "quote" else None}
                )  # fmt: skip
    summaries = {(s["method"], s["phase"]): s for s in speed.summaries(rows, "full")}
    copy = summaries[("depthweave:recall=8", "copy")]
    assert copy["speedup"] == pytest.approx(1.5)  # median of 2.0, 1.5 and 1.2: not 173.3 / 116.7
    assert copy["ms_mean"] == 100.0 and copy["rebuilds"] == 6 and copy["rounds"] == 3
    assert copy["loss"] == pytest.approx(2.0)
    assert summaries[("depthweave:recall=8", "other")]["rebuilds"] == 0
    assert summaries[("full", "next")]["speedup"] == 1.0
    assert summaries[("full", "quote")]["ms_question"] == 20.0  # the question's step: its median, timed apart
    assert summaries[("full", "next")]["ms_question"] is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--context", "2048", "--steps", "64", "--rounds", "20"], "too short"),
        (["--methods", "full,nosuch"], "nosuch"),
        (["--steps", "0"], "must be positive"),
    ],
)
def test_bad_arguments_are_refused_before_the_model_loads(argv, message, tmp_path, capsys) -> None:
    speed = script("recall_speed")
    with pytest.raises(SystemExit) as exit_:
        speed.main([*argv, "--out", str(tmp_path / "rows.jsonl")])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
