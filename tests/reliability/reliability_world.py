"""What the reliability tests run against: a folder with a tiny model (and a character tokenizer), prompt files
of every bad kind, a saved cache and damaged copies of it, and a way to run the command line in-process and
see what a user sees (exit status, the last line on stderr).

Paths in what a user sees are written as placeholders (``MODEL``, ``CACHE``, ``DIR``, ...), so the table in
docs/reliability.md does not depend on where the tests ran."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import shlex
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import kvweave
import kvweave.methods  # noqa: F401  (fills the registry)
from conftest import tiny_model
from kvweave._compat import cache_kwarg


class WouldLoad(BaseException):  # noqa: N818  (not an error: the input was accepted)
    """Raised instead of loading a real (registry) model: the command accepted its input."""


@dataclasses.dataclass
class Seen:
    """What a user sees: the exit status (or the exception's class), the one line printed, and the rest."""

    status: int | str
    message: str
    lines: int = 1  # lines on stderr (argparse usage excluded)
    traceback: bool = False
    loaded: bool = False  # a model was loaded before the refusal


def tokenizer() -> Any:
    """A character-level tokenizer of the tiny models' 160-token vocabulary (no chat template)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, "<pad>": 2}
    for char in string.printable:
        if char not in "\x0b\x0c":
            vocab.setdefault(char, len(vocab))
    while len(vocab) < 160:
        vocab[f"<t{len(vocab)}>"] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", eos_token="<eos>", pad_token="<pad>"
    )


class World:
    """The folder of everything the bad inputs point at (built once per test module)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.model_dir = root / "MODEL"
        self.other_dir = root / "OTHER"
        self.tokenizer = tokenizer()
        self.model = tiny_model("llama")
        _save_model(self.model, self.tokenizer, self.model_dir)
        other = tiny_model("llama")
        with torch.no_grad():
            next(p for n, p in other.named_parameters() if n.endswith("k_proj.weight")).add_(0.01)
        _save_model(other, self.tokenizer, self.other_dir)
        (root / "FOLDER").mkdir()
        (root / "PROMPT.txt").write_text("The quick brown fox jumps over the lazy dog. " * 2)
        (root / "EMPTY.txt").write_text("")
        (root / "BINARY").write_bytes(b"\xff\xfe\x00\x81binary")
        (root / "LONG.txt").write_text("long prompt " * 100)  # 1200 characters: over the 1024 trained
        self.prompt = (root / "PROMPT.txt").read_text()
        self.cache_dir = root / "CACHE"
        self.save_prompt_cache("window:window=8,sinks=2", self.cache_dir)

    def save_prompt_cache(self, spec: str, folder: Path) -> Path:
        """A cache of the raw PROMPT.txt prompt but its last token, as `kvweave generate --save-cache` saves."""
        model = kvweave.load_model(self.model_dir)[0]
        ids = self.tokenizer(self.prompt, return_tensors="pt").input_ids
        cache = kvweave.make_cache(spec, model)
        with torch.no_grad():
            model(ids[:, :-1], **{cache_kwarg(model): cache})
        kvweave.save_cache(cache, model, folder, prompt_ids=ids[:, :-1])
        return folder

    def copy_cache(self, name: str) -> Path:
        """A copy of CACHE named ``name`` (to damage)."""
        import shutil

        target = self.root / name
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(self.cache_dir, target)
        return target

    # -- what a user sees
    def placeholders(self, text: str) -> str:
        """``text`` with the world's paths written as their placeholders (``MODEL``, ``DIR/missing``)."""
        for path in sorted(self.root.iterdir(), key=lambda p: -len(p.name)):
            text = text.replace(str(path), path.name)
        return text.replace(str(self.root), "DIR")

    def paths(self, text: str) -> str:
        """``text`` with its placeholders made real paths (``MODEL`` -> the tiny model folder, ...)."""
        out = []
        for word in shlex.split(text):
            head = word.split("/")[0]
            if word.startswith("DIR/"):
                word = str(self.root / word.removeprefix("DIR/"))
            elif head and (self.root / head).exists():
                word = str(self.root / word)
            out.append(word)
        return shlex.join(out)

    def cli(self, command: str) -> Seen:
        """Run ``kvweave <command>`` in-process (placeholders made paths) and return what the user sees. A
        registry model is not loaded: the command stops there (status ``accepted``)."""
        from kvweave import cli

        argv = shlex.split(self.paths(command))
        err = io.StringIO()
        status: int | str
        with (
            _model_loads() as loads,
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(err),
        ):
            try:
                status = cli.main(argv)
            except SystemExit as exit_:
                status = int(exit_.code or 0)
            except WouldLoad:
                status = "accepted"
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        errors = [line for line in lines if "error:" in line] or lines[-1:]
        message = "(the model loads and the command runs)" if status == "accepted" else (errors or [""])[-1]
        return Seen(
            status,
            self.placeholders(message),
            lines=len(errors),
            traceback=any("Traceback" in line for line in lines),
            loaded=bool(loads),
        )


def _save_model(model: Any, tok: Any, folder: Path) -> None:
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


@contextlib.contextmanager
def _model_loads() -> Iterator[list[str]]:
    """Load local folders (the tiny models) as usual; stop at a registry model (``WouldLoad``)."""
    import kvweave.models as models

    real = models.load_model
    loads: list[str] = []

    def load(name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(name_or_path) in models.REGISTRY:
            raise WouldLoad(str(name_or_path))
        loads.append(str(name_or_path))
        return real(name_or_path, *args, **kwargs)

    models.load_model = load  # type: ignore[assignment]
    try:
        yield loads
    finally:
        models.load_model = real  # type: ignore[assignment]
