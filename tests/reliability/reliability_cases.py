"""Every bad input the reliability tests try, as data, and the markdown table of what a user sees for each.

``SPECS`` go to :func:`kvweave.registry.parse_method` (and through it to every command that takes a method);
``COMMANDS`` to the ``kvweave`` command line, in-process, against the tiny model folder and the files of
:class:`reliability_world.World` (placeholders: ``MODEL``, ``OTHER`` another model, ``CACHE`` a saved cache,
``CACHE-*`` damaged copies of it, ``FOLDER``, ``PROMPT.txt``, ``LONG.txt``, ``EMPTY.txt``, ``BINARY``,
``DIR/...`` a path that does not exist). Each entry names the fragment its message must contain. Entries
expected to be accepted say ``ACCEPTED``; they check that a valid input is not refused by the checks.

``benchmarks/bad_input_table.py`` writes the table into docs/reliability.md; ``test_bad_input.py`` checks every
entry and that the committed table is current.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from reliability_world import Seen, World

ACCEPTED = "ACCEPTED"

SPECS: list[tuple[str, str]] = [
    ("window:ratio=0", "out of range; allowed (0, 1]"),
    ("window:", "nothing after ':'"),
    ("window:ratio=0.25,ratio=0.5", "'ratio' is given twice"),
    ("dkcache:ratio=0.25,attended=0.5", "'attended' is given twice"),
    ("window:ratio=0.25,", "an empty option"),
    ("window:ratio", "needs the form key=value"),
    ("window:=4", "needs the form key=value"),
    ("window:ratio=nan", "not a finite number"),
    ("depthweave:compression=inf", "not a finite number"),
    ("window:ratio=1.5", "out of range"),
    ("window:window=0", "out of range"),
    ("window:window=1.5k", "window=1536"),  # accepted: 1.5k is 1536 tokens
    ("window:window=1.3k", "not a valid int"),
    ("h2o:budget=99999999999", "2**31"),
    ("window:sinks=-1", "out of range"),
    ("window:sinks=yes", "not a valid int"),
    ("window:positions=middle", "choose one of"),
    ("window:size=4", "unknown option(s) ['size']"),
    ("Window", "unknown method 'Window'"),
    ("", "unknown method ''"),
    ("quant:bits=3", "choose one of"),
    ("dkcache:bits=4", "INT4"),
    ("dkcache:core=8,steady=4", "steady=4 is out of range"),
    ("keydiff:ratio=1e-9", "out of range"),
    ("dkcache:attended=0", "out of range"),
    ("full:ratio=0.5", "unknown option(s) ['ratio']"),
]

COMMANDS: list[tuple[str, str]] = [
    # lengths and numbers: 4k everywhere a length is
    ("demo --context 4k", ACCEPTED),
    ("eval --context 4k,8k --methods window:window=1k", ACCEPTED),
    ("bench --context 4k --batch 1,2", ACCEPTED),
    ("ppl --window 4k --target 0.5k", ACCEPTED),
    ("demo --context 0", "a token count must be between 1"),
    ("demo --context -3", "a token count must be between 1"),
    ("demo --context 4q", "expected token counts like 2048"),
    ("demo --context 4k,8k", "expected one token count"),
    ("eval --context 4k,lots", "expected token counts like 2048"),
    ("eval --context ,", "expected comma-separated token counts"),
    ("eval --context 1.3k", "not a whole number of tokens"),
    ("eval --context infk", "not a whole number of tokens"),
    ("eval --context 1e400k", "not a whole number of tokens"),
    ("eval --context 32", "too short"),
    ("eval --trials 0", "expected at least 1"),
    ("eval --trials three", "expected a whole number"),
    ("demo --max-new-tokens -1", "a token count must be between 1"),
    ("bench --batch x", "expected token counts"),
    ("bench --steps 0", "expected at least 1"),
    ("bench --warmup -1", "expected 0 or more"),
    ("bench --device gpu", "not a device"),
    ("ppl --window 4k --target 8k", "--target must be between 1 and --window - 1"),
    ("ppl --windows 0", "expected at least 1"),
    ("diagnose --lengths 0", "a token count must be between 1"),
    ("generate hi --tp 0", "expected at least 1"),
    # method specs through the command line
    ("demo --methods window:ratio=0", "out of range; allowed (0, 1]"),
    ("demo --methods window:", "nothing after ':'"),
    ("eval --methods window:ratio=0.25,ratio=0.5", "'ratio' is given twice"),
    ("eval --methods window:ratio=0.25|0", "out of range; allowed (0, 1]"),
    ("generate hi --method bogus", "unknown method 'bogus'"),
    ("eval --task nope", "unknown task 'nope'"),
    ("eval --model nope", "not in the registry"),
    ("eval --model FOLDER", "has no config.json"),
    ("methods --bogus", "unrecognized arguments: --bogus"),
    ("models pull", "give a model name"),
    ("models pull nope", "not in the registry"),
    # paths
    ("generate --prompt-file FOLDER", "is a folder; give a text file"),
    ("generate --prompt-file DIR/missing.txt", "no such file"),
    ("generate --prompt-file EMPTY.txt", "is empty"),
    ("generate --prompt-file BINARY", "is not UTF-8 text"),
    ("generate hi --prompt-file PROMPT.txt", "not both"),
    ("generate", "give a prompt"),
    ("generate hi --save-cache PROMPT.txt", "is a file; give a folder"),
    ("generate hi --save-cache DIR/new --load-cache CACHE", "not both"),
    (
        "generate hi --load-cache CACHE/manifest.json",
        "give its folder CACHE",
    ),
    ("generate hi --load-cache PROMPT.txt", "is a file, not a saved-cache folder"),
    ("generate hi --load-cache DIR/missing", "no such folder"),
    ("generate hi --load-cache FOLDER", "no manifest.json"),
    ("eval --out PROMPT.txt --context 64", "is a file; give a run folder"),
    ("demo --out PROMPT.txt", "is a file; give a run folder"),
    ("report DIR/missing", "not a run folder"),
    ("report FOLDER", "not a run folder"),
    # the model and saved caches (the tiny model folder loads in a second)
    ("generate --prompt-file PROMPT.txt --raw --model MODEL --max-new-tokens 2", ACCEPTED),
    ("generate --prompt-file LONG.txt --raw --model MODEL", "shorten the prompt, lower --max-new-tokens"),
    ("generate --prompt-file PROMPT.txt --raw --model MODEL --max-new-tokens 2000", "lower --max-new-tokens"),
    ("generate --prompt-file PROMPT.txt --raw --model FOLDER", "has no config.json"),
    ("generate --prompt-file PROMPT.txt --raw --model MODEL --load-cache CACHE --max-new-tokens 2", ACCEPTED),
    ("generate --prompt-file PROMPT.txt --raw --model MODEL --load-cache CACHE --method quant", "differs"),
    ("generate 'another prompt' --raw --model MODEL --load-cache CACHE", "does not continue the"),
    ("generate --prompt-file PROMPT.txt --raw --model OTHER --load-cache CACHE", "another model"),
    ("generate --prompt-file PROMPT.txt --raw --model MODEL --load-cache CACHE-FLIPPED", "checksum mismatch"),
    (
        "generate --prompt-file PROMPT.txt --raw --model MODEL --load-cache CACHE-TRUNCATED",
        "checksum mismatch",
    ),
    ("generate --prompt-file PROMPT.txt --raw --model MODEL --load-cache CACHE-EDITED", "was edited"),
    ("generate --prompt-file PROMPT.txt --raw --model MODEL --load-cache CACHE-NO-TENSORS", "is missing"),
    ("generate --prompt-file PROMPT.txt --raw --model MODEL --load-cache CACHE-GARBLED", "unreadable"),
    ("generate --prompt-file PROMPT.txt --raw --model MODEL --load-cache CACHE-V1", "version 1"),
]

REFUSED_BEFORE_LOADING = ("CACHE-", "--method quant", "--prompt-file FOLDER", "--prompt-file EMPTY")
"""Commands whose refusal must come before any model is loaded (a corrupt file is found in a second)."""

WAY_OUT = (
    "give",
    "use ",
    "pass ",
    "see ",
    "choose",
    "allowed",
    "drop",
    "remove",
    "save ",
    "save it",
    "free ",
    "check",
    "shorten",
    "lower",
    "expected",
    "available",
    "known:",
    "load it",
    "prefill",
    "--help",
    "needs the form",
)
"""Words that start the way out in a message (each refusal must have one)."""


def damage_caches(world: World) -> None:
    """The damaged copies of CACHE the commands point at."""
    flipped = world.copy_cache("CACHE-FLIPPED")
    data = bytearray((flipped / "kv.safetensors").read_bytes())
    data[len(data) // 2] ^= 0x10
    (flipped / "kv.safetensors").write_bytes(bytes(data))
    truncated = world.copy_cache("CACHE-TRUNCATED")
    data = bytearray((truncated / "kv.safetensors").read_bytes())
    (truncated / "kv.safetensors").write_bytes(bytes(data[: len(data) // 2]))
    edited = world.copy_cache("CACHE-EDITED")
    manifest = json.loads((edited / "manifest.json").read_text())
    manifest["prompt_ids"][0][3] += 1  # a hand edit: another prompt, the tensors unchanged
    (edited / "manifest.json").write_text(json.dumps(manifest, indent=1))
    missing = world.copy_cache("CACHE-NO-TENSORS")
    (missing / "kv.safetensors").unlink()
    garbled = world.copy_cache("CACHE-GARBLED")
    (garbled / "manifest.json").write_text((garbled / "manifest.json").read_text()[:200])
    old = world.copy_cache("CACHE-V1")
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["format_version"] = 1
    (old / "manifest.json").write_text(json.dumps(manifest))


def spec_seen(spec: str) -> Seen:
    """What ``parse_method(spec)`` gives: the spec it accepted, or the error."""
    from kvweave.registry import parse_method

    try:
        return Seen("accepted", f"accepted as {parse_method(spec).spec()}")
    except ValueError as err:
        return Seen(type(err).__name__, str(err), lines=len(str(err).splitlines()))
    except Exception as err:  # noqa: BLE001  (a test failure, recorded as what the user would see)
        return Seen(type(err).__name__, f"{type(err).__name__}: {err}", traceback=True)


def all_seen(world: World) -> dict[str, list[tuple[str, Seen]]]:
    """Every case run once: ``{"specs": [(spec, seen)], "commands": [(command, seen)]}``."""
    damage_caches(world)
    return {
        "specs": [(spec, spec_seen(spec)) for spec, _ in SPECS],
        "commands": [(command, world.cli(command)) for command, _ in COMMANDS],
    }


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown(seen: dict[str, list[tuple[str, Seen]]], faults: list[tuple[str, str]]) -> str:
    """The tables of docs/reliability.md: method specs, commands (exit status and message) and faults."""
    lines = ["| method spec | what `parse_method` (and every `--method(s)`) says |", "|---|---|"]
    lines += [f"| `{_cell(spec) or '(empty)'}` | {_cell(s.message)} |" for spec, s in seen["specs"]]
    lines += ["", "| `kvweave` command | exit | what the user sees (stderr) |", "|---|---|---|"]
    for command, s in seen["commands"]:
        status = "runs" if s.status in ("accepted", 0) else s.status
        lines.append(f"| `{_cell(command)}` | {status} | {_cell(s.message)} |")
    lines += ["", "| fault | what happens |", "|---|---|"]
    lines += [f"| {_cell(fault)} | {_cell(outcome)} |" for fault, outcome in faults]
    return "\n".join(lines) + "\n"


def outcome_problems(case: str, expected: str, seen: Seen) -> list[str]:
    """What is wrong with ``seen`` for a case expecting ``expected`` (empty: nothing)."""
    problems = []
    if seen.traceback:
        problems.append("printed a traceback")
    if expected == ACCEPTED:
        if seen.status not in ("accepted", 0):
            problems.append(f"refused a valid input: {seen.message}")
        return problems
    if seen.status in ("accepted", 0) and not seen.message.startswith("accepted as"):
        problems.append("accepted a bad input")
    if expected not in seen.message:
        problems.append(f"message lacks {expected!r}")
    if seen.message.startswith("accepted as"):
        return problems  # a spec expected to be accepted (1.5k), its canonical form checked above
    if seen.lines != 1:
        problems.append(f"{seen.lines} error lines, not one")
    if seen.status == 3 or "internal error" in seen.message:
        problems.append("an internal error, not a message about the input")
    if not any(word in seen.message.lower() for word in WAY_OUT):
        problems.append("names no way out")
    if any(marker in case for marker in REFUSED_BEFORE_LOADING) and seen.loaded:
        problems.append("refused only after loading the model")
    return problems


def as_dict(seen: Seen) -> dict[str, Any]:
    """For assertion messages."""
    return {"status": seen.status, "message": seen.message, "lines": seen.lines, "loaded": seen.loaded}


@functools.cache
def seen_once() -> tuple[World, dict[str, list[tuple[str, Seen]]]]:
    """The world and every case's outcome, computed once per process (the tests and the table share it)."""
    import tempfile

    world = World(Path(tempfile.mkdtemp(prefix="kvweave-bad-input-")))
    return world, all_seen(world)


TABLE_BEGIN, TABLE_END = "<!-- reliability-table:begin -->", "<!-- reliability-table:end -->"
DOC = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"


def committed_table() -> str:
    """The table between the markers of docs/reliability.md."""
    text = DOC.read_text()
    return text.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0].strip("\n") + "\n"


def current_table() -> str:
    """The table the cases give now."""
    from reliability_faults import fault_rows

    return markdown(seen_once()[1], list(fault_rows()))


def write_table() -> Path:
    """Put :func:`current_table` between the markers of docs/reliability.md."""
    text = DOC.read_text()
    head, rest = text.split(TABLE_BEGIN, 1)
    tail = rest.split(TABLE_END, 1)[1]
    DOC.write_text(f"{head}{TABLE_BEGIN}\n{current_table()}{TABLE_END}{tail}")
    return DOC
