"""The README's methods and budget tables, generated from the method registry (``kvweave methods --markdown``).

The README holds the output between ``<!-- methods:begin -->`` and ``<!-- methods:end -->``; a test fails when
that copy is stale, so the registry stays the one list of methods.
"""

from __future__ import annotations

BEGIN, END = "<!-- methods:begin -->", "<!-- methods:end -->"


def methods_markdown() -> str:
    """Markdown: one row per registered method (summary, capabilities, budget options), then the budget kinds."""
    import kvweave.methods  # noqa: F401  (fills the registry)
    from kvweave.registry import BUDGET_KINDS, METHODS

    lines = [
        "| method | what it does | budget options | capabilities |",
        "|---|---|---|---|",
    ]
    for name, cls in sorted(METHODS.items()):
        info = cls.describe()
        defaults = {option["name"]: option["default"] for option in info["options"]}
        budget = (
            ", ".join(
                f"`{option}` ({kind}, default {defaults.get(option)})"
                for option, kind in cls.budget_options.items()
            )
            or "-"
        )
        caps = ", ".join(c for c, on in info["capabilities"].items() if on) or "-"
        lines.append(f"| `{name}` | {info['summary'].replace('|', '/')} | {budget} | {caps} |")
    lines += ["", "Budget kinds (one vocabulary across methods):", "", "| kind | meaning |", "|---|---|"]
    lines += [f"| {kind} | {meaning} |" for kind, meaning in BUDGET_KINDS.items()]
    return "\n".join(lines) + "\n"


def readme_section(readme: str) -> str:
    """The generated block currently in ``readme`` (between the markers), or ``""``."""
    if BEGIN not in readme or END not in readme:
        return ""
    return readme.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def update_readme(readme: str) -> str:
    """``readme`` with the block between the markers replaced by :func:`methods_markdown`."""
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{methods_markdown()}{END}{tail}"
