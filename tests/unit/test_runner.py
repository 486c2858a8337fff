"""The eval runner without a model: resume semantics, summaries, prompt split, config validation.

``run_trial`` and ``make_sample`` are replaced by stubs, so these tests take milliseconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvweave.eval import runner
from kvweave.eval import tasks as task_lib

MODEL_AND_TOKENIZER = (object(), object())  # never touched by the stubs


def small_config(**overrides: Any) -> runner.EvalConfig:
    fields: dict[str, Any] = dict(
        model="stub",
        tasks=["passkey", "niah_single"],
        contexts=[128, 256],
        methods=["full", "window:ratio=0.25"],
        trials=2,
    )
    return runner.EvalConfig(**{**fields, **overrides})


def stub_sample(
    task: str, tokenizer: Any, context: int, depth: float, seed: int, **kw: Any
) -> task_lib.Sample:
    return task_lib.Sample(task, "doc " * 4, "q?", ["42"], depth, seed, context)


def stub_row(config: runner.EvalConfig, trial: runner.Trial) -> dict[str, Any]:
    held = 100 if trial.method == "full" else 25
    return {
        "model": config.model,
        "method": trial.method,
        "task": trial.task,
        "context": trial.context,
        "trial": trial.trial,
        "depth": trial.depth,
        "seed": trial.seed,
        "score": 1.0,
        "kv_bytes": held,
        "full_kv_bytes": 100,
        "compression": 100 / held,
        "prefill_s": 0.1,
        "decode_tok_s": 10.0,
        "key": trial.key(),
    }


class StubTrials:
    """Replaces ``run_trial``: records the keys it ran; raises KeyboardInterrupt after ``stop_after`` rows."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.keys: list[str] = []
        self.stop_after = stop_after

    def __call__(
        self, model: Any, tokenizer: Any, config: Any, trial: runner.Trial, sample: Any, *extra: Any
    ) -> dict:
        if self.stop_after is not None and len(self.keys) == self.stop_after:
            raise KeyboardInterrupt
        assert sample.depth == trial.depth and sample.seed == trial.seed
        self.keys.append(trial.key())
        return stub_row(config, trial)


@pytest.fixture
def stubs(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(task_lib, "make_sample", stub_sample)

    def no_model(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the runner loaded a model although nothing was left to run")

    monkeypatch.setattr("kvweave.models.load_model", no_model)
    return monkeypatch


def run_with(
    stub: StubTrials, stubs: pytest.MonkeyPatch, config: runner.EvalConfig, out: Path, **kw: Any
) -> list:
    stubs.setattr(runner, "run_trial", stub)
    kw.setdefault("model_and_tokenizer", MODEL_AND_TOKENIZER)
    return runner.run(config, out_dir=out, progress=False, **kw)


# ----------------------------------------------------------------------------------------- resume


def test_interrupted_run_resumes_without_loss_or_rework(stubs: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = small_config()
    all_keys = [t.key() for t in runner.plan(config)]
    assert len(all_keys) == len(set(all_keys)) == 16

    first = StubTrials(stop_after=5)
    with pytest.raises(KeyboardInterrupt):
        run_with(first, stubs, config, tmp_path)
    assert [r["key"] for r in runner.read_rows(tmp_path)] == first.keys == all_keys[:5]
    assert json.loads((tmp_path / "config.json").read_text())["config"]["methods"] == config.methods

    second = StubTrials()
    rows = run_with(second, stubs, config, tmp_path)
    assert second.keys == all_keys[5:]  # nothing finished is redone
    assert sorted(r["key"] for r in rows) == sorted(all_keys)  # nothing is lost or duplicated

    third = StubTrials()
    rows = run_with(third, stubs, config, tmp_path, model_and_tokenizer=None)  # no model load either
    assert third.keys == [] and len(rows) == 16


@pytest.mark.parametrize(
    "changed, named",
    [
        ({"seed": 1}, "seed 0 (this command: 1000)"),
        ({"trials": 3}, "--trials changes the depths"),
        ({"model": "other"}, "model 'stub'"),
        ({"max_new_tokens": 7}, "(this command: 7)"),
        ({"question_aware": True}, "question_aware False"),
    ],
)
def test_resuming_with_other_samples_is_refused(
    stubs: pytest.MonkeyPatch, tmp_path: Path, changed: dict[str, Any], named: str
) -> None:
    config = small_config()
    assert runner.plan(config)[0].task == "passkey"
    full_rows = {
        **stub_row(config, runner.plan(config)[0]),
        "question_aware": False,
        "max_new_tokens": task_lib.TASKS["passkey"].max_new_tokens,
    }
    with pytest.raises(KeyboardInterrupt):
        run_with(StubTrials(stop_after=3), stubs, config, tmp_path)
    rows_path = tmp_path / "rows.jsonl"
    lines = rows_path.read_text().splitlines()
    lines[0] = json.dumps(full_rows)  # a row that records every compared field
    rows_path.write_text("\n".join(lines) + "\n")
    config_before = (tmp_path / "config.json").read_text()
    other = small_config(**changed)
    with pytest.raises(ValueError, match="already holds row") as error:
        run_with(StubTrials(), stubs, other, tmp_path)
    assert named in str(error.value) and "new --out folder" in str(error.value)
    assert (tmp_path / "config.json").read_text() == config_before  # nothing rewritten
    assert len(runner.read_rows(tmp_path)) == 3


def test_resuming_with_other_word_lists_is_refused(stubs: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The same seed draws other words, keys and values from KVWEAVE_DATA's word lists than from the built-in
    ones: a folder whose rows were made with the other lists is refused, naming the way out."""
    stubs.delenv(task_lib.DATA_ENV, raising=False)
    config = small_config()
    assert task_lib.word_lists(config.data_dir) == "builtin"
    row = {**stub_row(config, runner.plan(config)[0]), "word_lists": "wonderwords"}
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="word_lists 'wonderwords' \\(this command: 'builtin'; set or unset"):
        run_with(StubTrials(), stubs, config, tmp_path)


def test_extending_a_run_with_tasks_lengths_and_methods_is_allowed(
    stubs: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = small_config()
    run_with(StubTrials(), stubs, config, tmp_path)
    wider = small_config(
        tasks=["passkey", "niah_single", "vt"],
        contexts=[128, 256, 512],
        methods=["full", "window:ratio=0.25", "window:ratio=0.5"],
    )
    extra = StubTrials()
    rows = run_with(extra, stubs, wider, tmp_path)
    assert len(extra.keys) == len(runner.plan(wider)) - 16 and len(rows) == len(runner.plan(wider))


def test_truncated_last_line_is_ignored_and_redone(stubs: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = small_config()
    all_keys = [t.key() for t in runner.plan(config)]
    with pytest.raises(KeyboardInterrupt):
        run_with(StubTrials(stop_after=3), stubs, config, tmp_path)
    rows_path = tmp_path / "rows.jsonl"
    with rows_path.open("a") as handle:  # a crash in the middle of writing the 4th row
        handle.write(json.dumps(stub_row(config, runner.plan(config)[3]))[:40])
    assert runner.finished_keys(rows_path) == set(all_keys[:3])
    assert len(runner.read_rows(tmp_path)) == 3

    rerun = StubTrials()
    run_with(rerun, stubs, config, tmp_path)
    assert rerun.keys == all_keys[3:]


def test_row_after_truncated_line_is_readable(stubs: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = small_config()
    with pytest.raises(KeyboardInterrupt):
        run_with(StubTrials(stop_after=3), stubs, config, tmp_path)
    with (tmp_path / "rows.jsonl").open("a") as handle:
        handle.write('{"key": "full|passkey|128|1", "sco')
    run_with(StubTrials(), stubs, config, tmp_path)
    assert len(runner.read_rows(tmp_path)) == 16


def test_plan_gives_every_method_the_same_samples() -> None:
    config = small_config(methods=["full", "window:ratio=0.25", "window:window=64"])
    trials = runner.plan(config)
    by_sample: dict[tuple[str, int, int], set[tuple[float, int]]] = {}
    for t in trials:
        by_sample.setdefault((t.task, t.context, t.trial), set()).add((t.depth, t.seed))
    assert all(len(v) == 1 for v in by_sample.values())
    assert {t.depth for t in trials} == set(task_lib.depths(2))
    assert {t.method for t in trials} == {"full", "window:ratio=0.25", "window:window=64"}


def test_method_order_runs_one_method_at_a_time_on_the_same_samples() -> None:
    methods = ["full", "window:ratio=0.25"]
    by_sample = runner.plan(small_config(methods=methods))
    by_method = runner.plan(small_config(methods=methods, order="method"))
    assert sorted(t.key() for t in by_sample) == sorted(t.key() for t in by_method)
    names = [t.method for t in by_method]
    assert names == sorted(names, key=methods.index)  # every full trial before any window trial
    assert by_sample[0].method == "full" and by_sample[1].method == "window:ratio=0.25"
    with pytest.raises(ValueError, match="order"):
        small_config(order="random")


def test_shared_prefill_keeps_recordings_within_its_byte_bound() -> None:
    import torch

    shared = runner.SharedPrefill(max_bytes=2 * 400)
    for key in ("a", "b"):
        shared.recorded[key] = ([(torch.zeros(100), torch.zeros(0))], 1.0, 400)
    shared.make_room()
    assert list(shared.recorded) == ["a", "b"]  # both fit
    shared.recorded["c"] = ([], 1.0, 400)
    shared.make_room()
    assert list(shared.recorded) == ["b", "c"]  # the oldest goes first
    only_current = runner.SharedPrefill()
    only_current.recorded["a"] = ([], 1.0, 400)
    only_current.make_room()
    assert not only_current.recorded
    assert runner._recorded_bytes([(torch.zeros(100), torch.zeros(3))]) == 412


# ----------------------------------------------------------------------------------------- summary


def row(method: str, score: float, kv: int, prefill: float, speed: float | None, context: int = 256) -> dict:
    return {
        "model": "m",
        "method": method,
        "task": "passkey",
        "context": context,
        "score": score,
        "kv_bytes": kv,
        "full_kv_bytes": 1000,
        "prefill_s": prefill,
        "decode_tok_s": speed,
    }


def test_summarize_and_speed_ratios() -> None:
    rows = [
        row("full", 1.0, 1000, 1.0, 10.0),
        row("full", 1.0, 1000, 3.0, 12.0),
        row("full", 0.0, 1000, 2.0, 14.0),
        row("window", 1.0, 200, 1.0, 30.0),
        row("window", 0.0, 250, 4.0, None),  # no decode steps: left out of the median
        row("window", 0.5, 100, 1.0, 20.0, context=512),  # another length: no full to compare with
    ]
    summary = runner.add_speed_ratios(runner.summarize(rows))
    by = {(s["method"], s["context"]): s for s in summary}
    full, window, alone = by[("full", 256)], by[("window", 256)], by[("window", 512)]
    assert full["accuracy"] == pytest.approx(2 / 3) and full["n"] == 3
    assert full["prefill_s"] == 2.0 and full["decode_tok_s"] == 12.0 and full["speed_vs_full"] == 1.0
    assert window["accuracy"] == 0.5 and window["kv_bytes"] == 250  # the most held over the trials
    assert window["compression"] == 4.0
    assert window["prefill_s"] == 2.5  # median of two: their mean
    assert window["decode_tok_s"] == 30.0 and window["speed_vs_full"] == 2.5
    assert alone["speed_vs_full"] is None
    table = runner.format_table(summary)
    assert "window" in table and "2.50" in table and table.count("\n") == 4


# ----------------------------------------------------------------------------------------- prompts


class CharTokenizer:
    """One token per character; 0 is BOS; a chat template that wraps the user turn."""

    chat_template: str | None = "<user>{content}</user><assistant>"

    def apply_chat_template(self, messages: list[dict], tokenize: bool, add_generation_prompt: bool) -> str:
        assert not tokenize and add_generation_prompt and len(messages) == 1
        return f"<user>{messages[0]['content']}</user><assistant>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([0] if add_special_tokens else []) + [ord(c) for c in text]


def text(ids: list[int]) -> str:
    return "".join(chr(i) if i else "<bos>" for i in ids)


SAMPLE = task_lib.Sample("passkey", "DOCUMENT", "What is the pass key?", ["1"], 0.5, 0, 2, "The pass key is")


def test_build_prompt_splits_question_from_context() -> None:
    prefill, full = runner.build_prompt(CharTokenizer(), SAMPLE, question_aware=False)
    assert text(prefill) == "<user>DOCUMENT\n\n"
    assert text(full) == "<user>DOCUMENT\n\nWhat is the pass key?</user><assistant>The pass key is"
    assert full[: len(prefill)] == prefill  # generation continues exactly where the prefill stopped
    assert "\u2063" not in text(full)  # the split marker never reaches the model


def test_build_prompt_question_aware_prefills_all_but_the_last_token() -> None:
    prefill, full = runner.build_prompt(CharTokenizer(), SAMPLE, question_aware=True)
    assert prefill == full[:-1] and "What is the pass key?" in text(prefill)


def test_build_prompt_without_chat_template_adds_bos_once() -> None:
    tokenizer = CharTokenizer()
    tokenizer.chat_template = None
    prefill, full = runner.build_prompt(tokenizer, SAMPLE, question_aware=False)
    assert text(full) == "<bos>DOCUMENT\n\nWhat is the pass key?\nThe pass key is"
    assert text(prefill) == "<bos>DOCUMENT\n\n" and full.count(0) == 1


# ----------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tasks": ["passkey", "nope"]}, r"unknown task 'nope'; available: passkey, .*niah_single"),
        ({"methods": ["full", "nope"]}, r"unknown method 'nope'; available: .*full.*window"),
        ({"methods": ["window:size=3"]}, r"window: unknown option\(s\) \['size'\]; allowed: "),
        ({"methods": ["window:ratio=2"]}, r"ratio=2.0 is out of range"),
        ({"trials": 0}, r"--trials must be at least 1, got 0"),
        ({"contexts": [2048, 16]}, r"context length 16 is too short"),
    ],
)
def test_config_rejects_bad_values(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        small_config(**overrides)


def test_config_haystack_applies_to_tasks_that_take_it() -> None:
    cfg = small_config(tasks=["passkey", "cwe", "fwe"], haystack="essays")
    assert cfg.haystack_for("passkey") == "essays"
    assert cfg.haystack_for("cwe") is None and cfg.haystack_for("fwe") is None
    with pytest.raises(
        ValueError, match=r"no task of this run takes haystack 'essays'.*'cwe': \('wordlist',\)"
    ):
        small_config(tasks=["cwe"], haystack="essays")


def test_config_missing_task_data_fails_before_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVWEAVE_DATA", raising=False)
    with pytest.raises(
        FileNotFoundError, match=r"task 'qa_quality' needs 'leval/quality.jsonl'.*none is configured"
    ):
        small_config(tasks=["qa_quality"])
    with pytest.raises(FileNotFoundError, match=r"not found under .*pass --data DIR"):
        small_config(tasks=["qa_loogle"], data_dir=str(tmp_path))


def test_peak_memory_is_per_trial_process_peak_on_linux() -> None:
    """On the CPU the trial's peak is the process's resident high-water mark, reset when the trial starts, so a
    large allocation before it does not count and one during it does."""
    import torch

    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("no /proc/self/clear_refs: peak memory is not measured here")
    before = bytearray(256 * 2**20)  # a peak before the trial
    del before
    peak = runner.PeakMemory(torch.device("cpu"))
    assert peak.kind == "process_peak_rss"
    quiet = peak.read()
    assert quiet is not None
    during = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB touched during the trial
    loud = peak.read()
    assert loud is not None and loud - quiet >= 200 * 2**20
    del during


def test_feed_generated_reports_progress_every_so_many_tokens_and_at_the_end(monkeypatch):
    """A --generated trial feeds thousands of decode steps: the bar hears how far it is."""
    import kvweave
    from conftest import tiny_model

    monkeypatch.setattr(runner, "GENERATED_EVERY", 4)
    model = tiny_model("llama")
    cache = kvweave.make_cache("full", model)
    seen: list[tuple[int, int]] = []
    runner.feed_generated(model, cache, list(range(3, 13)), 0, lambda done, total: seen.append((done, total)))
    assert seen == [(4, 10), (8, 10), (10, 10)]
    assert cache.get_seq_length() == 10


def test_resuming_rows_of_a_long_generation_measured_at_older_defaults_is_refused(
    stubs: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A default that acts only on long generations (DepthWeave's ``middle_bits``, spec version 5): a folder's
    long-generation row written before it measured another configuration and is not mixed into a resumed run;
    the same row at today's spec version resumes."""
    from kvweave.registry import parse_method
    from kvweave.report.specs import SPEC_VERSION

    config = small_config(methods=["depthweave"], generated=600)
    trial = runner.plan(config)[0]
    options = parse_method("depthweave").options()
    del options["middle_bits"]  # not an option yet when version 4 rows were written
    row = {**stub_row(config, trial), "generated": 600, "options": options, "spec_version": 4}
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="method 'depthweave:middle_bits=0', the defaults then"):
        run_with(StubTrials(), stubs, config, tmp_path)
    current = {**row, "options": parse_method("depthweave").options(), "spec_version": SPEC_VERSION}
    (tmp_path / "rows.jsonl").write_text(json.dumps(current) + "\n")
    run_with(StubTrials(), stubs, config, tmp_path)


def test_old_rows_read_with_the_defaults_they_measured() -> None:
    """Spec version 5 changed a default that acts only on long generations: a version 4 DepthWeave row with
    generated tokens reads as ``middle_bits=0``; a short-answer row of then is today's default (their tests:
    the same tokens and bytes below the threshold)."""
    from kvweave.registry import parse_method
    from kvweave.report.specs import canonical_spec

    options = parse_method("depthweave").options()
    del options["middle_bits"]
    assert canonical_spec("depthweave", options, version=4, generated=True) == "depthweave:middle_bits=0"
    assert canonical_spec("depthweave", options, version=4) == "depthweave"
    recorded = {**options, "recent_share": 0.5}  # the default then, recorded in the row's options
    assert canonical_spec("depthweave", recorded, version=4) == "depthweave"
    assert canonical_spec("depthweave", recorded, version=4, generated=True) == (
        "depthweave:recent_share=0.5,middle_bits=0"
    )
    explicit = canonical_spec("depthweave:recent_share=0.0", {**options, "recent_share": 0.0}, version=4)
    assert explicit == "depthweave:recent_share=0.0"
    assert canonical_spec("depthweave", {**options, "protect": 0.0}, version=3) == "depthweave:protect=0.0"


@pytest.mark.parametrize("method", ["full", "depthweave:recent=16"])
def test_feeding_through_the_decoder_alone_leaves_the_cache_a_full_forward_would(method: str) -> None:
    """The filler's passes skip the language-model head (nothing reads their logits): the cache, and so the
    next step's logits, are exactly those of full forward passes."""
    import kvweave
    from conftest import tiny_model

    model = tiny_model("llama")
    prompt = (torch.arange(200) * 7 % 150 + 3).view(1, -1)
    filler = [(11 * i) % 150 + 3 for i in range(64)]  # past recent + block: folded during the feed
    logits = []
    for through_decoder in (True, False):
        cache = kvweave.make_cache(method, model)
        with torch.no_grad():
            model(prompt, past_key_values=cache, use_cache=True)
            if through_decoder:
                runner.feed_generated(model, cache, filler, prompt.shape[1])
            else:
                for index, token in enumerate(filler):
                    position = torch.tensor([[prompt.shape[1] + index]])
                    model(
                        torch.tensor([[token]]), position_ids=position, past_key_values=cache, use_cache=True
                    )
            position = torch.tensor([[prompt.shape[1] + len(filler)]])
            out = model(torch.tensor([[7]]), position_ids=position, past_key_values=cache, use_cache=True)
        logits.append(out.logits)
        assert cache.get_seq_length() == prompt.shape[1] + len(filler) + 1
    assert torch.equal(logits[0], logits[1])


def test_an_exact_cache_takes_its_filler_in_chunks_and_holds_what_one_token_a_step_leaves() -> None:
    """``full`` feeds a long generation's filler ``EXACT_FEED_CHUNK`` tokens per pass (the causal mask gives
    each token the same attention as a decode step): the next step's logits are those of one token a step, to
    float rounding; a pass never crosses a progress report; every compressed method is fed one token a step."""
    import kvweave
    from conftest import tiny_model

    model = tiny_model("llama")
    prompt = (torch.arange(200) * 7 % 150 + 3).view(1, -1)
    filler = [(11 * i) % 150 + 3 for i in range(64)]
    logits = []
    for chunk in (1, 7):
        cache = kvweave.make_cache("full", model)
        seen: list[tuple[int, int]] = []
        with torch.no_grad():
            model(prompt, past_key_values=cache, use_cache=True)
            runner.feed_generated(
                model, cache, filler, prompt.shape[1], lambda *a, s=seen: s.append(a), chunk
            )
            position = torch.tensor([[prompt.shape[1] + len(filler)]])
            out = model(torch.tensor([[7]]), position_ids=position, past_key_values=cache, use_cache=True)
        logits.append(out.logits)
        assert seen == [(64, 64)] and cache.get_seq_length() == prompt.shape[1] + len(filler) + 1
    assert torch.allclose(logits[0], logits[1], atol=1e-5)
    assert runner.feed_chunk(kvweave.make_cache("full", model)) == runner.EXACT_FEED_CHUNK
    for method in ("depthweave", "quant", "h2o", "xkv"):
        assert runner.feed_chunk(kvweave.make_cache(method, model)) == 1
    with pytest.raises(ValueError, match="chunk must be at least 1"):
        runner.feed_generated(model, kvweave.make_cache("full", model), filler, 0, chunk=0)


def test_a_chunked_feed_stops_at_every_progress_report(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvweave
    from conftest import tiny_model

    monkeypatch.setattr(runner, "GENERATED_EVERY", 4)
    model = tiny_model("llama")
    cache = kvweave.make_cache("full", model)
    seen: list[tuple[int, int]] = []
    runner.feed_generated(model, cache, list(range(3, 13)), 0, lambda d, t: seen.append((d, t)), chunk=3)
    assert seen == [(4, 10), (8, 10), (10, 10)]
    assert cache.get_seq_length() == 10


class AsciiTokenizer:
    """One token per printable character (ids 3..98), newline 99; 0 pads, 1 ends: fits a tiny model's vocab."""

    chat_template = None
    pad_token_id, eos_token_id = 0, 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [99 if c == "\n" else 3 + (ord(c) - 32) % 96 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join("\n" if i == 99 else chr(32 + i - 3) if 3 <= i < 99 else "" for i in ids)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.decode([i]) for i in ids]


@pytest.mark.parametrize(
    "method", ["full", "depthweave:recent=16", "quant:residual=16", "snapkv", "h2o", "dkcache", "xkv"]
)
def test_a_batch_of_long_generation_trials_gives_each_trials_own_row(
    method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--batch``: trials prefilled and fed together (left-padded), each answering alone, write the rows the
    trials write one at a time: the same answers, the same bytes but for the padding slots a row holds."""
    from conftest import tiny_model

    build = runner.build_prompt

    def uneven(tokenizer: Any, sample: task_lib.Sample, question_aware: bool) -> tuple[list[int], list[int]]:
        prefill, full = build(tokenizer, sample, question_aware)  # prompts of 320, 325 and 330 tokens
        lead = [5] * (5 * (sample.seed % 3))
        return lead + prefill, lead + full

    monkeypatch.setattr(runner, "build_prompt", uneven)
    model, tokenizer = tiny_model("llama"), AsciiTokenizer()
    fields = dict(model="tiny", tasks=["passkey"], contexts=[320], methods=[method], trials=3, generated=40)
    fields["max_new_tokens"] = 5
    alone = runner.run(runner.EvalConfig(**fields), progress=False, model_and_tokenizer=(model, tokenizer))
    batch = runner.EvalConfig(**{**fields, "batch": 3})
    together = runner.run(batch, out_dir=tmp_path, progress=False, model_and_tokenizer=(model, tokenizer))
    assert [r["key"] for r in together] == [r["key"] for r in alone]
    assert {r["batch"] for r in together} == {3} and max(r["padding"] for r in together) > 0
    chunk = runner.EXACT_FEED_CHUNK if method == "full" else 1
    assert {r["feed_chunk"] for r in together + alone} == {chunk}
    for one, many in zip(alone, together, strict=True):
        assert many["prediction"] == one["prediction"] and many["score"] == one["score"]
        assert many["prompt_tokens"] == one["prompt_tokens"] and "batch" not in one
        assert many["full_kv_bytes"] == pytest.approx(one["full_kv_bytes"], rel=1e-6)
        # never fewer bytes than alone: the same where the method lays rows out alone (depthweave), a little more
        # where a row keeps the batch's layout (padding slots, quant's exact tail sized for the widest row)
        assert one["kv_bytes"] <= many["kv_bytes"] <= 1.25 * one["kv_bytes"]
        if method.startswith("depthweave"):  # but for the ids recall reads, padding slots included (4 B each)
            assert many["kv_bytes"] == one["kv_bytes"] + 4 * many["padding"]
        # the passages rebuilt while the question and answer were fed: counted for DepthWeave (quote on), no
        # other method rebuilds any
        assert many["rebuilt_spans"] == one["rebuilt_spans"]
        assert (one["rebuilt_spans"] is None) == (not method.startswith("depthweave"))


class _Killed(Exception):
    """Stands for the process being killed mid-batch."""


@pytest.mark.parametrize(
    "method", ["full", "depthweave:recent=16", "quant:residual=16", "snapkv", "h2o", "dkcache", "xkv"]
)
def test_a_killed_batch_resumes_from_its_checkpoint_and_writes_the_rows_of_an_unbroken_one(
    method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``--batch`` long generation saves its cache every CHECKPOINT_EVERY fed tokens; killed after a save, the
    same command goes on from it (no prefill, no token fed twice) and writes the rows the batch writes
    unbroken: the same answers and bytes. The checkpoint is gone once the rows are written."""
    from conftest import tiny_model

    model, tokenizer = tiny_model("llama"), AsciiTokenizer()
    fields = dict(model="tiny", tasks=["passkey"], contexts=[320], methods=[method], trials=2, generated=40)
    config = runner.EvalConfig(**{**fields, "max_new_tokens": 5, "batch": 2})
    monkeypatch.setattr(runner, "CHECKPOINT_EVERY", 16)
    unbroken = runner.run(
        config, out_dir=tmp_path / "a", progress=False, model_and_tokenizer=(model, tokenizer)
    )

    write = runner.write_checkpoint
    saves: list[int] = []

    def write_then_die(folder: Path, cache: Any, model: Any, state: dict[str, Any]) -> None:
        write(folder, cache, model, state)
        saves.append(state["done"])
        if state["done"] == 32:
            raise _Killed

    monkeypatch.setattr(runner, "write_checkpoint", write_then_die)
    with pytest.raises(_Killed):
        runner.run(config, out_dir=tmp_path / "b", progress=False, model_and_tokenizer=(model, tokenizer))
    assert saves == [16, 32] and not (tmp_path / "b" / "rows.jsonl").exists()
    assert [p.name for p in (tmp_path / "b" / "checkpoints").glob("*/cache-*")] == ["cache-32"]

    fed: list[int] = []
    feed = runner.feed_generated_rows

    def counting(*args: Any, **kwargs: Any) -> Any:
        fed.append(args[6] if len(args) > 6 else kwargs.get("done", 0))
        return feed(*args, **kwargs)

    monkeypatch.setattr(runner, "feed_generated_rows", counting)
    resumed = runner.run(
        config, out_dir=tmp_path / "b", progress=False, model_and_tokenizer=(model, tokenizer)
    )
    assert fed == [32] and saves == [16, 32]  # from the save at 32; nothing saved after it (40 is the end)
    assert not any((tmp_path / "b" / "checkpoints").iterdir())
    assert [r["key"] for r in resumed] == [r["key"] for r in unbroken]
    for one, again in zip(unbroken, resumed, strict=True):
        assert again["prediction"] == one["prediction"] and again["score"] == one["score"]
        assert again["kv_bytes"] == one["kv_bytes"] and again["full_kv_bytes"] == one["full_kv_bytes"]


def test_batch_needs_a_long_generation_and_groups_trials_that_share_a_method() -> None:
    with pytest.raises(ValueError, match="--batch .* needs --generated"):
        small_config(batch=2)
    with pytest.raises(ValueError, match="--batch must be at least 1"):
        small_config(batch=0, generated=8)
    config = small_config(generated=8, trials=3, methods=["full", "quant"], tasks=["passkey"], contexts=[128])
    groups = runner.batches(runner.plan(config), 2)  # sample-major: full 0, quant 0, full 1, quant 1, ...
    assert [[(t.method, t.trial) for t in g] for g in groups] == [
        [("full", 0), ("full", 1)],
        [("quant", 0), ("quant", 1)],
        [("full", 2)],
        [("quant", 2)],
    ]
