"""The files of a saved cache (:mod:`kvweave.persist`): their names, the manifest (checked for format and
version, sealed by its own checksum), the tensor file read together with it, and the crash-safe writes a save
makes (temporary files, the pending manifest, the renames).

Everything here is re-exported by :mod:`kvweave.persist`; import the names from there.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

FORMAT = "kvweave-cache"
FORMAT_VERSION = 2  # 2: explicit per-class state (kvweave.state.Stateful); 1: the attribute graph (refused)
MANIFEST = "manifest.json"
TENSORS = "kv.safetensors"
PENDING = MANIFEST + ".pending"
"""The new manifest while a save swaps the pair: complete on disk before the tensor file is replaced, renamed to
``manifest.json`` right after. A loader that finds the tensor file newer than ``manifest.json`` reads this one."""
_TEMPORARY = ".tmp"  # suffix of the files a save writes before renaming them (leftovers of a killed save)


class CacheFileError(ValueError):
    """A saved cache that cannot be loaded (missing, corrupt, another format, another model)."""


# ---------------------------------------------------------------------------------- manifest and writes


def with_checksum(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` with its ``manifest_sha256`` (of every other field) set: what
    :func:`kvweave.persist.save_cache` writes. A manifest edited by hand is refused on loading unless it is
    sealed again with this function."""
    body = {key: value for key, value in manifest.items() if key != "manifest_sha256"}
    return {**body, "manifest_sha256": _manifest_digest(body)}


def _manifest_digest(body: dict[str, Any]) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _write_temporary(folder: Path, data: bytes) -> Path:
    """``data`` in a new temporary file of ``folder``, flushed to the disk; removed again if writing fails."""
    handle, name = tempfile.mkstemp(dir=folder, prefix=".save-", suffix=_TEMPORARY)
    partial = Path(name)
    try:
        view = memoryview(data)
        while view:
            written = os.write(handle, view[: 1 << 24])
            view = view[written:]
        os.fsync(handle)
    except BaseException:
        os.close(handle)
        partial.unlink(missing_ok=True)
        raise
    os.close(handle)
    return partial


def _sync_folder(folder: Path) -> None:
    """Flush the folder's entries (the renames) to the disk, where the platform allows it."""
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def _finish_interrupted_save(folder: Path) -> None:
    """Before a new save: complete a save killed between its two renames (its pending manifest matches the
    tensor file) or drop its pending manifest, and remove temporary files that killed saves left."""
    pending = folder / PENDING
    if pending.is_file():
        try:
            manifest = _parse_manifest(pending, pending.read_bytes())
            current = _sha256(folder / TENSORS) if (folder / TENSORS).is_file() else None
        except (CacheFileError, OSError):
            manifest, current = None, None
        if manifest is not None and manifest["tensors"].get("sha256") == current:
            os.replace(pending, folder / MANIFEST)
        else:
            pending.unlink(missing_ok=True)
    for leftover in folder.glob(f".save-*{_TEMPORARY}"):
        leftover.unlink(missing_ok=True)


def _reason(err: OSError) -> str:
    if err.errno == errno.ENOSPC:
        return "no space left on the device"
    if err.errno == errno.EDQUOT:
        return "disk quota exceeded"
    return err.strerror or str(err)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------- reading


def _not_a_cache_folder(folder: Path) -> CacheFileError:
    if folder.is_file():
        inside = folder.name in (MANIFEST, TENSORS, PENDING)
        hint = f"give its folder {folder.parent}" if inside else "give the folder a save wrote"
        return CacheFileError(
            f"{folder} is a file, not a saved-cache folder (kv.safetensors + manifest.json): {hint}"
        )
    return CacheFileError(
        f"{folder}: no such folder; save a cache there first (kvweave.save_cache or "
        "`kvweave generate --save-cache`)"
    )


def _parse_manifest(file: Path, text: bytes) -> dict[str, Any]:
    """A manifest's contents, checked for format, version, the fields a loader needs and its own checksum."""
    try:
        manifest = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CacheFileError(
            f"{file}: unreadable ({err}); the saved cache is corrupt: save it again"
        ) from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CacheFileError(f"{file}: not a kvweave cache manifest")
    version = manifest.get("format_version")
    if version == 1:
        raise CacheFileError(
            f"{file}: cache format version 1 (kvweave before its explicit saved state) cannot be "
            f"read by this kvweave (version {FORMAT_VERSION}); regenerate it: prefill the prompt "
            "again and save it (kvweave.save_cache, or `kvweave generate --save-cache DIR`)"
        )
    if version != FORMAT_VERSION:
        raise CacheFileError(
            f"{file}: cache format version {version}, this kvweave reads version "
            f"{FORMAT_VERSION}; save the cache again with this kvweave"
        )
    for key, kind in (("method", str), ("tokens", int), ("model", dict), ("tensors", dict), ("state", dict)):
        if not isinstance(manifest.get(key), kind):
            raise CacheFileError(
                f"{file}: the manifest lacks {key!r} (or it is not a {kind.__name__}); the saved cache is "
                "corrupt: save it again"
            )
    state = manifest["state"]
    if not isinstance(state.get("layers"), list) or "context" not in state:
        raise CacheFileError(
            f"{file}: the manifest's state lacks its layers or context; save the cache again"
        )
    sealed = manifest.get("manifest_sha256")  # absent in files of kvweave 0.1.0 before the checksum
    body = {key: value for key, value in manifest.items() if key != "manifest_sha256"}
    if sealed is not None and sealed != _manifest_digest(body):
        raise CacheFileError(
            f"{file}: the manifest's checksum does not match its contents, so it was edited or damaged after "
            "saving; save the cache again (a deliberate edit must be sealed with kvweave.persist.with_checksum)"
        )
    return manifest


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of the saved cache at ``path`` (checked for format, version and its own checksum; not yet
    against the tensor file or the model: :func:`verify_cache` and :func:`load_cache` do that)."""
    folder = Path(path)
    file = folder / MANIFEST
    if not folder.is_dir():
        raise _not_a_cache_folder(folder)
    if not file.is_file() and (folder / "tp.json").is_file():
        raise CacheFileError(
            f"{folder}: saved by tensor-parallel ranks (tp.json), one file set per rank; load it with "
            "kvweave.distributed.load_cache on the same number of ranks (`kvweave generate --tp N --load-cache`)"
        )
    if not file.is_file():
        raise CacheFileError(
            f"{folder}: no {MANIFEST}; this is not a saved kvweave cache (or its save was "
            "interrupted): save it again"
        )
    try:
        text = file.read_bytes()
    except OSError as err:
        raise CacheFileError(f"{file}: unreadable ({_reason(err)}); save the cache again") from err
    return _parse_manifest(file, text)


def _read_pair(folder: Path, attempts: int = 4) -> tuple[dict[str, Any], bytes]:
    """The manifest and the bytes of the tensor file it names, read once and checked against each other.

    A tensor file newer than ``manifest.json`` is matched against the pending manifest of a save that was
    stopped between its renames (or is renaming now). A pair that does not match is read again while a writer
    is replacing it (the manifest changed, or a pending one is there) and then refused: what is returned always
    belongs together."""
    data: bytes | None = None
    name = TENSORS
    previous: dict[str, Any] | None = None
    for attempt in range(attempts):
        manifest = read_manifest(folder)
        if manifest == previous and not (folder / PENDING).exists():
            break  # nothing is being replaced: the mismatch is damage, reading again will not change it
        previous = manifest
        name = str(manifest["tensors"].get("file", TENSORS))
        if Path(name).name != name or name in ("", ".", ".."):
            raise CacheFileError(f"{folder}: the manifest names a tensor file outside its folder; save again")
        try:
            data = (folder / name).read_bytes()
        except FileNotFoundError:
            data = None
        except OSError as err:
            raise CacheFileError(
                f"{folder / name}: unreadable ({_reason(err)}); save the cache again"
            ) from err
        if data is not None:
            digest = hashlib.sha256(data).hexdigest()
            if digest == manifest["tensors"].get("sha256"):
                return manifest, data
            try:
                pending = _parse_manifest(folder / PENDING, (folder / PENDING).read_bytes())
            except (OSError, CacheFileError):
                pending = None
            if pending is not None and digest == pending["tensors"].get("sha256"):
                return pending, data
        if attempt + 1 < attempts:
            time.sleep(0.01 * (attempt + 1))
    if data is None:
        raise CacheFileError(f"{folder}: the tensor file {name} is missing; save the cache again")
    raise CacheFileError(
        f"{folder / name}: checksum mismatch, the tensor file is corrupt or was changed after saving; "
        "save the cache again"
    )


def verify_cache(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Check the saved cache at ``path`` without a model: the manifest (format, version, its checksum) and the
    tensor file's checksum. Returns the manifest; raises :class:`CacheFileError` with the reason. Cheap next
    to loading a model, so a command line checks a cache file with it first."""
    manifest, data = _read_pair(Path(path))
    _tensor_file(Path(path), data)
    return manifest


def _tensor_file(folder: Path, data: bytes) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(data)
    except (SafetensorError, OSError, ValueError) as err:
        raise CacheFileError(f"{folder}: unreadable tensor file ({err}); save the cache again") from err
