"""Saving and loading a compressed cache: every registered method continues exactly after a round trip through
the files; corrupt, foreign and mismatched files are refused with the reason."""

from __future__ import annotations

import json

import pytest
import torch

import kvweave
import kvweave.methods  # noqa: F401  (fills the registry)
from conftest import tiny_model
from kvweave._compat import cache_kwarg
from kvweave.persist import (
    MANIFEST,
    TENSORS,
    CacheFileError,
    load_cache,
    read_manifest,
    save_cache,
    with_checksum,
)
from kvweave.registry import METHODS, parse_method

NAMES = sorted(METHODS)


def _continue(model, cache, ids, new_tokens=6):
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **{cache_kwarg(model): cache},
    )
    return out.sequences[:, ids.shape[1] :], torch.stack(out.logits)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("name", NAMES)
def test_saved_cache_continues_exactly(name, arch, tmp_path):
    """Prefill a prefix (and decode a few tokens into it), save, load into a new cache: generating the same
    continuation from the loaded cache gives the same tokens and logits as from the original."""
    model = tiny_model(arch)
    torch.manual_seed(4)
    prefix, question = torch.randint(3, 150, (1, 56)), torch.randint(3, 150, (1, 5))
    spec = parse_method(name, **METHODS[name].test_options)
    cache = kvweave.make_cache(spec, model)
    with torch.no_grad():
        model(prefix, **{cache_kwarg(model): cache})
        model(question[:, :2], **{cache_kwarg(model): cache})  # a decode-sized step: state beyond the prefill
    seen = torch.cat([prefix, question[:, :2]], dim=1)
    save_cache(cache, model, tmp_path / "kv", prompt_ids=seen)
    loaded, manifest = load_cache(tmp_path / "kv", model)
    assert manifest.method == spec.spec() and manifest.tokens == seen.shape[1]
    assert manifest.prompt_ids == seen.tolist()
    assert loaded.nbytes() == cache.nbytes()
    ids = torch.cat([prefix, question], dim=1)
    with torch.no_grad():
        expected, expected_logits = _continue(model, cache, ids)
        got, got_logits = _continue(model, loaded, ids)
    assert torch.equal(got, expected)
    torch.testing.assert_close(got_logits, expected_logits, atol=0, rtol=0)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = tiny_model("llama")
    cache = kvweave.make_cache("dkcache:core=4,steady=12,page=4,sinks=2", model)
    ids = torch.randint(3, 150, (1, 40))
    with torch.no_grad():
        model(ids, **{cache_kwarg(model): cache})
    folder = tmp_path_factory.mktemp("saved") / "kv"
    save_cache(cache, model, folder, prompt_ids=ids)
    return model, folder


def test_corrupt_tensor_file_is_refused(saved, tmp_path):
    model, folder = saved
    copy = tmp_path / "kv"
    copy.mkdir()
    (copy / MANIFEST).write_bytes((folder / MANIFEST).read_bytes())
    data = bytearray((folder / TENSORS).read_bytes())
    data[-10] ^= 0xFF
    (copy / TENSORS).write_bytes(bytes(data))
    with pytest.raises(CacheFileError, match="checksum mismatch"):
        load_cache(copy, model)
    (copy / TENSORS).unlink()
    with pytest.raises(CacheFileError, match="missing"):
        load_cache(copy, model)


def test_other_model_is_refused_with_the_differences(saved):
    _, folder = saved
    other = tiny_model("llama")
    with torch.no_grad():
        next(p for n, p in other.named_parameters() if n.endswith("k_proj.weight")).add_(0.01)
    with pytest.raises(CacheFileError, match="another model.*weights_sha256"):
        load_cache(folder, other)
    with pytest.raises(CacheFileError, match="another model.*num_hidden_layers"):
        load_cache(folder, tiny_model("gemma3"))
    with pytest.raises(CacheFileError, match="another model.*dtype: saved 'float32', this model 'bfloat16'"):
        load_cache(folder, tiny_model("llama", dtype=torch.bfloat16))


def test_missing_or_foreign_manifest_is_refused(saved, tmp_path):
    model, folder = saved
    with pytest.raises(CacheFileError, match="no such folder"):
        load_cache(tmp_path / "nothing", model)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CacheFileError, match="not a saved kvweave cache"):
        load_cache(tmp_path / "empty", model)
    manifest = json.loads((folder / MANIFEST).read_text())
    for change, message in (
        ({"format_version": 99}, "version 99"),
        ({"format": "other"}, "not a kvweave cache"),
    ):
        bad = tmp_path / f"bad{len(message)}"
        bad.mkdir()
        (bad / MANIFEST).write_text(json.dumps({**manifest, **change}))
        with pytest.raises(CacheFileError, match=message):
            read_manifest(bad)
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / MANIFEST).write_text("{not json")
    with pytest.raises(CacheFileError, match="corrupt"):
        read_manifest(tmp_path / "garbled")


def _with_manifest(folder, tmp_path, manifest, name="kv"):
    """A copy of the saved cache with ``manifest`` sealed again (an unsealed edit is refused by its checksum,
    tests/reliability/test_faults.py): what the decoder does with a deliberately edited state."""
    bad = tmp_path / name
    bad.mkdir()
    (bad / MANIFEST).write_text(json.dumps(with_checksum(manifest)))
    (bad / TENSORS).write_bytes((folder / TENSORS).read_bytes())
    return bad


def test_foreign_class_in_state_is_refused(saved, tmp_path):
    """The state tree only rebuilds kvweave's own saved-state classes: any other name is refused."""
    model, folder = saved
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["state"]["layers"][0]["__object__"] = "os:system"
    with pytest.raises(CacheFileError, match="layer 0 was saved as os:system"):
        load_cache(_with_manifest(folder, tmp_path, manifest), model)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["state"]["context"] = {"__object__": "os:system", "id": 999, "state": {}}
    with pytest.raises(CacheFileError, match="does not have"):
        load_cache(_with_manifest(folder, tmp_path, manifest, "kv2"), model)


def test_a_changed_field_list_is_refused(saved, tmp_path):
    """A file whose object lacks a field (or has an extra one) is from another format: refused, not guessed."""
    model, folder = saved
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["state"]["layers"][0]["state"]["renamed_field"] = manifest["state"]["layers"][0]["state"].pop(
        "seen"
    )
    with pytest.raises(CacheFileError, match="expects"):
        load_cache(_with_manifest(folder, tmp_path, manifest), model)


def test_version_1_file_is_refused_with_how_to_regenerate(saved, tmp_path):
    model, folder = saved
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["format_version"] = 1
    with pytest.raises(CacheFileError, match="version 1 .*regenerate it: prefill the prompt again"):
        load_cache(_with_manifest(folder, tmp_path, manifest), model)


def test_empty_cache_and_other_objects_are_not_saved(tmp_path):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="empty"):
        save_cache(kvweave.make_cache("full", model), model, tmp_path / "kv")
    with pytest.raises(TypeError, match="KVCache"):
        save_cache(object(), model, tmp_path / "kv")


def test_depthweave_router_continues_exactly_across_folds(tmp_path):
    """DepthWeave with its router (reads the prompt's token ids) folds decoded blocks into the bases after
    loading exactly as the original cache does."""
    model = tiny_model("llama")
    torch.manual_seed(5)
    prefix = torch.randint(3, 150, (1, 64))
    spec = "depthweave:router=True,block=8,recent=8,group=2"
    cache = kvweave.make_cache(spec, model)
    cache.set_prompt(prefix)
    with torch.no_grad():
        model(prefix[:, :-1], **{cache_kwarg(model): cache})
    save_cache(cache, model, tmp_path / "kv", prompt_ids=prefix[:, :-1])
    loaded, _ = load_cache(tmp_path / "kv", model)
    folds = loaded.layers[0].layer_stats()["folds"]
    with torch.no_grad():
        expected, expected_logits = _continue(model, cache, prefix, new_tokens=20)
        got, got_logits = _continue(model, loaded, prefix, new_tokens=20)
    assert loaded.layers[0].layer_stats()["folds"] > folds  # decoded blocks were folded after loading
    assert torch.equal(got, expected)
    torch.testing.assert_close(got_logits, expected_logits, atol=0, rtol=0)
