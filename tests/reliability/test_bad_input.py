"""Bad input everywhere: every listed case (method specs and commands, reliability_cases.py) gives one line
naming the problem and the way out and a non-zero exit, never a traceback; valid inputs are accepted; a fuzz
over the spec parser and the command line finds no input that escapes that; docs/reliability.md's table is
the one these cases give now (``python benchmarks/bad_input_table.py`` rewrites it)."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_cases import (
    COMMANDS,
    SPECS,
    as_dict,
    committed_table,
    current_table,
    outcome_problems,
    seen_once,
    spec_seen,
)


@pytest.mark.parametrize("index", range(len(SPECS)), ids=[s or "(empty)" for s, _ in SPECS])
def test_method_spec_is_refused_in_one_line(index: int) -> None:
    spec, expected = SPECS[index]
    seen = seen_once()[1]["specs"][index][1]
    assert not outcome_problems(spec, expected, seen), (
        spec,
        as_dict(seen),
        outcome_problems(spec, expected, seen),
    )


@pytest.mark.parametrize("index", range(len(COMMANDS)), ids=[c for c, _ in COMMANDS])
def test_command_gives_one_line_and_exit_status(index: int) -> None:
    command, expected = COMMANDS[index]
    seen = seen_once()[1]["commands"][index][1]
    problems = outcome_problems(command, expected, seen)
    assert not problems, (command, as_dict(seen), problems)
    if expected != "ACCEPTED":
        assert seen.status == 2, as_dict(seen)


def test_committed_table_is_current() -> None:
    assert committed_table() == current_table(), (
        "docs/reliability.md's table is stale: run `python benchmarks/bad_input_table.py`"
    )


# ------------------------------------------------------------------------------------------------ fuzz

NAMES = ["window", "h2o", "quant", "dkcache", "depthweave", "snapkv", "full", "pi", "keydiff", "keyformer"]
KEYS = [
    "ratio",
    "window",
    "sinks",
    "budget",
    "bits",
    "core",
    "steady",
    "page",
    "compression",
    "attended",
    "x",
]
VALUES = st.one_of(
    st.sampled_from(
        ["0", "-1", "1e309", "nan", "inf", "-inf", "", "none", "true", "4k", "0.0", "1.0", "2**31"]
    ),
    st.integers(-(2**40), 2**40).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=6),
)


@st.composite
def specs(draw: st.DrawFn) -> str:
    name = draw(st.sampled_from(NAMES) | st.text(max_size=5))
    if draw(st.booleans()):
        return name
    items = draw(st.lists(st.tuples(st.sampled_from(KEYS), VALUES), max_size=4))
    separator = draw(st.sampled_from([",", ",,", ", "]))
    return name + ":" + separator.join(f"{k}={v}" for k, v in items)


@settings(
    max_examples=int(os.environ.get("KVWEAVE_FUZZ_EXAMPLES", 300)),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(specs())
def test_fuzzed_specs_are_accepted_exactly_or_refused_in_one_line(spec: str) -> None:
    """Any spec gives a method whose spec() parses back to itself, or one ValueError line; nothing else."""
    from kvweave.registry import parse_method

    seen = spec_seen(spec)
    assert not seen.traceback, seen.message
    if seen.status == "accepted":
        method = parse_method(spec)
        assert parse_method(method.spec()) == method
        for value in method.options().values():
            assert not (isinstance(value, float) and value != value)  # no NaN option slips through
    else:
        assert seen.lines == 1 and seen.message, seen.message


LENGTHS = st.one_of(
    st.sampled_from(
        ["0", "-1", "4q", "k", "", ",", "1.3k", "infk", "nank", "1e400k", "0.0001k", "4k,,x", "-4k"]
    ),
    st.text(alphabet="0123456789.,-kKe ", max_size=8),
)
COMMAND_OPTIONS = [
    ("demo", "--context", LENGTHS),
    ("demo", "--trials", LENGTHS),
    ("demo", "--max-new-tokens", LENGTHS),
    ("eval", "--context", LENGTHS),
    ("eval", "--trials", LENGTHS),
    ("bench", "--context", LENGTHS),
    ("bench", "--batch", LENGTHS),
    ("bench", "--steps", LENGTHS),
    ("ppl", "--window", LENGTHS),
    ("ppl", "--windows", LENGTHS),
    ("diagnose", "--lengths", LENGTHS),
    ("generate hi", "--max-new-tokens", LENGTHS),
    ("eval", "--methods", specs()),
    ("demo", "--methods", specs()),
    ("generate hi", "--method", specs()),
    ("generate", "--prompt-file", st.sampled_from(["FOLDER", "EMPTY.txt", "BINARY", "DIR/none", "CACHE"])),
    (
        "generate hi",
        "--load-cache",
        st.sampled_from(["PROMPT.txt", "FOLDER", "DIR/none", "CACHE/kv.safetensors"]),
    ),
]


@st.composite
def commands(draw: st.DrawFn) -> tuple[str, str, str]:
    command, option, values = draw(st.sampled_from(COMMAND_OPTIONS))
    return command, option, draw(values)


@settings(
    max_examples=int(os.environ.get("KVWEAVE_FUZZ_EXAMPLES", 150)) // 2,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(commands())
def test_fuzzed_command_lines_never_trace_back(case: tuple[str, str, str]) -> None:
    """A random value for an option: the command runs (the model would load), or one error line, exit 2."""
    import shlex

    command, option, value = case
    world = seen_once()[0]
    seen = world.cli(f"{command} {option} {shlex.quote(value)}")
    assert not seen.traceback, as_dict(seen)
    if seen.status != "accepted":
        assert seen.status == 2 and seen.lines == 1, as_dict(seen)
        assert "internal error" not in seen.message, as_dict(seen)
