"""Unit tests for the synthetic long-context task generators (kvweave.eval.tasks)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from kvweave.eval import tasks as T
from kvweave.eval.tasks import DATA_ENV, TASKS, Sample, TaskDataMissing, make_sample, score

SMOLLM2 = Path.home() / ".cache" / "kvweave" / "models" / "smollm2-135m"


class WordTok:
    """Invertible stub tokenizer: words, single punctuation marks and whitespace runs are tokens."""

    _pat = re.compile(r"\s+|\w+|[^\w\s]")

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.inv: list[str] = []
        self.long_calls = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) > 20_000:
            self.long_calls += 1
        ids = []
        for piece in self._pat.findall(text):
            if piece not in self.vocab:
                self.vocab[piece] = len(self.inv)
                self.inv.append(piece)
            ids.append(self.vocab[piece])
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self.inv[i] for i in ids)


class CharTok:
    """One token per character: token positions equal character positions."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


@pytest.fixture(autouse=True)
def _no_data_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests use the built-in word lists unless they point KVWEAVE_DATA somewhere themselves."""
    monkeypatch.delenv(DATA_ENV, raising=False)


@pytest.fixture
def tok() -> WordTok:
    return WordTok()


def _sample(task: str, answers: list[str]) -> Sample:
    return Sample(task, "ctx", "q?", answers, None, 0, 3)


# -- depths and scoring --------------------------------------------------------------------------


def test_depths() -> None:
    assert T.depths(1) == [0.5]
    assert T.depths(2) == [0.1, 0.9]
    assert T.depths(5) == pytest.approx([0.1, 0.3, 0.5, 0.7, 0.9])
    with pytest.raises(ValueError):
        T.depths(0)


def test_score_all_partial_and_case() -> None:
    s = _sample("niah_multivalue", ["1234567", "Red-Apple", "abc", "xyz"])
    assert score(s, "1234567, red-apple, ABC and XYZ") == 1.0
    assert score(s, "  The values are 1234567 and red-apple.\n") == 0.5
    assert score(s, "abc") == 0.25
    assert score(s, "") == 0.0
    assert score(_sample("x", []), "anything") == 0.0
    assert score(_sample("x", ["a b"]), "a\tb") == 0.0  # control chars become newlines (RULER)


def test_sample_prompt() -> None:
    s = _sample("passkey", ["1"])
    assert s.prompt == "ctx\nq?"


# -- every task -------------------------------------------------------------------------------------


BUILTIN = sorted(name for name, spec in TASKS.items() if not spec.needs)
"""Tasks that need no data folder."""
MATCH = [name for name in BUILTIN if TASKS[name].metric == "string_match_all"]


@pytest.mark.parametrize("task", MATCH)
def test_every_task_generates_scores_and_is_deterministic(task: str, tok: WordTok) -> None:
    a = make_sample(task, tok, 2000, depth=0.4, seed=7)
    b = make_sample(task, tok, 2000, depth=0.4, seed=7)
    c = make_sample(task, tok, 2000, depth=0.4, seed=8)
    assert a == b
    assert (a.context, a.answers) != (c.context, c.answers)
    assert a.task == task and a.seed == 7 and a.question and a.answer_prefix and a.answers
    assert a.context_tokens == len(tok.encode(a.context))
    for ans in a.answers:
        assert ans in a.context
    if task not in ("vt", "cwe"):  # their one-shot worked example repeats the question form
        assert a.question not in a.context
    assert score(a, " ".join(a.answers)) == 1.0
    assert score(a, "no idea") == 0.0
    assert a.depth == (0.4 if TASKS[task].uses_depth else None)


@pytest.mark.parametrize("task", BUILTIN)
@pytest.mark.parametrize("target", [1500, 6000])
def test_context_length_within_tolerance(task: str, target: int, tok: WordTok) -> None:
    s = make_sample(task, tok, target, depth=0.5, seed=1)
    tol = s.meta["tolerance"]
    assert s.context_tokens <= target + tol
    coarse = task in ("niah_multikey_uuid", "cwe", "fwe", "code")  # whole lines / list entries only
    assert s.context_tokens >= target - (60 if coarse else tol)


def test_char_tokenizer_length_is_exact_enough() -> None:
    s = make_sample("niah_single", CharTok(), 5000, depth=0.5, seed=0)
    assert abs(s.context_tokens - 5000) <= s.meta["tolerance"]
    assert s.context_tokens == len(s.context)


def test_long_context_tokenizes_whole_text_only_a_few_times(tok: WordTok) -> None:
    s = make_sample("niah_single", tok, 40_000, depth=0.5, seed=0)
    assert abs(s.context_tokens - 40_000) <= s.meta["tolerance"]
    assert tok.long_calls <= 4  # haystack units are tokenized once and cut by counts


def test_haystack_repeats_when_target_exceeds_it(tok: WordTok) -> None:
    s = make_sample("niah_single", tok, 300_000, depth=0.5, seed=0)
    assert abs(s.context_tokens - 300_000) <= s.meta["tolerance"]


# -- needle placement ----------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["passkey", "niah_single", "niah_uuid", "niah_multikey_uuid"])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_needle_at_requested_depth(task: str, depth: float) -> None:
    s = make_sample(task, CharTok(), 8000, depth=depth, seed=3)
    pos = s.context.find(s.answers[0]) / len(s.context)
    assert pos == pytest.approx(depth, abs=0.06)
    assert s.meta["needle_depths"][0] == pytest.approx(depth, abs=0.03)


def test_multi_needle_depths_spread_from_depth(tok: WordTok) -> None:
    s = make_sample("niah_multivalue", tok, 8000, depth=0.2, seed=0)
    assert s.meta["needle_depths"] == pytest.approx([0.2, 0.45, 0.7, 0.95], abs=0.03)
    assert len(s.answers) == 4 and len(set(s.answers)) == 4
    key = s.meta["keys"][0]
    assert s.context.count(f"special magic numbers for {key} is:") == 4
    assert s.question == f"What are all the special magic numbers for {key} mentioned in the provided text?"


def test_random_depth_when_none(tok: WordTok) -> None:
    a = make_sample("niah_single", tok, 3000, depth=None, seed=0)
    b = make_sample("niah_single", tok, 3000, depth=None, seed=1)
    assert a.depth is not None and 0.0 <= a.depth <= 1.0
    assert a.depth != b.depth


# -- task specifics ------------------------------------------------------------------------------


def test_passkey_prompt(tok: WordTok) -> None:
    s = make_sample("passkey", tok, 1000, depth=0.5, seed=0)
    key = s.answers[0]
    assert re.fullmatch(r"\d{5}", key)
    assert f"The pass key is {key}. Remember it. {key} is the pass key." in s.context
    assert s.context.startswith("There is an important info hidden inside a lot of irrelevant text.")
    assert T.NOISE in s.context
    assert s.question == "What is the pass key?" and s.answer_prefix == "The pass key is"


def test_niah_single_template(tok: WordTok) -> None:
    s = make_sample("niah_single", tok, 2000, depth=0.5, seed=0)
    key, value = s.meta["keys"][0], s.answers[0]
    assert re.fullmatch(r"\d{7}", value)
    assert f"One of the special magic numbers for {key} is: {value}." in s.context
    assert s.context.startswith("A special magic number is hidden within the following text.")
    assert s.question == f"What is the special magic number for {key} mentioned in the provided text?"
    assert s.answer_prefix == f"The special magic number for {key} mentioned in the provided text is"
    assert s.meta["wordlist"] == "builtin"


def test_niah_value_types(tok: WordTok) -> None:
    word = make_sample("niah_word", tok, 2000, depth=0.5, seed=0).answers[0]
    assert re.fullmatch(r"[a-z]+-[a-z]+", word)
    uid = make_sample("niah_uuid", tok, 2000, depth=0.5, seed=0).answers[0]
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", uid)


def test_niah_multikey_has_distractors(tok: WordTok) -> None:
    s = make_sample("niah_multikey", tok, 3000, depth=0.5, seed=0)
    keys = s.meta["keys"]
    assert len(keys) == 4 and len(set(keys)) == 4
    assert s.meta["queries"] == keys[:1]
    assert all(f"special magic numbers for {k} is:" in s.context for k in keys)
    assert keys[0] in s.question and not any(k in s.question for k in keys[1:])
    assert len(s.answers) == 1


def test_niah_multiquery_asks_four_keys(tok: WordTok) -> None:
    s = make_sample("niah_multiquery", tok, 3000, depth=0.5, seed=0)
    keys = s.meta["keys"]
    assert s.meta["queries"] == keys and len(s.answers) == 4
    assert f"{keys[0]}, {keys[1]}, {keys[2]}, and {keys[3]}" in s.question
    assert s.question.startswith("What are all the special magic numbers for")


def test_niah_value_kinds_without_plain_numbers(tok: WordTok) -> None:
    """The kvweave variants: hex codes mix letters and digits, common words are plain lowercase words; the
    question names the noun, every value is asked for and planted once."""
    from kvweave.eval.tasks.fitting import COMMON_WORDS

    hexes = make_sample("niah_multiquery_hex", tok, 3000, depth=0.5, seed=1)
    assert hexes.question.startswith("What are all the special magic codes for") and len(hexes.answers) == 4
    for code in hexes.answers:
        assert (
            re.fullmatch(r"[0-9a-f]{8}", code)
            and any(c.isalpha() for c in code)
            and any(c.isdigit() for c in code)
        )
        assert hexes.context.count(code) == 1
    common = make_sample("niah_multivalue_common", tok, 3000, depth=0.5, seed=1)
    assert len(set(common.answers)) == 4 and all(word in COMMON_WORDS for word in common.answers)
    assert common.question.startswith("What are all the special magic words for")
    words = make_sample("niah_multiquery_word", tok, 3000, depth=0.5, seed=1)
    assert all("-" in word for word in words.answers)


def test_niah_multikey_uuid_haystack_is_needles(tok: WordTok) -> None:
    s = make_sample("niah_multikey_uuid", tok, 3000, depth=0.5, seed=0)
    lines = s.context.split("\n")[1:]
    assert len(lines) > 10
    assert all(
        re.fullmatch(r"One of the special magic uuids for [0-9a-f-]{36} is: [0-9a-f-]{36}\.", x)
        for x in lines
    )
    key = s.meta["keys"][0]
    assert s.context.count(key) == 1 and key in s.question
    with pytest.raises(ValueError, match="does not support haystack"):
        make_sample("niah_multikey_uuid", tok, 3000, haystack="pydoc")


def _resolve_vt(document: str, value: str) -> set[str]:
    """Variables assigned ``value`` through the chains in ``document``."""
    found: set[str] = set()
    for name, rhs in re.findall(r"VAR ([A-Z]+) = (VAR [A-Z]+|\d+)", document):
        if rhs == value or rhs.removeprefix("VAR ") in found:
            found.add(name)
    return found


@pytest.mark.parametrize("haystack", ["repeat", "pydoc"])
def test_vt_chain_resolves_to_answers(haystack: str, tok: WordTok) -> None:
    s = make_sample("vt", tok, 3000, depth=0.3, seed=0, haystack=haystack)
    value = re.search(r"value (\d+) in the text above", s.question).group(1)
    document = s.context.rsplit("hidden in the following text.", 1)[1]
    assert _resolve_vt(document, value) == set(s.answers)
    assert len(s.answers) == 5 and s.meta["icl"]
    assert "5 variables are assigned the value" in s.answer_prefix
    assert not make_sample("vt", tok, 600, depth=0.3, seed=0).meta["icl"]


def test_cwe_answers_are_most_common(tok: WordTok) -> None:
    for target in (2000, 6000):
        s = make_sample("cwe", tok, target, seed=0)
        main = s.context.rsplit("Memorize the ones that appear most often.\n", 1)[1]
        counts = Counter(re.findall(r"\d+\. (\S+)", main))
        top = {w for w, _ in counts.most_common(10)}
        assert top == set(s.answers) and len(s.answers) == 10
        assert min(counts[w] for w in s.answers) > max(c for w, c in counts.items() if w not in top)


def test_fwe_answers_are_most_frequent(tok: WordTok) -> None:
    s = make_sample("fwe", tok, 4000, seed=0)
    words = s.context.split("coded words. ", 1)[1].split()
    counts = Counter(w for w in words if w != "...")
    assert [w for w, _ in counts.most_common(3)] == s.answers
    assert Counter(words).most_common(1)[0][0] == "..."


def test_cwe_beyond_builtin_vocabulary(tok: WordTok) -> None:
    s = make_sample("cwe", tok, 20_000, seed=0)
    assert s.meta["distinct_words"] > 400  # more than the built-in lists hold: compounds extend them
    assert abs(s.context_tokens - 20_000) <= 60


# -- errors ----------------------------------------------------------------------------------------


def test_invalid_arguments(tok: WordTok) -> None:
    with pytest.raises(ValueError, match="unknown task"):
        make_sample("nope", tok, 1000)
    with pytest.raises(ValueError, match="depth"):
        make_sample("passkey", tok, 1000, depth=1.5)
    with pytest.raises(ValueError, match="too small"):
        make_sample("niah_multiquery", tok, 50)
    with pytest.raises(ValueError, match="unknown haystack"):
        T.load_haystack("nope")


def test_essays_missing_names_env_var(tmp_path: Path) -> None:
    with pytest.raises(TaskDataMissing, match=DATA_ENV):
        T.load_haystack("essays")
    with pytest.raises(TaskDataMissing, match=DATA_ENV):
        T.load_haystack("essays", data_dir=tmp_path)
    with pytest.raises(TaskDataMissing, match=DATA_ENV):
        make_sample("niah_single", WordTok(), 1000, haystack="essays")


def test_corpus_missing_names_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TaskDataMissing, match=DATA_ENV):
        T.load_corpus("wikitext2_valid")
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    with pytest.raises(TaskDataMissing, match=DATA_ENV):
        T.load_corpus("wikitext2_valid")
    assert issubclass(TaskDataMissing, FileNotFoundError)


# -- optional data via KVWEAVE_DATA ----------------------------------------------------------------


def _essay_dir(root: Path) -> Path:
    essays = root / "pg_essays"
    essays.mkdir(parents=True)
    for i in range(3):
        text = " ".join(f"Essay {i} makes point number {j} about startups and taste." for j in range(80))
        (essays / f"e{i}.txt").write_text(text)
    (essays / "LICENSE.NeedleInAHaystack.txt").write_text("license words only")
    return root


def test_essays_haystack_from_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tok: WordTok) -> None:
    root = _essay_dir(tmp_path)
    hay = T.load_haystack("essays", data_dir=root)
    assert len(hay.units) == 240 and "license" not in hay.text
    monkeypatch.setenv(DATA_ENV, str(root))
    s = make_sample("niah_single", tok, 1500, depth=0.5, seed=0, haystack="essays")
    assert "about startups and taste" in s.context and s.meta["haystack"] == "essays"


def test_corpus_and_wordlists_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tok: WordTok) -> None:
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "wikitext2_valid.txt").write_text(" = Title = \n The text . \n")
    words = tmp_path / "ruler" / "wordlists"
    words.mkdir(parents=True)
    (words / "wonderwords_adjectivelist.txt").write_text("zesty\nquirky\nad hoc\n")
    (words / "wonderwords_nounlist.txt").write_text("walrus\nnarwhal\n")
    (words / "wonderwords_verblist.txt").write_text("juggle\n")
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    assert T.load_corpus("wikitext2_valid").startswith(" = Title =")
    s = make_sample("niah_word", tok, 1500, depth=0.5, seed=0)
    assert s.meta["wordlist"] == "wonderwords"
    assert re.fullmatch(r"(zesty|quirky)-(walrus|narwhal)", s.answers[0])


# -- haystacks, corpora, perplexity windows -----------------------------------------------------------


def test_builtin_haystacks() -> None:
    pydoc = T.load_haystack("pydoc")
    assert len(pydoc.units) > 1000 and pydoc is T.load_haystack()
    assert not any(">>>" in u or "::=" in u for u in pydoc.units)
    assert T.load_haystack("repeat").units == (T.NOISE,)
    code = T.load_haystack("code")
    assert code.sep == "\n" and any(u.startswith("class Decimal") for u in code.units)
    assert len(T.load_corpus("pydoc")) > 100_000 and "class Decimal" in T.load_corpus("code")


def test_code_haystack_needles_are_comments(tok: WordTok) -> None:
    s = make_sample("passkey", tok, 3000, depth=0.5, seed=0, haystack="code")
    assert f"\n# The pass key is {s.answers[0]}." in s.context


def test_perplexity_windows() -> None:
    text = " ".join(str(i) for i in range(1000))[:1000]  # no repeated 100-char windows
    wins = T.perplexity_windows(CharTok(), text, 100, 4)
    assert [len(w) for w in wins] == [100] * 4
    starts = [text.find("".join(map(chr, w))) for w in wins]
    assert starts[0] == 0 and all(b - a >= 100 for a, b in zip(starts, starts[1:], strict=False))
    assert len(T.perplexity_windows(CharTok(), text, 400, 5)) == 5  # overlapping when the text is short
    with pytest.raises(ValueError):
        T.perplexity_windows(CharTok(), "short", 100, 1)


def test_task_registry() -> None:
    expected = {
        "passkey", "niah_single", "niah_word", "niah_uuid", "niah_multikey", "niah_multikey_uuid",
        "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "code",
        *(f"niah_{shape}_{kind}" for shape in ("multiquery", "multivalue") for kind in ("word", "hex", "common")),
    }  # fmt: skip
    assert set(TASKS) == expected | {"qa_quality", "qa_loogle"}
    assert set(T.available_tasks()) == expected
    for name, spec in TASKS.items():
        assert spec.name == name and spec.description and spec.default_haystack in spec.haystacks
        assert spec.max_new_tokens > 0


# -- real tokenizer (optional) ---------------------------------------------------------------------


@pytest.mark.skipif(
    not (SMOLLM2 / "tokenizer.json").exists(), reason="SmolLM2 tokenizer not converted locally"
)
def test_real_tokenizer_lengths_and_depth() -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(SMOLLM2))
    for task in ("niah_single", "vt", "cwe"):
        s = make_sample(task, tok, 4096, depth=0.25, seed=0)
        assert s.context_tokens == len(tok.encode(s.context, add_special_tokens=False))
        assert s.context_tokens <= 4096 + s.meta["tolerance"]
        assert s.context_tokens >= 4096 - 64
        assert all(a in s.context for a in s.answers)
    s = make_sample("niah_single", tok, 4096, depth=0.25, seed=0)
    ids = tok.encode(s.context, add_special_tokens=False)
    prefix = tok.encode(s.context[: s.context.find(s.answers[0])], add_special_tokens=False)
    assert len(prefix) / len(ids) == pytest.approx(0.25, abs=0.05)


# -- long-document QA and code -----------------------------------------------------------------------

STORY = "Title {n}\n\n" + "\n\n".join(
    "Paragraph {p} of story {n} tells of ships and {n} sailors." for p in range(30)
)


def _qa_data(root: Path) -> Path:
    (root / "leval").mkdir(parents=True)
    (root / "loogle").mkdir()
    rows = [
        {
            "input": STORY.replace("{n}", str(n)).replace("{p}", "x"),
            "instructions": ["Who sailed?\n (A) cats\n (B) sailors\n (C) dogs\n (D) fish", "Free question"],
            "outputs": ["(B) sailors", "no letter here"],
            "source": "quality_raw",
            "evaluation": "exam",
        }
        for n in range(4)
    ]
    (root / "leval" / "quality.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    article = " ".join(f"Sentence {i} says nothing much." for i in range(3000))
    evidence = "The harbour was built in 1871 by the Danes."
    article = article[: len(article) // 2] + " " + evidence + " " + article[len(article) // 2 :]
    pairs = [
        {"Q": "When was the harbour built?", "A": "In 1871.", "S": evidence},
        {"Q": "x", "A": "y", "S": "absent"},
    ]
    (root / "loogle" / "shortdep_qa.jsonl").write_text(
        json.dumps({"input": article, "title": "Harbour", "qa_pairs": repr(pairs), "output": "none"}) + "\n"
    )
    return root


def test_qa_quality_keeps_whole_story_among_distractors(tmp_path: Path, tok: WordTok) -> None:
    data = _qa_data(tmp_path)
    s = make_sample("qa_quality", tok, 2000, depth=0.5, seed=3, data_dir=data)
    story = STORY.replace("{n}", str(s.meta["document"])).replace("{p}", "x")
    assert story in s.context and s.answers == ["B"]
    assert s.meta["question_index"] == 0  # the question without an option letter is never drawn
    assert abs(s.context_tokens - 2000) <= s.meta["tolerance"]
    assert s.context.count("Title ") >= 2  # distractor stories fill the rest
    assert score(s, "B) sailors") == 1.0 and score(s, "(C) dogs") == 0.0 and score(s, "I think A") == 0.0
    assert score(s, "no letter") == 0.0
    with pytest.raises(ValueError, match="too small for task 'qa_quality'"):
        make_sample("qa_quality", tok, 100, seed=3, data_dir=data)


def test_qa_loogle_window_holds_evidence_at_depth(tmp_path: Path, tok: WordTok) -> None:
    data = _qa_data(tmp_path)
    for depth in (0.2, 0.7):
        s = make_sample("qa_loogle", tok, 3000, depth=depth, seed=0, data_dir=data)
        assert s.meta["evidence"] in s.context and s.answers == ["In 1871."]
        assert abs(s.context_tokens - 3000) <= s.meta["tolerance"]
        assert s.meta["needle_depths"][0] == pytest.approx(depth, abs=0.05)
    assert score(s, "It was built in 1871.") == pytest.approx(2 * (2 / 5) * 1 / (2 / 5 + 1))
    assert score(s, "in 1871") == 1.0 and score(s, "Never") == 0.0
    with pytest.raises(ValueError, match="too long for task 'qa_loogle'"):
        make_sample("qa_loogle", tok, 50_000, seed=0, data_dir=data)


def test_qa_missing_and_corrupt_data(tmp_path: Path, tok: WordTok) -> None:
    with pytest.raises(TaskDataMissing, match="KVWEAVE_DATA"):
        make_sample("qa_quality", tok, 2000)
    (tmp_path / "leval").mkdir()
    (tmp_path / "leval" / "quality.jsonl").write_text('{"input": "x", "instructions": [\n')
    with pytest.raises(ValueError, match="line 1: not valid JSON"):
        make_sample("qa_quality", tok, 2000, data_dir=tmp_path)


def test_code_target_calls_a_far_definition(tok: WordTok) -> None:
    for seed in range(4):
        s = make_sample("code", tok, 3000, seed=seed)
        gold = s.answers[0]
        assert s.context.endswith("\n") and s.meta["line"] - s.meta["definition_line"] > T._CODE_NEAR
        called = T._CALL.findall(gold)
        assert called, gold
        assert score(s, f"```python\n{gold}\n```") == 1.0
        assert score(s, "\n   " + gold + "  \nmore") == 1.0
        assert 0.0 <= score(s, "return None") < 1.0
        assert score(s, "") == 0.0


def test_code_lines_skip_strings_and_comments(tmp_path: Path) -> None:
    src = [
        "def helper(x):",
        "    return x",
        *["pass"] * 50,
        '"""',
        "    value = helper(1) + helper(2)",
        '"""',
    ]
    src += ["# value = helper(3) + helper(4)", "    result = helper(5) + other(6)", "    z = obj.helper(7)"]
    path = tmp_path / "m.py"
    path.write_text("\n".join(src) + "\n")
    lines, cands = T._code_lines(str(path))
    assert [lines[i].strip() for i, _ in cands] == ["result = helper(5) + other(6)"]
    assert cands[0][1] == 0


def test_first_line_complete_only_when_the_scored_line_has_ended() -> None:
    """Generation of a code task may stop once this is true: the scored line cannot change afterwards."""
    from kvweave.eval.tasks import first_code_line, first_line_complete

    assert not first_line_complete("")
    assert not first_line_complete("\n\n```python\n")  # blank lines and a fence: nothing scored yet
    assert not first_line_complete("\n    return foo(a,")  # the line is still being written
    assert first_line_complete("\n    return foo(a, b)\n")
    assert first_line_complete("```\nx = f(1)\r\nmore")
    for text, longer in (("  y = g(2)\n", "  y = g(2)\nz = 3\n"), ("```\nx = f(1)\n", "```\nx = f(1)\n```")):
        assert first_code_line(text) == first_code_line(longer)  # stopping there leaves the score unchanged


def test_code_generation_stops_after_the_first_line() -> None:
    """The runner's stopping criterion ends generate() at the step that completes the first code line."""
    import torch

    from kvweave.eval.runner import FirstLineDone

    class Tok:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join({1: "x = 1", 2: "\n", 3: "y"}.get(i, "") for i in ids)

    done = FirstLineDone(Tok(), prompt_tokens=2)
    assert not done(torch.tensor([[9, 9, 1]]), torch.zeros(1, 4))[0]
    assert done(torch.tensor([[9, 9, 1, 2]]), torch.zeros(1, 4))[0]
    assert not done(torch.tensor([[9, 9, 2]]), torch.zeros(1, 4))[0]  # a leading newline is not a line
