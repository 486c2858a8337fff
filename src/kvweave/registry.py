"""The method registry: every compression method is a :class:`Method` options dataclass registered by name.

The registry feeds the CLI (``kvweave methods``), the contract test matrix and the README's methods table;
nothing else lists methods by hand. :func:`parse_method` turns ``name:key=value,...`` specs into instances,
reading options renamed since results were first written under their current names (one table per method,
``Method.renamed_options``; :func:`canonical_spec` applies it to stored specs).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from kvweave._compat import CacheLayerMixin
    from kvweave.cache import KVCache


METHODS: dict[str, type[Method]] = {}


def register(name: str) -> Any:
    """Class decorator: register a :class:`Method` subclass under ``name``."""

    def wrap(cls: type[Method]) -> type[Method]:
        if name in METHODS:
            raise ValueError(
                f"method {name!r} is registered twice ({METHODS[name].__module__}, {cls.__module__})"
            )
        cls.name = name
        METHODS[name] = cls
        return cls

    return wrap


def option(default: Any, help: str, **metadata: Any) -> Any:
    """A method option: a dataclass field with a help text (shown by ``kvweave methods``)."""
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


@dataclasses.dataclass
class Method:
    """Base of every method: its options are dataclass fields, its capabilities class attributes."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    exact: ClassVar[bool] = False  # logits equal to DynamicCache
    evicts: ClassVar[bool] = False  # holds fewer entries than tokens seen
    needs_positions: ClassVar[bool] = False  # de-rotates keys / changes RoPE positions
    cross_layer: ClassVar[bool] = False  # shares state between layers
    supports_batch: ClassVar[bool] = True
    uses_kvweave_attention: ClassVar[bool] = True  # needs kvweave.prepare(model)
    exact_prefill: ClassVar[bool] = True  # prefill attention is exact (compression happens after it)
    bounded_memory: ClassVar[bool] = False  # entries held stay bounded however long decoding runs
    compresses: ClassVar[bool] = (
        True  # holds fewer bytes than the exact cache (False: exact or position-only)
    )
    # For the contract test: options that make the method compress a ~40-token prompt, and option sets
    # that must be rejected (each with the name of the offending option).
    test_options: ClassVar[dict[str, Any]] = {}
    invalid_options: ClassVar[tuple[tuple[dict[str, Any], str], ...]] = ()
    # The budget vocabulary (one table in the README, generated from these): each option that sets how much
    # the method keeps, and which kind of budget it is (see BUDGET_KINDS).
    budget_options: ClassVar[dict[str, str]] = {}
    # Options renamed since results were first written: old name -> new name. parse_method and the report
    # read old specs through this one table (canonical_spec).
    renamed_options: ClassVar[dict[str, str]] = {}
    # Option values rows written before SPEC_VERSION used when they did not set them (defaults changed since,
    # or options added since with the old behaviour as another value).
    legacy_defaults: ClassVar[dict[str, Any]] = {}

    def make_layer(self, cache: KVCache, layer_idx: int) -> CacheLayerMixin:
        """The cache layer object for decoder layer ``layer_idx`` (full-attention layers only)."""
        raise NotImplementedError

    def bind_layers(self, cache: KVCache) -> None:
        """Called once all of ``cache``'s layers are built: cross-layer methods form their layer groups here
        (into ``cache.context.groups``), so no layer has to discover its group at attention time."""

    def options(self) -> dict[str, Any]:
        """The option values of this instance."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def spec(self) -> str:
        """``name:key=value,...`` with the options that differ from their defaults."""
        changed = [
            f"{f.name}={getattr(self, f.name)}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        ]
        return self.name + (":" + ",".join(changed) if changed else "")

    @classmethod
    def describe(cls) -> dict[str, Any]:
        """Name, summary, capabilities and options (name, type, default, help) for CLIs and docs."""
        hints = typing.get_type_hints(cls)
        return {
            "name": cls.name,
            "summary": cls.summary or (cls.__doc__ or "").strip().splitlines()[0],
            "capabilities": {
                c: getattr(cls, c)
                for c in ("exact", "evicts", "needs_positions", "cross_layer", "supports_batch")
            },
            "budget": dict(cls.budget_options),
            "options": [
                {
                    "name": f.name,
                    "type": _type_name(hints.get(f.name)),
                    "default": f.default,
                    "help": f.metadata.get("help", ""),
                }
                for f in dataclasses.fields(cls)
            ],
        }

    def replays_prefill(self, config: Any, tokens: int) -> bool:
        """Whether a ``tokens``-token prompt on a model with ``config`` is prefilled with exact attention, so
        that the evaluation may build this cache from one shared recorded prefill (``kvweave.eval.prefill``).
        Default: the class's ``exact_prefill``; methods exact only under some conditions refine it."""
        return self.exact_prefill

    # -- validation helpers used by subclasses' __post_init__
    def check_range(self, option_name: str, low: float | None = None, high: float | None = None) -> None:
        """Raise ``ValueError`` naming the option, its value and the allowed range when out of range."""
        value = getattr(self, option_name)
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
            raise ValueError(f"{self.name}: option {option_name}={value!r} is out of range; allowed {bounds}")

    def check_choice(self, option_name: str, choices: typing.Iterable[Any]) -> None:
        """Raise ``ValueError`` naming the option, its value and the allowed values."""
        value, allowed = getattr(self, option_name), list(choices)
        if value not in allowed:
            raise ValueError(
                f"{self.name}: option {option_name}={value!r} is not allowed; choose one of {allowed}"
            )


BUDGET_KINDS = {
    "held fraction": "fraction of each row's prompt tokens the cache holds (0.25 = a quarter)",
    "held tokens": "tokens the cache holds per KV head",
    "compression": "compression factor targeted against a 16-bit full cache (8 = eight times smaller)",
    "attended fraction": "fraction of the prompt attended per step; the cache still holds every token",
    "attended tokens": "tokens attended per step per KV head; the cache still holds every token",
    "bits": "bits per stored element of the compressed part (16 / bits is its compression)",
}
"""The kinds of budget a method option can set (``Method.budget_options``)."""


SPEC_VERSION = 2
"""Written into every result row (``spec_version``): rows without it predate the current option names and
defaults, and :func:`canonical_spec` reads them with ``Method.legacy_defaults``."""


def canonical_spec(spec: str, options: dict[str, Any] | None = None, legacy: bool = False) -> str:
    """The spec a stored result row means today.

    Renamed options go under their current names (``dkcache:ratio=0.25`` -> ``dkcache:attended=0.25``). With
    ``options`` (the row's recorded option values) the spec is rebuilt from them; with ``legacy`` (a row written
    before :data:`SPEC_VERSION`) options the row does not set take the values they had then
    (``Method.legacy_defaults``), so a changed default never relabels an old figure. Specs of unknown methods
    (e.g. kvpress rows) are returned unchanged."""
    import kvweave.methods  # noqa: F401  (registers the built-in methods)

    name, _, rest = spec.partition(":")
    cls = METHODS.get(name)
    if cls is None:
        return spec
    items = [p.strip() for p in rest.split(",") if p.strip()]
    if any("=" not in item for item in items):
        return spec
    pairs = [
        (cls.renamed_options.get(k.strip(), k.strip()), v.strip())
        for k, _, v in (i.partition("=") for i in items)
    ]
    if not options and not legacy:  # a current spec: only renames, the text otherwise as written
        return name + (":" + ",".join(f"{k}={v}" for k, v in pairs) if pairs else "")
    fields = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {cls.renamed_options.get(k, k): v for k, v in (options or {}).items()}
    values.update({k: _convert(cls, k, v) for k, v in pairs if k in fields})
    if legacy:
        for key, value in cls.legacy_defaults.items():
            values.setdefault(key, value)
    try:
        return cls(**{k: v for k, v in values.items() if k in fields}).spec()
    except (TypeError, ValueError):
        return spec


def _type_name(hint: Any) -> str:
    if hint is None:
        return "any"
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _convert(cls: type[Method], key: str, text: str) -> Any:
    """Turn an option given as text into the field's type."""
    hint = typing.get_type_hints(cls).get(key)
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if text.lower() in ("none", "null") and type(None) in typing.get_args(hint):
        return None
    for kind in args:
        try:
            if kind is bool:
                if text.lower() in ("1", "true", "yes", "on"):
                    return True
                if text.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError
            if kind in (int, float):
                return kind(text)
            if kind is str:
                return text
        except ValueError:
            continue
    raise ValueError(f"{cls.name}: option {key}={text!r} is not a valid {_type_name(hint)}")


def parse_method(spec: str | Method, **overrides: Any) -> Method:
    """A :class:`Method` from ``"name"``, ``"name:key=value,key=value"`` or an instance (+ keyword options)."""
    if isinstance(spec, Method):
        return dataclasses.replace(spec, **overrides) if overrides else spec
    name, _, rest = spec.strip().partition(":")
    import kvweave.methods  # noqa: F401  (registers the built-in methods)

    if name not in METHODS:
        raise ValueError(
            f"unknown method {name!r}; available: {', '.join(sorted(METHODS))} (see `kvweave methods`)"
        )
    cls = METHODS[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    options: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, text = item.partition("=")
        if not eq:
            raise ValueError(f"{name}: option {item!r} needs the form key=value")
        options[cls.renamed_options.get(key.strip(), key.strip())] = text.strip()
    overrides = {cls.renamed_options.get(key, key): value for key, value in overrides.items()}
    unknown = sorted((set(options) | set(overrides)) - fields)
    if unknown:
        raise ValueError(f"{name}: unknown option(s) {unknown}; allowed: {sorted(fields) or 'none'}")
    typed = {k: _convert(cls, k, v) for k, v in options.items()}
    return cls(**typed, **overrides)
