"""What an object writes into a saved cache file: an explicit, named state (cache format version 2).

Every kvweave object a saved cache holds (cache layers, tiers, stores, groups, the cache context) subclasses
:class:`Stateful` and lists the attributes it saves in ``state_fields``; the file records them under the class's
``state_name`` (its qualified class name unless set), never under its module path and never as the whole
attribute graph. So moving a class between modules keeps the format, and renaming a saved attribute changes
``state_fields``, which the pinned schema test (``tests/methods/test_cache_schema.py``) catches: either keep
the saved name or raise ``kvweave.persist.FORMAT_VERSION``. A new field may instead be declared in
``state_defaults`` with the value an older file stands for: files saved before it still load.

Attributes not listed are either rebuilt by :meth:`Stateful.after_load` or, for the cache's layers and its
context, come from the freshly built cache the state is loaded into.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

STATEFUL: dict[str, type[Stateful]] = {}


class Stateful:
    """Mixin: an object that saves exactly ``state_fields`` (dataclasses: their fields, unless listed)."""

    state_name: ClassVar[str] = ""
    state_fields: ClassVar[tuple[str, ...]] = ()
    state_defaults: ClassVar[dict[str, Any]] = {}
    """Fields added after format version 2 was fixed, with the value a file saved before them stands for: such a
    file still loads (the pinned schema test allows exactly these additions without a version change)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("state_name") or cls.__qualname__
        cls.state_name = name
        known = STATEFUL.get(name)
        if (
            known is not None
            and f"{known.__module__}.{known.__qualname__}" != f"{cls.__module__}.{cls.__qualname__}"
        ):
            raise TypeError(
                f"saved-state name {name!r} is used by {known.__module__} and {cls.__module__}; set "
                "state_name on one of them"
            )
        STATEFUL[name] = cls

    @classmethod
    def saved_fields(cls) -> tuple[str, ...]:
        """The attributes written to a cache file, in order."""
        if cls.state_fields:
            return cls.state_fields
        if dataclasses.is_dataclass(cls):
            return tuple(f.name for f in dataclasses.fields(cls))
        return ()

    def get_state(self) -> dict[str, Any]:
        """``{field: value}`` for every saved field (a missing attribute is an error in the class's list)."""
        missing = [name for name in self.saved_fields() if not hasattr(self, name)]
        if missing:
            raise AttributeError(
                f"{type(self).__qualname__}.state_fields names {missing}, which the object lacks"
            )
        return {name: getattr(self, name) for name in self.saved_fields()}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore the saved fields (exactly those of this class, less fields added later with a default: a file
        with others is from another format)."""
        expected, found = set(self.saved_fields()), set(state)
        added = {name: value for name, value in self.state_defaults.items() if name not in found}
        if expected != found | set(added) or not set(added) <= expected:
            raise ValueError(
                f"{type(self).state_name}: the saved state has fields {sorted(found)}, this kvweave "
                f"expects {sorted(expected)}"
            )
        for name, value in {**added, **state}.items():
            object.__setattr__(self, name, value)
        self.after_load()

    def after_load(self) -> None:
        """Rebuild what is derived from the saved fields (default: nothing)."""
