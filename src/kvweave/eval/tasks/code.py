"""The code-continuation task builder: predict the next line of a CPython standard-library module.

Target lines call a name defined far above them (:func:`_code_lines`); scored by edit similarity.
"""

from __future__ import annotations

import re
import sysconfig
import tokenize
from functools import lru_cache
from itertools import accumulate
from pathlib import Path

from kvweave.eval.tasks.data import TaskDataMissing
from kvweave.eval.tasks.fitting import _Ctx, _Draft, _Plan

_CODE_FILES = (
    "_pydecimal.py", "typing.py", "argparse.py", "inspect.py", "tarfile.py", "subprocess.py",
    "dataclasses.py", "enum.py", "configparser.py", "pickle.py", "logging/__init__.py", "zipfile/__init__.py",
    "zipfile.py", "difflib.py", "smtplib.py", "imaplib.py", "ftplib.py", "pydoc.py", "shutil.py",
)  # fmt: skip
"""Long pure-Python standard-library modules the code task draws from (those this Python ships)."""

_CALL = re.compile(r"(?:(?<![\w.])|(?<=\bself\.))([A-Za-z_]\w*)\s*\(")
"""A call of a bare name or a method of ``self`` (calls on other objects name what the file may not define)."""
_DEF = re.compile(r"^\s*(?:async\s+)?(?:def|class)\s+([A-Za-z_]\w*)")
_CODE_NEAR = 40
"""The identifier a target line calls must be defined more than this many lines above it."""


@lru_cache(maxsize=32)
def _code_lines(path: str) -> tuple[tuple[str, ...], tuple[tuple[int, int], ...]]:
    """Lines of a source file and its target candidates ``(line index, defining line index)``.

    A candidate is a code line (16-100 characters, not a comment, decorator or string line) calling a
    function or class defined in the same file more than :data:`_CODE_NEAR` lines above it: completing
    it needs context from far back.
    """
    text = Path(path).read_text(encoding="utf-8")
    lines = tuple(text.splitlines())
    in_string: set[int] = set()
    with open(path, encoding="utf-8") as fh:
        for tk in tokenize.generate_tokens(fh.readline):
            if tk.type == tokenize.STRING and tk.end[0] > tk.start[0]:
                in_string.update(range(tk.start[0] - 1, tk.end[0]))
    defined: dict[str, int] = {}
    out = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if (
            i not in in_string
            and 16 <= len(stripped) <= 100
            and not stripped.startswith(("#", "@", "def ", "class ", "async def"))
        ):
            far = [defined[name] for name in _CALL.findall(stripped) if i - defined.get(name, i) > _CODE_NEAR]
            if far:
                out.append((i, max(far)))
        m = _DEF.match(line)
        if m and i not in in_string:
            defined.setdefault(m.group(1), i)
    return lines, tuple(out)


def _code_files() -> list[Path]:
    root = Path(sysconfig.get_path("stdlib"))
    return [root / name for name in _CODE_FILES if (root / name).is_file()]


def _build_code(ctx: _Ctx) -> _Plan:
    """Code continuation: the lines of a CPython stdlib module before a target line; predict that line.

    The target line calls a function or class defined far above it (see :func:`_code_lines`); the context
    is as many preceding lines as fit. Scored by edit similarity of the first predicted line (as LCC and
    RepoBench score next-line completion); ``meta["definition_in_context"]`` says whether the definition
    made it into the window.
    """
    files = _code_files()
    if not files:
        raise TaskDataMissing(
            "task 'code' needs the standard-library sources, which this Python does not ship"
        )
    rng = ctx.rng
    path = rng.choice(files)
    lines, candidates = _code_lines(str(path))
    chars_per_token = 3.0
    budget = ctx.target * chars_per_token
    # Targets with enough file above them for the window, preferring definitions likely inside it.
    above = list(accumulate(len(line) + 1 for line in lines))
    fits = [(i, d) for i, d in candidates if above[i - 1] >= budget] if candidates else []
    inside = [(i, d) for i, d in fits if above[i - 1] - above[d] < 0.8 * budget]
    pool = inside or fits
    if not pool:
        raise ValueError(
            f"context_tokens={ctx.target} is too long for task 'code': {path.name} has no target line with "
            f"that much code above it; use a shorter context"
        )
    target_line, def_line = rng.choice(pool)
    name = path.relative_to(path.parents[1] if path.name == "__init__.py" else path.parent)
    preamble = f"Below is Python source code from the standard-library module {name}.\n\n"
    question = "Question: What is the next line of the code above? Reply with that one line only."
    gold = lines[target_line].strip()

    def build(n: int) -> _Draft:
        first = max(0, target_line - n)
        body = "\n".join(lines[first:target_line])
        meta = {"file": str(name), "line": target_line + 1, "first_line": first + 1, "metric": "edit_sim"}
        meta.update(definition_line=def_line + 1, definition_in_context=first <= def_line)
        return _Draft(preamble + body + "\n", question, [gold], "The next line is:\n```python\n", meta)

    per_line = above[target_line - 1] / max(1, target_line) / chars_per_token
    return _Plan(build, n0=int(ctx.target / per_line), slope=per_line, n_min=1)
