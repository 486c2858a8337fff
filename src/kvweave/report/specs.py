"""Spec versions and the reading of old result rows: what a stored row's method spec means today.

Rows carry ``spec_version`` (:data:`SPEC_VERSION` when written); a method whose defaults changed since reads an
old row's spec with the option values it had then (:data:`LEGACY_DEFAULTS`), and renamed options under their
current names (``Method.renamed_options``, which ``parse_method`` also reads). The report, the headline figures
and the eval/bench resume checks read rows through :func:`canonical_spec`; the methods themselves know nothing of
old rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvweave.registry import METHODS, convert_option

LEGACY_DEFAULTS: dict[str, dict[int, dict[str, Any]]] = {
    "depthweave": {
        2: {"decode_tokens": 0},
        4: {"protect": 0.0},
        6: {"protect_names": 0},
        7: {"protect_records": 0},
        8: {"recall": 0},
        9: {"quote": 0, "quote_after": 48},
    },
    "dkcache": {2: {"bits": 16, "decouple": True}, 3: {"storage": "model"}},
    "h2o": {3: {"storage": "model"}},
    "keydiff": {3: {"storage": "model"}},
    "keyformer": {3: {"storage": "model"}},
    "pi": {3: {"storage": "model"}},
    "quant": {3: {"storage": "model"}},
    "snapkv": {3: {"storage": "model"}},
    "window": {3: {"storage": "model"}},
}
"""Per method: option values that rows written before spec version N used when they did not set them (defaults
changed in version N, or options added then with the old behaviour as another value): ``{N: {option: value}}``."""


LONG_GENERATION_DEFAULTS: dict[str, dict[int, dict[str, Any]]] = {
    "depthweave": {5: {"middle_bits": 0, "recent_share": 0.5}},
}
"""Per method: defaults changed in version N that act only on long generations (their tests check that a short
answer gets the same tokens and bytes either way): rows written before N with decode-time tokens (``generated``
teacher-forced tokens, or stepwise perplexity) read with the old value; other rows measured what the default does
today, so a short answer's recorded value of such an option counts only where its spec set it."""


SPEC_VERSION = 9
"""Written into every result row (``spec_version``): rows with an older one (none: version 1) predate the
current option names or defaults, and :func:`canonical_spec` reads them with :data:`LEGACY_DEFAULTS`.
Version 2: one budget vocabulary, DK-Cache at INT8 without decoupling, DepthWeave's selective decode;
version 3: exact tokens stored at 16 bits on float32 models (every method's ``storage=auto``); version 4:
DepthWeave keeps retrievable-looking prompt tokens exact (``protect=0.02``); version 5: DepthWeave's recent
buffer holds its unfolded tokens beyond ``recent`` as 4-bit blocks and takes more of the generated tokens'
budget (``middle_bits=4``, ``recent_share=0.8``; long generations only: :data:`LONG_GENERATION_DEFAULTS`);
version 6: DepthWeave keeps long numbers' names exact with them (``protect_names=2``); version 7: DepthWeave keeps
the fields of repeated records exact, whatever their characters (``protect_records=6``); version 8: DepthWeave
rebuilds a passage the decode starts copying from its token ids (``recall=8``); version 9: DepthWeave rebuilds
the passages a question fed after its document quotes, reaching 16 tokens past the quote (``quote=3``,
``quote_after=16``)."""


def canonical_spec(
    spec: str,
    options: dict[str, Any] | None = None,
    legacy: bool = False,
    version: int | None = None,
    generated: bool = False,
) -> str:
    """The spec a stored result row means today.

    Renamed options go under their current names (``dkcache:ratio=0.25`` -> ``dkcache:attended=0.25``). With
    ``options`` (the row's recorded option values) the spec is rebuilt from them; for a row written at spec
    ``version`` (``legacy``: version 1, no ``spec_version`` in the row) options the row does not set take the
    values they had then (:data:`LEGACY_DEFAULTS`; with ``generated``, a row of a long generation, also
    :data:`LONG_GENERATION_DEFAULTS`), so a changed default never relabels an old figure.
    Specs of unknown methods (e.g. kvpress rows) are returned unchanged."""
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
    written_at = 1 if legacy else (SPEC_VERSION if version is None else version)
    if (
        not options and written_at >= SPEC_VERSION
    ):  # a current spec: only renames, the text otherwise as written
        return name + (":" + ",".join(f"{k}={v}" for k, v in pairs) if pairs else "")
    fields = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {cls.renamed_options.get(k, k): v for k, v in (options or {}).items()}
    values.update({k: convert_option(cls, k, v) for k, v in pairs if k in fields})
    if not generated:  # a short answer: what acts only on long generations is today's unless the spec set it
        explicit = {k for k, _ in pairs}
        for defaults in LONG_GENERATION_DEFAULTS.get(name, {}).values():
            for key in defaults:
                if key not in explicit:
                    values.pop(key, None)
    tables = [LEGACY_DEFAULTS] + ([LONG_GENERATION_DEFAULTS] if generated else [])
    for table in tables:
        for since, defaults in table.get(name, {}).items():
            if written_at < since:
                for key, value in defaults.items():
                    values.setdefault(key, value)
    try:
        return cls(**{k: v for k, v in values.items() if k in fields}).spec()
    except (TypeError, ValueError):
        return spec
