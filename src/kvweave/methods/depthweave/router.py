"""The token router: which chunk tokens become exact rows, which bucket (rank) the others get, which are evicted.

Signals, each turned into a percentile (a token takes its best one): the attention the last prompt queries pay
it (:func:`observed_attention`), the energy of its KV outside a low-rank basis (:func:`novelty_score`) and, when
the cache saw the prompt ids (every forward pass hands them over), its content (:func:`content_scores`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kvweave.methods.depthweave.chunk import EVICTED, EXACT, HI, LO, MID, Chunk, Plan
from kvweave.ops.attention import masked_softmax

if TYPE_CHECKING:
    from kvweave.methods.depthweave import DepthWeave

POOL = 5  # router: attention max-pooled over 5 neighbouring tokens so spans survive whole (SnapKV)


def window_attention(
    query: torch.Tensor, key: torch.Tensor, pad_count: torch.Tensor, window: int, scaling: float
) -> torch.Tensor:
    """``[B, H, g·w, n]`` attention of the last ``w = min(window, n)`` prompt queries (the ``g`` query heads of
    each KV head packed along the rows) over the prompt's tokens, causal, padding hidden."""
    b, hq, n, d = query.shape
    h = key.shape[1]
    w = min(window, n)
    q = query[:, :, -w:].float().reshape(b, h, (hq // h) * w, d)
    logits = q @ key.float().transpose(-1, -2) * scaling  # [B, H, g·w, n]
    slots = torch.arange(n, device=key.device)
    causal = slots.view(1, -1) <= torch.arange(n - w, n, device=key.device).repeat(hq // h).view(-1, 1)
    valid = slots.view(1, -1) >= pad_count.view(-1, 1)  # [B, n]
    visible = causal.view(1, 1, *causal.shape) & valid.view(b, 1, 1, n)
    return masked_softmax(logits, visible)


def pooled_attention(probs: torch.Tensor) -> torch.Tensor:
    """``[B, n]`` from :func:`window_attention`'s ``probs``: the mean attention each token got over every query
    row and head, max-pooled over neighbours (SnapKV)."""
    received = probs.sum(dim=(1, 2)) / (probs.shape[1] * probs.shape[2])  # [B, n]
    return F.max_pool1d(received.unsqueeze(1), POOL, stride=1, padding=POOL // 2).squeeze(1)


def observed_attention(
    query: torch.Tensor, key: torch.Tensor, pad_count: torch.Tensor, window: int, scaling: float
) -> torch.Tensor:
    """``[B, n]`` attention the last ``window`` prompt queries pay each token (all heads, max-pooled)."""
    return pooled_attention(window_attention(query, key, pad_count, window, scaling))


def novelty_score(chunk: Chunk, basis_k: torch.Tensor, basis_v: torch.Tensor) -> torch.Tensor:
    """``[n]`` energy of each token's K and V outside the bases ``[r, W]`` (each side over its mean)."""
    score = torch.zeros(chunk.size, device=chunk.x_k.device)
    for x, basis in ((chunk.x_k, basis_k), (chunk.x_v, basis_v)):
        residual = x - (x @ torch.linalg.pinv(basis)) @ basis
        energy = residual.square().sum(1)
        if chunk.tp is not None:  # all-reduced: the energy over every head's columns (each rank holds some)
            energy = chunk.tp.all_reduce(energy)
        score += energy / energy.mean().clamp_min(1e-12)
    return score


def percentile(x: torch.Tensor) -> torch.Tensor:
    """Rank of each entry in ``[0, 1]``; ties share the lowest rank (so a constant signal says nothing)."""
    ordered = x.sort().values
    return torch.searchsorted(ordered, x.contiguous()).float() / max(x.numel() - 1, 1)


def router_score(chunk: Chunk, novelty: torch.Tensor | None) -> torch.Tensor:
    """``[n]`` importance: the best percentile over the signals; sinks above everything."""
    signals = [percentile(chunk.attention)]
    if novelty is not None:
        signals.append(percentile(novelty))
    if chunk.content is not None:
        signals.append(percentile(chunk.content))
    score = torch.stack(signals).amax(0) + 1e-3 * signals[0]  # attention breaks ties
    if chunk.sink is not None:
        score = torch.where(chunk.sink, torch.full_like(score, 3.0), score)
    return score


def protected(chunk: Chunk, method: DepthWeave) -> torch.Tensor | None:
    """``[n]`` bool: the tokens ``protect`` keeps exact (the highest :func:`retrievable_scores`, at most
    ``protect`` of the chunk, positive scores only), or ``None``. With ``protect_names`` every named value
    (scores of :data:`NAMED` and above) is kept whole even past that fraction, up to twice it: the budget
    pays for the extra rows as for the others. ``protect_records``' fields rank below named values and above
    every other token, inside the fraction (none in a prompt of records throughout: :data:`RECORD_SHARE`)."""
    if not method.protect or chunk.retrievable is None:
        return None
    score = chunk.retrievable
    count = round(method.protect * chunk.size)
    if method.protect_names > 0:
        count = min(max(count, int((score >= NAMED).sum())), 2 * count)
    count = min(count, int((score > 0).sum()))
    keep = torch.zeros(chunk.size, dtype=torch.bool, device=score.device)
    if count > 0:
        keep[score.topk(count).indices] = True
    return keep


def make_plan(chunk: Chunk, novelty: torch.Tensor | None, method: DepthWeave) -> Plan:
    """Assign every chunk token a kind: exact row, high / mid / low rank bucket, or evicted."""
    n = chunk.size
    device = chunk.slots.device
    kind = torch.full((n,), MID, dtype=torch.int64, device=device)
    keep = protected(chunk, method)
    if not method.router:
        if method.residuals and chunk.sink is not None:
            kind[chunk.sink] = EXACT
        if keep is not None:
            kind[keep] = EXACT
        return Plan(kind)
    order = router_score(chunk, novelty).argsort(descending=True, stable=True)
    sinks = int(chunk.sink.sum()) if chunk.sink is not None else 0
    exact = max(round(method.residual_tokens * n), sinks) if method.residuals else 0
    rest = n - exact
    evicted = int(method.evict * rest)
    kept = rest - evicted  # bucket fractions are of the factorized (kept) tokens
    hi = round(method.hi_tokens * kept)
    lo = min(round(method.lo_tokens * kept), kept - hi)
    kind[order[:exact]] = EXACT
    kind[order[exact : exact + hi]] = HI
    if evicted:
        kind[order[n - evicted :]] = EVICTED
    if lo > 0:
        kind[order[n - evicted - lo : n - evicted]] = LO
    if keep is not None:
        kind[keep] = EXACT
    return Plan(kind)


def content_scores(
    prompt_ids: torch.Tensor | None, tokenizer: Any, slots: torch.Tensor, rows: int
) -> torch.Tensor | None:
    """``[B, c]`` token-content signal from ``prompt_ids`` (``[n]`` or ``[B, n]``), else ``None``.

    ``prompt_ids`` and ``tokenizer`` are what the cache saw (``cache.context``: the ids of every forward pass,
    the tokenizer ``load_model`` returned or ``make_cache(..., tokenizer=)`` gave). In-prompt rarity
    (``1 / count``) everywhere; with a tokenizer also +1 for tokens with digits, +0.5 for capitalised ones
    (names, entities). Slots past the given ids score 0.
    """
    if prompt_ids is None:
        return None
    classes = token_classes(tokenizer) if tokenizer is not None else None

    def score(unique: torch.Tensor, inverse: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        rarity = 1.0 / counts[inverse].float()
        if classes is None:
            return rarity
        return rarity + classes.lookup(unique)[:, 1].to(slots.device)[inverse]

    return _per_token(prompt_ids, slots, rows, score)


def _per_token(
    prompt_ids: Any,
    slots: torch.Tensor,
    rows: int,
    score: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``[B, c]`` a per-token signal of the prompt ids (``[n]`` or ``[B, n]``) at ``slots``: ``score(unique,
    inverse, counts)`` of each row's ``torch.unique`` gives ``[n]``; slots past the ids score 0."""
    ids = torch.as_tensor(prompt_ids, device=slots.device)
    ids = ids.view(1, -1).expand(rows, -1) if ids.dim() == 1 or ids.shape[0] == 1 else ids
    out = torch.zeros(rows, slots.numel(), device=slots.device)
    inside = slots < ids.shape[1]
    for b in range(rows):
        unique, inverse, counts = torch.unique(ids[b], return_inverse=True, return_counts=True)
        out[b, inside] = score(unique, inverse, counts)[slots[inside]]
    return out


def _sentence_end(token: str | None) -> float:
    """1.0 when ``token`` ends a sentence or a line (``.``, ``?``, ``!``, ``;`` or a newline in it)."""
    text = token or ""
    return 1.0 if any(c in text for c in ".?!;\nĊ") else 0.0


def _word_start(token: str | None) -> float:
    """1.0 when ``token`` begins a word: a space or newline (byte-level ``Ġ`` / ``Ċ``, SentencePiece ``▁``)
    followed by a letter."""
    text = token or ""
    rest = text.lstrip("Ġ▁ Ċ\n")
    return 1.0 if len(rest) < len(text) and rest[:1].isalpha() else 0.0


def _content_flag(token: str | None) -> float:
    text = (token or "").lstrip("Ġ▁ ")
    if any(c.isdigit() for c in text):
        return 1.0
    return 0.5 if text[:1].isupper() else 0.0


# what :func:`retrievable_scores` reads of a token's text, before its in-prompt count is known
DIGITS, IDENTIFIER, WORD, OTHER = 0, 1, 2, 3


class TokenClasses:
    """What the content rules read of each token id's text, converted once per tokenizer and id.

    ``lookup(ids)`` gives ``[u, 4]``: the :data:`DIGITS` / :data:`IDENTIFIER` / :data:`WORD` / :data:`OTHER`
    class of each id (what :func:`retrievable_scores` reads), its content flag (:func:`content_scores`),
    whether it starts a word (a space or newline, then a letter: ``protect_names`` counts a value's name in
    words) and whether it ends a sentence (``protect_records`` reads a record's fields up to there).
    Ids seen before are read from a table; only new ones go through ``tokenizer.convert_ids_to_tokens``, so a
    decode step or a second prompt costs no tokenizer calls.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # [vocab so far, 4] float: class, content flag, word start, sentence end
        self.table = torch.zeros(0, 4)
        self.known = torch.zeros(0, dtype=torch.bool)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """``[u, 4]`` class, content flag, word start and sentence end of each of ``ids`` (``[u]`` int, on any
        device; result on CPU)."""
        ids = ids.detach().to("cpu", torch.int64)
        if ids.numel() == 0:
            return torch.zeros(0, 4)
        top = int(ids.max()) + 1
        if top > self.known.numel():
            grow = top - self.known.numel()
            self.table = torch.cat([self.table, torch.zeros(grow, 4)])
            self.known = torch.cat([self.known, torch.zeros(grow, dtype=torch.bool)])
        new = ids[~self.known[ids]].unique()
        if new.numel():
            tokens = self.tokenizer.convert_ids_to_tokens(new.tolist())
            self.table[new] = torch.tensor(
                [[_token_class(t), _content_flag(t), _word_start(t), _sentence_end(t)] for t in tokens]
            )
            self.known[new] = True
        return self.table[ids]


_CLASSES: weakref.WeakKeyDictionary[Any, TokenClasses] = weakref.WeakKeyDictionary()


def token_classes(tokenizer: Any) -> TokenClasses:
    """The :class:`TokenClasses` of ``tokenizer`` (one per tokenizer, kept as long as the tokenizer lives)."""
    if isinstance(tokenizer, TokenClasses):
        return tokenizer
    try:
        classes = _CLASSES.get(tokenizer)
    except TypeError:  # not weak-referenceable or not hashable: built per call
        return TokenClasses(tokenizer)
    if classes is None:
        classes = _CLASSES[tokenizer] = TokenClasses(tokenizer)
    return classes


RETRIEVABLE_SPAN = 2
"""Neighbours on each side of a digit token that share its protection (the separators and unit of a number,
a UUID's dashes, the key word right before ``: 1234``), at half its score."""


def retrievable_scores(
    prompt_ids: torch.Tensor | None,
    tokenizer: Any,
    slots: torch.Tensor,
    rows: int,
    names: int = 0,
    records: int = 0,
) -> torch.Tensor | None:
    """``[B, c]`` how much each prompt token looks like a value a reader later asks for, question-agnostic;
    ``None`` without the prompt ids and a tokenizer (``cache.context``, as for :func:`content_scores`).

    Scores: 2 for tokens with digits (numbers, dates, UUID and hex pieces: most tokenizers split them into
    short pieces, each carrying part of the value), 1 for identifier-like tokens that occur at most 3 times in
    the prompt (``snake_case`` or ``camelCase`` pieces, capitalised or all-caps names), 0.5 for other words
    of 4+ letters that occur once; neighbours within :data:`RETRIEVABLE_SPAN` of a digit token get at least
    half its score, so a value survives with its separators. Slots past the given ids score 0.

    ``names > 0`` (DepthWeave's ``protect_names``): a value of :data:`LONG_VALUE` or more digit tokens in a
    row scores 3, above years and section numbers, and the tokens before it back to the ``names``-th word
    start (with ``names=2``: ``painstaking-loggia is: `` before ``8579151``) 2.5, above any other digit: what
    tells one such value from another of the same shape is the name a question asks it by.

    ``records > 0`` (DepthWeave's ``protect_records``): the fields of a repeated record score :data:`RECORD`
    plus :data:`RECORD_STEP` per occurrence of its phrase (a record type seen more often first; below
    :data:`NAMED`, above any digit), whatever their characters — the tokens after a phrase of ``records`` or more tokens that recurs 2 to
    :data:`RECORD_COUNT` times in the prompt and is followed by something different each time, up to the end of
    the sentence (``One of the special magic words for`` | ``painstaking-loggia is: window`` | ``.``); see
    :func:`_record_fields`. A prompt whose fields (those not already named values) are more than
    :data:`RECORD_SHARE` of its tokens reads as records throughout (code, reference docs) and has none singled
    out.
    """
    if prompt_ids is None or tokenizer is None:
        return None
    classes = token_classes(tokenizer)

    def score(unique: torch.Tensor, inverse: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        table = classes.lookup(unique).to(slots.device)
        kind = table[:, 0]
        counts = counts.to(slots.device)
        flags = torch.where(kind == DIGITS, 2.0, 0.0)
        flags = torch.where((kind == IDENTIFIER) & (counts <= 3), 1.0, flags)
        flags = torch.where((kind == WORD) & (counts == 1), 0.5, flags)
        value = flags[inverse]
        digits = (value >= 2.0).float().view(1, 1, -1)
        near = F.max_pool1d(digits, 2 * RETRIEVABLE_SPAN + 1, stride=1, padding=RETRIEVABLE_SPAN).view(-1)
        value = torch.maximum(value, near)  # neighbours of a digit token: 1.0 (half of 2)
        if names > 0:
            value = _named_values(value, digits.view(-1) > 0, table[:, 2][inverse] > 0, names)
        if records > 0:
            seen = _record_fields(inverse, table[:, 3][inverse] > 0, records).to(value.dtype)
            contested = (seen > 0) & (value < NAMED)  # fields that would take rows from the other rules
            if contested.float().mean() <= RECORD_SHARE:  # past it the whole prompt reads as records
                # records whose phrase recurs more first, then what the other rules rank higher
                field = RECORD + RECORD_STEP * seen + 0.001 * value
                value = torch.where(seen > 0, torch.maximum(value, field), value)
        return value

    return _per_token(prompt_ids, slots, rows, score)


LONG_VALUE = 5
"""Digit tokens in a row from which ``protect_names`` treats a number as a value with a name (longer than a
year or a section number)."""

NAMED = 2.5
"""The lowest :func:`retrievable_scores` score of a named value's tokens (its name; the value scores 3)."""

RECORD = 2.2
"""The base :func:`retrievable_scores` score of a record's fields (``protect_records``): above every digit
token, below named values, so they take the first of ``protect``'s rows but never rows past its fraction."""

RECORD_STEP = 0.015
"""What each occurrence of a record's phrase adds to its fields' score (at most :data:`RECORD_COUNT`: 2.44)."""


def _named_values(
    value: torch.Tensor, digit: torch.Tensor, word_start: torch.Tensor, names: int
) -> torch.Tensor:
    """``value`` with every run of :data:`LONG_VALUE`+ digit tokens raised to 3 and its name (the tokens before
    it, back to the ``names``-th token that starts a word) to 2.5 (:func:`retrievable_scores`)."""
    n = value.numel()
    flags = digit.tolist()
    starts = word_start.tolist()
    out = value.clone()
    i = 0
    while i < n:
        if not flags[i]:
            i += 1
            continue
        j = i
        while j < n and flags[j]:
            j += 1
        if j - i >= LONG_VALUE:
            out[i:j] = 3.0
            first, seen = i, 0
            while first > 0 and seen < names:
                first -= 1
                seen += int(starts[first])
            out[first:i] = torch.clamp(out[first:i], min=NAMED)
        i = j
    return out


RECORD_COUNT = 16
"""The most times a record's phrase may recur (``protect_records``): more is boilerplate, not a record."""

RECORD_PHRASE = 32
"""The longest recurring phrase read as a record's template (``protect_records``): longer runs are repeated text."""

RECORD_SHARE = 0.03
"""The largest share of a prompt's tokens that may be record fields (``protect_records``; fields that are named
values already do not count): past it the prompt reads as records throughout (code, reference docs: 3.8-8.7 %
of their tokens on the eval's prompts, against 0.3-2.1 % for prose with a few facts planted in it;
``benchmarks/depthweave_record_share.py``) and no field is singled out: its rows go to what the other rules rank."""

RECORD_SPAN = 16
"""The most tokens of a record's fields after its phrase (``protect_records``), when no sentence ends sooner."""


def _record_fields(seq: torch.Tensor, sentence_end: torch.Tensor, length: int) -> torch.Tensor:
    """``[n]`` int: for each token of a repeated record's fields in ``seq`` (``[n]`` token ids, any integer
    coding) how many times its record's phrase occurs; 0 elsewhere.

    A record's phrase is a run of windows of ``length`` tokens each recurring 2 to :data:`RECORD_COUNT` times,
    at most :data:`RECORD_PHRASE` tokens long; the run ends where the occurrences go different ways, and the
    fields are the tokens from there up to the first that ends a sentence (``sentence_end``) or starts another
    recurring window, at most :data:`RECORD_SPAN`; fields that do not reach a sentence's end there are not a
    record's (prose that happens to repeat a phrase goes on)."""
    n = seq.numel()
    fields = torch.zeros(n, dtype=torch.int64, device=seq.device)
    if length < 1 or n <= length:
        return fields
    windows = seq.unfold(0, length, 1)
    _, inverse, counts = torch.unique(windows, dim=0, return_inverse=True, return_counts=True)
    seen = counts[inverse]
    recurring = (seen >= 2) & (seen <= RECORD_COUNT)  # [n - length + 1], by window start
    edge = torch.zeros(1, dtype=torch.bool, device=seq.device)
    firsts = (recurring & ~torch.cat([edge, recurring[:-1]])).nonzero().view(-1).tolist()
    lasts = (recurring & ~torch.cat([recurring[1:], edge])).nonzero().view(-1).tolist()
    # token j lies inside a recurring window when one starts in [j - length + 1, j]
    starts = torch.cat([torch.zeros(1, device=seq.device), recurring.float().cumsum(0)])
    upto = starts[torch.arange(1, n + 1, device=seq.device).clamp(max=recurring.numel())]
    since = starts[(torch.arange(n, device=seq.device) - length + 1).clamp(min=0, max=recurring.numel())]
    ends = sentence_end.tolist()
    stop = (sentence_end | (upto > since)).tolist()
    occurrences = seen.tolist()
    for first, last in zip(firsts, lasts, strict=True):
        if last - first + length > RECORD_PHRASE:
            continue
        begin = j = last + length
        while j < min(n, begin + RECORD_SPAN) and not stop[j]:
            j += 1
        if begin < j < n and ends[j]:  # a record's fields end its sentence
            fields[begin:j] = occurrences[last]
    return fields


def _token_class(token: str | None) -> int:
    """:data:`DIGITS`, :data:`IDENTIFIER`, :data:`WORD` (4+ letters) or :data:`OTHER`: what
    :func:`_retrievable_flag` reads of ``token`` before its count."""
    text = (token or "").lstrip("Ġ▁ Ċ")
    if any(c.isdigit() for c in text):
        return DIGITS
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return OTHER
    if (
        "_" in text
        or (text[:1].isupper() and len(letters) >= 2)
        or (any(c.isupper() for c in text[1:]) and any(c.islower() for c in text))
    ):
        return IDENTIFIER
    return WORD if len(letters) >= 4 else OTHER
