"""Faults injected into saving and loading (reliability_faults.py): saves SIGKILLed before every file-system
call and at random moments, a full disk, truncation, bit flips, hand edits and concurrent readers. None may
leave a cache that loads with contents other than a complete save's; what must still load does."""

from __future__ import annotations

import sys

import pytest
from reliability_faults import fault_rows

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="needs os.fork")


def test_no_fault_loads_wrong_data() -> None:
    rows = fault_rows()  # every scenario asserts its own outcome (see reliability_faults.py)
    assert len(rows) == 9
    assert "never a mix" in rows[0][1]
