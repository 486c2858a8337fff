"""Faults injected into saving and loading a cache, each returning what happened in a sentence (the table of
docs/reliability.md) after checking that no fault let a cache load with contents other than a complete save's.

Two caches of the tiny model, ``A`` (the previous save) and ``B`` (the new one), differ in their prompts. A
loaded cache is compared with them by a digest of its whole saved state (:func:`state_digest`). Saves are killed
in forked children (no new interpreter per kill): at every file-system call of a save in turn, and at random
moments; a full disk is an ``OSError(ENOSPC)`` from ``os.write``; files are truncated, bit-flipped and edited by
hand; readers load while a writer process replaces the cache again and again.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import random
import shutil
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import kvweave
from kvweave._compat import cache_kwarg
from kvweave.persist import CacheFileError, _Encoder, load_cache, save_cache

SPEC = "dkcache:core=4,steady=12,page=4,sinks=2"  # tiers, pages, a far store: many tensors and objects
FS_CALLS = ("open", "write", "fsync", "close", "replace", "unlink", "rename")


def state_digest(cache: Any) -> str:
    """SHA-256 of everything a cache file would hold of ``cache`` (its state tree and every storage's bytes)."""
    encoder = _Encoder(cache)
    state = {
        "layers": [encoder.layer(i) for i in range(len(cache.layers))],
        "context": encoder.encode(cache.context.get_state(), "context"),
    }
    digest = hashlib.sha256(json.dumps(state, sort_keys=True).encode())
    for name in sorted(encoder.tensors):
        digest.update(name.encode() + encoder.tensors[name].numpy().tobytes())
    return digest.hexdigest()


class Pair:
    """The previous (``A``) and the new (``B``) cache of one model, and their digests."""

    def __init__(self, model: Any, root: Path) -> None:
        self.model, self.root = model, root
        generator = torch.Generator().manual_seed(7)
        self.caches = {}
        for name, length in (("A", 40), ("B", 48)):
            ids = torch.randint(3, 150, (1, length), generator=generator)
            cache = kvweave.make_cache(SPEC, model)
            with torch.no_grad():
                model(ids, **{cache_kwarg(model): cache})
            self.caches[name] = (cache, ids)
        self.digests = {name: state_digest(cache) for name, (cache, _) in self.caches.items()}

    def save(self, name: str, folder: Path) -> None:
        cache, ids = self.caches[name]
        save_cache(cache, self.model, folder, prompt_ids=ids)

    def fresh(self, name: str, with_previous: bool = True) -> Path:
        """A new folder holding save ``A`` (or nothing), for one trial."""
        folder = self.root / f"trial-{time.monotonic_ns()}"
        if with_previous:
            self.save("A", folder)
        return folder

    def which(self, folder: Path) -> str:
        """``"A"``, ``"B"`` or ``"refused"`` (loading raised CacheFileError); anything else is a wrong load."""
        try:
            cache, _ = load_cache(folder, self.model)
        except CacheFileError:
            return "refused"
        digest = state_digest(cache)
        for name, known in self.digests.items():
            if digest == known:
                return name
        return "WRONG"


# ------------------------------------------------------------------------------------------- killed saves


def _kill_at(call: int) -> Callable[[], None]:
    """In a forked child: make the ``call``-th file-system call of the save SIGKILL the process first."""
    count = [0]
    for name in FS_CALLS:
        real = getattr(os, name)

        def wrapped(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            count[0] += 1
            if count[0] == call:
                os.kill(os.getpid(), signal.SIGKILL)
            return _real(*args, **kwargs)

        setattr(os, name, wrapped)
    return lambda: None


def _in_child(work: Callable[[], None], kill_after: float | None = None, timeout: float = 60.0) -> str:
    """Run ``work`` in a forked child; ``"killed"`` or ``"finished"`` (SIGKILL after ``kill_after`` s)."""
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no cleanup, just the work
        try:
            work()
        finally:
            os._exit(0)
    if kill_after is not None:
        time.sleep(kill_after)
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return "killed" if os.WIFSIGNALED(status) else "finished"
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise TimeoutError("a forked save did not finish (deadlock in the child?)")
        time.sleep(0.002)


def killed_at_every_call(pair: Pair) -> tuple[Counter[str], int]:
    """Kill a save of B over A before each of its file-system calls in turn: what loads after each kill."""
    outcomes: Counter[str] = Counter()
    for call in range(1, 200):
        folder = pair.fresh("A")

        def work(call: int = call, folder: Path = folder) -> None:
            _kill_at(call)
            pair.save("B", folder)

        if _in_child(work) == "finished":  # the save made fewer calls than this: every point was tried
            assert pair.which(folder) == "B"
            return outcomes, call - 1
        outcomes[pair.which(folder)] += 1
        shutil.rmtree(folder)
    raise AssertionError("a save made more than 200 file-system calls")


def killed_at_random_moments(pair: Pair, seeds: int = 12) -> Counter[str]:
    """Kill saves of B (over A, or into an empty folder) after random delays within a save's duration."""
    start = time.perf_counter()
    pair.save("B", pair.root / "timing")
    duration = time.perf_counter() - start
    outcomes: Counter[str] = Counter()
    for seed in range(seeds):
        rng = random.Random(seed)
        folder = pair.fresh("A", with_previous=seed % 3 != 0)
        _in_child(lambda folder=folder: pair.save("B", folder), kill_after=rng.uniform(0, 1.5 * duration))
        outcomes[pair.which(folder) if folder.exists() else "refused"] += 1
    return outcomes


# ------------------------------------------------------------------------------------------- a full disk


def disk_full(pair: Pair, at_write: int) -> tuple[str, str]:
    """``OSError(ENOSPC)`` from the ``at_write``-th ``os.write`` of a save of B over A: (message, what loads)."""
    folder = pair.fresh("A")
    real, count = os.write, [0]

    def write(handle: int, data: Any) -> int:
        count[0] += 1
        if count[0] >= at_write:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(handle, data)

    os.write = write  # type: ignore[assignment]
    try:
        pair.save("B", folder)
        message = "saved"
    except CacheFileError as err:
        message = str(err)
    finally:
        os.write = real  # type: ignore[assignment]
    leftovers = sorted(p.name for p in folder.iterdir() if p.name not in ("kv.safetensors", "manifest.json"))
    assert not leftovers, leftovers
    return message, pair.which(folder)


# ------------------------------------------------------------------------------------------- damaged files


def damaged(pair: Pair, damage: Callable[[Path, random.Random], None], seeds: int) -> Counter[str]:
    """Save A, damage its files with ``damage(folder, rng)`` per seed: what loads."""
    outcomes: Counter[str] = Counter()
    for seed in range(seeds):
        folder = pair.fresh("A")
        damage(folder, random.Random(seed))
        outcomes[pair.which(folder)] += 1
    return outcomes


def truncate(file_name: str) -> Callable[[Path, random.Random], None]:
    def cut(folder: Path, rng: random.Random) -> None:
        path = folder / file_name
        data = path.read_bytes()
        path.write_bytes(data[: rng.randrange(len(data))])

    return cut


def flip_bit(folder: Path, rng: random.Random) -> None:
    path = folder / rng.choice(["kv.safetensors", "manifest.json"])
    data = bytearray(path.read_bytes())
    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


def _grow_offset(manifest: dict[str, Any]) -> None:
    node = _first_tensor(manifest["state"])
    node["offset"] += 1


def _grow_size(manifest: dict[str, Any]) -> None:
    node = _first_tensor(manifest["state"])
    node["size"][-1] += 1


HAND_EDITS: dict[str, Callable[[dict[str, Any]], None]] = {
    "tokens": lambda m: m.update(tokens=m["tokens"] + 1),
    "method options": lambda m: m.update(method=m["method"].replace("core=4", "core=5")),
    "prompt ids": lambda m: m["prompt_ids"][0].__setitem__(0, m["prompt_ids"][0][0] + 1),
    "a tensor's offset": _grow_offset,
    "a tensor's size": _grow_size,
    "a layer removed": lambda m: m["state"]["layers"].pop(),
    "two layers swapped": lambda m: m["state"]["layers"].reverse(),
    "the model fingerprint": lambda m: m["model"].update(weights_sha256="0" * 16),
    "the tensor checksum": lambda m: m["tensors"].update(sha256="0" * 64),
}


def _first_tensor(node: Any) -> dict[str, Any]:
    if isinstance(node, dict):
        if node.get("__tensor__") and node.get("size"):
            return node
        children = list(node.values())
    elif isinstance(node, list):
        children = node
    else:
        children = []
    for child in children:
        found = _first_tensor(child)
        if found:
            return found
    return {}


def hand_edited(pair: Pair) -> dict[str, str]:
    """Each hand edit of A's manifest: what loads."""
    seen = {}
    for name, edit in HAND_EDITS.items():
        folder = pair.fresh("A")
        manifest = json.loads((folder / "manifest.json").read_text())
        edit(manifest)
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
        seen[name] = pair.which(folder)
    return seen


# ------------------------------------------------------------------------------------------- concurrency


def concurrent_readers(pair: Pair, seconds: float = 2.0) -> Counter[str]:
    """A writer process saves B and A over each other in a loop while this process loads the folder."""
    folder = pair.fresh("A")

    def writer() -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pair.save("B", folder)
            pair.save("A", folder)

    pid = os.fork()
    if pid == 0:
        try:
            writer()
        finally:
            os._exit(0)
    outcomes: Counter[str] = Counter()
    try:
        while not os.waitpid(pid, os.WNOHANG)[0]:
            outcomes[pair.which(folder)] += 1
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    return outcomes


# ------------------------------------------------------------------------------------------- all of them


def _counts(outcomes: Counter[str]) -> str:
    names = {"A": "the previous cache", "B": "the new cache", "refused": "refused"}
    return ", ".join(f"{names.get(k, k)} {v}" for k, v in sorted(outcomes.items()))


@functools.cache
def fault_rows() -> tuple[tuple[str, str], ...]:
    """Every fault tried, checked (no wrong load, what must load loads), as (fault, what happens) rows."""
    import tempfile

    from conftest import tiny_model

    root = Path(tempfile.mkdtemp(prefix="kvweave-faults-"))
    pair = Pair(tiny_model("llama"), root)
    rows = []

    outcomes, calls = killed_at_every_call(pair)
    assert set(outcomes) <= {"A", "B"} and sum(outcomes.values()) == calls, outcomes
    rows.append(
        (
            f"a save of a new cache over an old one SIGKILLed before each of its {calls} file-system calls",
            f"the old cache loads after the first {outcomes['A']} kills, the new one after the last "
            f"{outcomes['B']}; never a mix, never a refusal",
        )
    )
    outcomes = killed_at_random_moments(pair)
    assert set(outcomes) <= {"A", "B", "refused"}, outcomes
    rows.append(
        (
            "a save SIGKILLed at 12 random moments (forked processes; a third into an empty folder)",
            "the old cache, the new one, or (an empty folder) nothing loads: never a half-written cache",
        )
    )
    for at_write, where in ((1, "the tensor file"), (2, "the manifest")):
        message, loads = disk_full(pair, at_write)
        assert loads == "A" and "no space left on the device" in message, (message, loads)
        rows.append(
            (
                f"the disk fills up (`OSError(ENOSPC)`) while a save writes {where}",
                f"`{pair_text(message, root)}`; the old cache still loads, no temporary file is left",
            )
        )
    for name, damage, seeds in (
        ("the tensor file truncated at 16 random lengths", truncate("kv.safetensors"), 16),
        ("the manifest truncated at 16 random lengths", truncate("manifest.json"), 16),
    ):
        outcomes = damaged(pair, damage, seeds)
        assert outcomes == Counter(refused=seeds), outcomes
        rows.append((name, "refused every time (checksum mismatch, or the manifest unreadable)"))
    outcomes = damaged(pair, flip_bit, 48)
    assert set(outcomes) <= {"refused", "A"}, outcomes
    rows.append(
        (
            "one bit flipped at 48 random offsets of either file",
            f"{_counts(outcomes)}: a flip that leaves the contents' meaning intact (e.g. in the name of an "
            "unread field) loads the exact original; every other is refused",
        )
    )
    edits = hand_edited(pair)
    assert set(edits.values()) == {"refused"}, edits
    rows.append(
        (
            "the manifest edited by hand: " + ", ".join(edits),
            "refused every time: `the manifest's checksum does not match its contents, so it was edited or "
            "damaged after saving; save the cache again`",
        )
    )
    outcomes = concurrent_readers(pair)
    assert "WRONG" not in outcomes and (outcomes["A"] + outcomes["B"]) > 0, outcomes
    rows.append(
        (
            "readers load while a writer process replaces the cache with another one again and again",
            "every load gives the old or the new cache whole (a pair caught mid-swap is read again); "
            "none mixes them",
        )
    )
    shutil.rmtree(root, ignore_errors=True)
    return tuple(rows)


def pair_text(message: str, root: Path) -> str:
    """``message`` with its trial folder written as ``DIR``."""
    import re

    return re.sub(re.escape(str(root)) + r"/trial-\d+", "DIR", message)
