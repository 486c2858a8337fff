"""``kvweave generate --save-cache / --load-cache`` on the real model: a saved prefix continues exactly."""

from __future__ import annotations

import pytest

from kvweave.cli import main

pytestmark = pytest.mark.integration

PROMPT = (
    "The lighthouse keeper wrote the number 41877 on the wall of the lamp room and then described the "
    "storm in detail. "
) * 12
QUESTION = "Question: which number did the keeper write on the wall? Answer: the number"


def _generate(capsys, *args):
    code = main(["generate", "--model", "smollm2-135m", "--raw", "--max-new-tokens", "6", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("method", ["full", "dkcache:attended=0.25"])
def test_saved_prefix_continues_exactly(method, tmp_path, capsys):
    folder = str(tmp_path / "prefix.kv")
    code, saved_run, err = _generate(capsys, "--method", method, "--save-cache", folder, PROMPT + QUESTION)
    assert code == 0 and "saved the cache of" in err
    code, loaded_run, err = _generate(capsys, "--load-cache", folder, PROMPT + QUESTION)
    assert code == 0 and "loaded the cache of" in err
    assert loaded_run == saved_run
    if method == "full":  # an exact cache: the same reply as without saving
        code, plain_run, _ = _generate(capsys, "--method", method, PROMPT + QUESTION)
        assert code == 0 and plain_run == saved_run


def test_prompt_that_does_not_continue_the_cache_is_refused(tmp_path, capsys):
    folder = str(tmp_path / "prefix.kv")
    assert _generate(capsys, "--save-cache", folder, PROMPT + QUESTION)[0] == 0
    code, _, err = _generate(capsys, "--load-cache", folder, "Another text entirely. " + QUESTION)
    assert code == 2 and "does not continue the" in err and "first difference at token" in err
    code, _, err = _generate(capsys, "--load-cache", folder, "--method", "window", PROMPT + QUESTION)
    assert code == 2 and "differs from the saved cache's method" in err
    code, _, err = _generate(capsys, "--load-cache", str(tmp_path / "missing"), PROMPT)
    assert code == 2 and "no such folder" in err
