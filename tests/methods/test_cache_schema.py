"""The saved-cache schema of every method is pinned: a refactor cannot change the file format silently.

``cache_schema.json`` lists, per method, every saved-state class in its cache files and the fields each writes
(format version 2). When a change is intended, raise ``kvweave.persist.FORMAT_VERSION`` (or keep the old field
names) and regenerate the file: ``KVWEAVE_UPDATE_SCHEMA=1 python -m pytest tests/methods/test_cache_schema.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

import kvweave
import kvweave.methods  # noqa: F401  (fills the registry)
from conftest import tiny_model
from kvweave._compat import cache_kwarg
from kvweave.persist import FORMAT_VERSION, MANIFEST, save_cache, state_schema
from kvweave.registry import METHODS, parse_method
from kvweave.state import STATEFUL

PINNED = Path(__file__).with_name("cache_schema.json")
NAMES = sorted(METHODS)


def _schema(name: str, tmp_path: Path) -> dict[str, list[str]]:
    model = tiny_model("gemma3")  # sliding and full layers: both kinds of layer state
    cache = kvweave.make_cache(parse_method(name, **METHODS[name].test_options), model)
    ids = torch.randint(3, 150, (1, 48))
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=False,
        **{cache_kwarg(model): cache},
    )
    folder = save_cache(cache, model, tmp_path / name, prompt_ids=ids)
    schema = state_schema(json.loads((folder / MANIFEST).read_text()))
    # transformers' own layers (sliding windows) save their attributes: their format is transformers', not pinned
    return {name: fields for name, fields in schema.items() if not name.startswith("transformers.")}


def test_every_method_saves_the_pinned_schema(tmp_path):
    found = {"format_version": FORMAT_VERSION, "methods": {name: _schema(name, tmp_path) for name in NAMES}}
    if os.environ.get("KVWEAVE_UPDATE_SCHEMA") == "1":
        PINNED.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    pinned = json.loads(PINNED.read_text())

    def without_added(schema: dict[str, list[str]]) -> dict[str, list[str]]:
        """Fields added later with a default (``Stateful.state_defaults``) do not change the format."""
        return {
            cls: [f for f in fields if f not in STATEFUL[cls].state_defaults]
            for cls, fields in schema.items()
        }

    assert pinned["format_version"] == FORMAT_VERSION, "FORMAT_VERSION changed: regenerate cache_schema.json"
    for name in NAMES:
        assert name in pinned["methods"], f"{name} has no pinned schema: regenerate cache_schema.json"
        assert without_added(found["methods"][name]) == without_added(pinned["methods"][name]), (
            f"{name}: the saved-cache schema changed without a format version change; keep the saved field "
            "names, give a new field a default in state_defaults, or raise kvweave.persist.FORMAT_VERSION and "
            "regenerate cache_schema.json"
        )


def test_every_saved_class_lists_its_fields():
    """No saved-state class saves nothing by accident (an empty field list would save an empty object)."""
    from kvweave.state import STATEFUL

    for state_name, cls in STATEFUL.items():
        assert cls.saved_fields(), f"{state_name} is a saved-state class that saves no fields"
