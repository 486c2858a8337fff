"""The C++ kernel builder's lock: a stale torch ``lock`` file is broken, a held build is waited for out loud."""

from __future__ import annotations

import fcntl
import threading
import time

import pytest

from kvweave.kernels._build import exclusive


def test_stale_torch_lock_is_removed_with_a_warning(tmp_path):
    folder = tmp_path / "kernel_v1"
    folder.mkdir()
    (folder / "lock").write_text("")  # what a build killed mid-way leaves
    with pytest.warns(UserWarning, match="interrupted"):
        with exclusive(folder):
            assert not (folder / "lock").exists()


def test_no_warning_without_a_stale_lock(tmp_path, recwarn):
    with exclusive(tmp_path / "kernel_v1"):
        pass
    assert not [w for w in recwarn if "interrupted" in str(w.message)]
    assert (tmp_path / "kernel_v1").is_dir()


def test_a_held_build_is_waited_for_and_said(tmp_path, capsys):
    folder = tmp_path / "kernel_v1"
    folder.mkdir()
    entered = threading.Event()
    with open(tmp_path / "kernel_v1.build-lock", "a+") as other:  # another process's build in progress
        fcntl.flock(other, fcntl.LOCK_EX)
        (folder / "lock").write_text("")  # its live torch lock: must survive while it holds the build lock

        def waiter():
            with exclusive(folder):
                entered.set()

        thread = threading.Thread(target=waiter)
        with pytest.warns(UserWarning, match="interrupted"):  # raised in the thread once the holder is gone
            thread.start()
            time.sleep(0.3)
            assert not entered.is_set()
            assert (folder / "lock").exists()
            fcntl.flock(other, fcntl.LOCK_UN)
            thread.join(timeout=10)
    assert entered.is_set()
    assert "waiting for another process" in capsys.readouterr().err
