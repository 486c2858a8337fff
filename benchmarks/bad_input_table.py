"""Write the table of every bad input and fault the reliability tests try (and what a user sees for each) into
docs/reliability.md, between its markers. The cases live in ``tests/reliability/reliability_cases.py`` and
``tests/reliability/reliability_faults.py``; ``tests/reliability/test_bad_input.py`` fails when the committed
table differs from what they give now. Usage::

    python benchmarks/bad_input_table.py
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"


def main() -> int:
    sys.path[:0] = [str(TESTS), str(TESTS / "reliability")]
    warnings.filterwarnings("ignore")
    from reliability_cases import write_table

    print(f"table: {write_table()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
