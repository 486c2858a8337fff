"""The method registry: every compression method is a :class:`Method` options dataclass registered by name.

The registry feeds the CLI (``kvweave methods``), the contract test matrix and the README's methods table;
nothing else lists methods by hand. :func:`parse_method` turns ``name:key=value,...`` specs into instances,
reading options renamed since results were first written under their current names (one table per method,
``Method.renamed_options``; :func:`canonical_spec` applies it to stored specs).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

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


def option(default: Any, help: str, tuning: bool = False, **metadata: Any) -> Any:
    """A method option: a dataclass field with a help text (shown by ``kvweave methods``).

    ``tuning=True`` marks an implementation setting (a kernel backend, a reference path, a constant the
    measurements fixed): ``kvweave methods`` lists it apart from the options users choose, and the README's
    tables leave it out. It still parses, so experiments, tests and older commands and rows keep working."""
    return dataclasses.field(default=default, metadata={"help": help, "tuning": tuning, **metadata})


TOKEN_IDS_NOTE = (
    "reads the token ids of every forward pass (input_ids) and the tokenizer's text for them, on every "
    "transformers path (kvweave.generate, make_cache + model.generate, the prefix pattern, a loaded cache, TP); "
    "not with inputs_embeds only (warns once), and not inside vLLM, where the method is not served"
)


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
    reads_token_ids: ClassVar[bool] = False  # reads the token ids of every forward pass (content rules)
    # What the vLLM plugin (kvweave.vllm) serves of this method, in one line for `kvweave methods`.
    vllm: ClassVar[str] = "not in the vLLM plugin (transformers paths only)"
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
    # read old specs through this one table (kvweave.report.specs.canonical_spec).
    renamed_options: ClassVar[dict[str, str]] = {}
    refused_options: ClassVar[dict[str, str]] = {}
    """Names that are no option but that users try (``dkcache:decouple_values``): the one-line reason it is
    refused, given instead of "unknown option"."""

    def make_layer(self, cache: KVCache, layer_idx: int) -> CacheLayerMixin:
        """The cache layer object for decoder layer ``layer_idx`` (full-attention layers only)."""
        raise NotImplementedError

    def bind_layers(self, cache: KVCache) -> None:
        """Called once all of ``cache``'s layers are built: cross-layer methods form their layer groups here
        (into ``cache.context.groups``), so no layer has to discover its group at attention time."""

    def context_tensors(self, context: Any) -> list[torch.Tensor]:
        """What this method holds beside its layers in ``context`` (:class:`kvweave.cache.CacheContext`), counted
        in ``KVCache.nbytes``: none by default (DepthWeave's ``recall`` reads the token ids while decoding)."""
        return []

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
    def option_ranges(cls) -> dict[str, str]:
        """What each option allows, as the method's own checks say it (``[low, high]`` or ``one of [...]``):
        the checks :meth:`check_range` and :meth:`check_choice` make on the default instance, recorded, so
        the ranges shown are the ones enforced. Options checked only under other settings have none."""
        global _RANGES
        _RANGES = {}
        try:
            cls()
        except Exception:  # noqa: BLE001  (a method whose defaults need a model: no ranges to show)
            pass
        found, _RANGES = _RANGES, None
        return found

    @classmethod
    def describe(cls) -> dict[str, Any]:
        """Name, summary, capabilities and options (name, type, default, help, range) for CLIs and docs."""
        hints = typing.get_type_hints(cls)
        ranges = cls.option_ranges()
        return {
            "name": cls.name,
            "summary": cls.summary or (cls.__doc__ or "").strip().splitlines()[0],
            "capabilities": {
                c: getattr(cls, c)
                for c in (
                    "exact",
                    "evicts",
                    "needs_positions",
                    "cross_layer",
                    "supports_batch",
                    "reads_token_ids",
                )
            },
            "token_ids": TOKEN_IDS_NOTE if cls.reads_token_ids else None,
            "vllm": cls.vllm,
            "budget": dict(cls.budget_options),
            "options": [
                _describe_field(f, hints, ranges)
                for f in dataclasses.fields(cls)
                if not f.metadata.get("tuning")
            ],
            "tuning": [
                _describe_field(f, hints, ranges) for f in dataclasses.fields(cls) if f.metadata.get("tuning")
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
        if _RANGES is not None:
            _RANGES[option_name] = (
                f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
            )
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
            raise ValueError(f"{self.name}: option {option_name}={value!r} is out of range; allowed {bounds}")

    def check_choice(self, option_name: str, choices: typing.Iterable[Any]) -> None:
        """Raise ``ValueError`` naming the option, its value and the allowed values."""
        value, allowed = getattr(self, option_name), list(choices)
        if _RANGES is not None:
            _RANGES[option_name] = "one of " + ", ".join(str(a) for a in allowed)
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


_RANGES: dict[str, str] | None = None  # set while Method.option_ranges records the checks a method makes


def _describe_field(
    field: dataclasses.Field[Any], hints: dict[str, Any], ranges: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "name": field.name,
        "type": _type_name(hints.get(field.name)),
        "default": field.default,
        "help": field.metadata.get("help", ""),
        "range": (ranges or {}).get(field.name),
    }


def _type_name(hint: Any) -> str:
    if hint is None:
        return "any"
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def convert_option(cls: type[Method], key: str, text: str) -> Any:
    """Turn an option given as text into the field's type (integers take ``4k`` = 4096, as lengths do)."""
    hint = typing.get_type_hints(cls).get(key)
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if text.lower() in ("none", "null") and type(None) in typing.get_args(hint):
        return None
    for kind in args:
        value = _as(kind, text)
        if value is not None:
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{cls.name}: option {key}={text!r} is not a finite number; give a number")
            return value
    raise ValueError(
        f"{cls.name}: option {key}={text!r} is not a valid {_type_name(hint)}; give a {_type_name(hint)} "
        f"(`kvweave methods` lists every option)"
    )


def _as(kind: Any, text: str) -> Any:
    """``text`` as a ``kind`` (bool, int, float or str), or ``None`` when it is not one."""
    lowered = text.lower()
    if kind is bool:
        return {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False}.get(
            lowered, {"no": False, "off": False}.get(lowered)
        )
    if kind is int:
        try:
            if lowered.endswith("k"):  # a token count like 4k
                scaled = float(lowered[:-1]) * 1024
                return int(scaled) if math.isfinite(scaled) and scaled == int(scaled) else None
            return int(text)
        except ValueError:
            return None
    if kind is float:
        try:
            return float(text)
        except ValueError:
            return None
    if kind is str:
        return text
    return None


def split_spec(spec: str, renamed: dict[str, str] | None = None) -> tuple[str, dict[str, str]]:
    """``"name:key=value,..."`` -> ``(name, {key: text})``: the one reading of a spec string (kvweave's methods
    and the vLLM plugin's). ``renamed``: old option names read under their current ones. Refused with a one-line
    ``ValueError``: nothing after ``:``, an empty option, an option without ``=``, an option given twice."""
    name, colon, rest = spec.strip().partition(":")
    name = name.strip()
    if colon and not rest.strip():
        raise ValueError(
            f"{name}: nothing after ':' in {spec.strip()!r}; give options as {name}:key=value or drop the ':'"
        )
    options: dict[str, str] = {}
    for item in (p.strip() for p in rest.split(",")) if rest.strip() else ():
        key, eq, text = item.partition("=")
        key = key.strip()
        if not item:
            raise ValueError(f"{name}: an empty option in {spec.strip()!r}; remove the extra ','")
        if not eq or not key:
            raise ValueError(f"{name}: option {item!r} needs the form key=value")
        current = (renamed or {}).get(key, key)
        if current in options:
            raise ValueError(f"{name}: option {current!r} is given twice in {spec.strip()!r}; give it once")
        options[current] = text.strip()
    return name, options


def parse_method(spec: str | Method, **overrides: Any) -> Method:
    """A :class:`Method` from ``"name"``, ``"name:key=value,key=value"`` or an instance (+ keyword options).

    Refused with a one-line ``ValueError`` naming the problem and the way out: an unknown method or option, an
    option given twice (under its old name too), nothing after ``:``, an empty option, a value of the wrong
    type, a number that is not finite or beyond any token count (2**31), a fraction budget of 0, and whatever
    the method's own checks refuse."""
    if isinstance(spec, Method):
        return check_budgets(dataclasses.replace(spec, **overrides) if overrides else spec)
    if not isinstance(spec, str):
        raise ValueError(f"a method spec is a string like 'window:ratio=0.25', not a {type(spec).__name__}")
    name, colon, rest = spec.strip().partition(":")
    name = name.strip()
    import kvweave.methods  # noqa: F401  (registers the built-in methods)

    if name not in METHODS:
        raise ValueError(
            f"unknown method {name!r}; available: {', '.join(sorted(METHODS))} (see `kvweave methods`)"
        )
    cls = METHODS[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    options: dict[str, Any] = split_spec(spec, cls.renamed_options)[1]
    overrides = {cls.renamed_options.get(key, key): value for key, value in overrides.items()}
    for key in set(options) | set(overrides):
        if key in cls.refused_options:
            raise ValueError(cls.refused_options[key])
    unknown = sorted((set(options) | set(overrides)) - fields)
    if unknown:
        raise ValueError(f"{name}: unknown option(s) {unknown}; allowed: {sorted(fields) or 'none'}")
    twice = sorted(set(options) & set(overrides))
    if twice:
        raise ValueError(f"{name}: option(s) {twice} given in the spec and as keywords; give each once")
    typed = {k: convert_option(cls, k, v) for k, v in options.items()}
    typed.update({k: _checked(cls, k, v) for k, v in overrides.items()})
    return check_budgets(cls(**typed))


def _checked(cls: type[Method], key: str, value: Any) -> Any:
    """A keyword option checked against the field's type (text is converted as in a spec; an int is a valid
    float): ``rope_compensation=0.25`` is refused rather than stored where a bool belongs."""
    if isinstance(value, str):
        return convert_option(cls, key, value)
    hint = typing.get_type_hints(cls).get(key)
    kinds = typing.get_args(hint) or (hint,)
    if value is None and type(None) in kinds:
        return value
    for kind in kinds:
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind is str and isinstance(value, str):
            return value
        if kind not in (bool, int, float, str, type(None)) and hint is not None:
            return value  # a type the registry does not check (none today)
    raise ValueError(
        f"{cls.name}: option {key}={value!r} is not a valid {_type_name(hint)}; give a {_type_name(hint)}"
    )


FRACTION_KINDS = ("held fraction", "attended fraction")
"""Budget kinds whose value is a fraction of the prompt: ``0 < value <= 1`` (0 would keep or attend nothing)."""


def check_budgets(method: Method) -> Method:
    """Refuse option values no method means, whatever its own checks allow: a fraction budget outside
    ``(0, 1]``, a number that is not finite or one beyond any token count (2**31, the width of slots)."""
    for option_name, value in method.options().items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(
                f"{method.name}: option {option_name}={value!r} is not a finite number; give a number"
            )
        if abs(value) >= 2**31:
            raise ValueError(
                f"{method.name}: option {option_name}={value!r} is out of range; allowed [-2**31, 2**31)"
            )
        if method.budget_options.get(option_name) in FRACTION_KINDS and not 0 < value <= 1:
            raise ValueError(
                f"{method.name}: option {option_name}={value!r} is out of range; allowed (0, 1] "
                f"(a {method.budget_options[option_name]} of the prompt)"
            )
    return method
