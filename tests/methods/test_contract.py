"""The contract every registered method keeps: one test matrix over the registry.

Invariants: options are validated with clear errors; generate() works on every supported architecture with
batch 2 and left padding; the prefix pattern (prefill the context, then generate with context + question)
continues exactly where the prefill stopped; ``nbytes`` is what the tensors hold; compression happens;
memory stays bounded where promised; exact methods equal DynamicCache.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvweave
import kvweave.methods  # noqa: F401  (fills the registry)
from conftest import tiny_model
from kvweave._compat import cache_kwarg
from kvweave.registry import METHODS, parse_method

NAMES = sorted(METHODS)


def _method(name: str):
    return parse_method(name, **METHODS[name].test_options)


def _generate(model, ids, mask, cache, new_tokens=6):
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        min_new_tokens=new_tokens,
        **{cache_kwarg(model): cache},
    )
    return out[:, ids.shape[1] :]


@pytest.mark.parametrize("name", NAMES)
def test_unknown_option_rejected(name):
    with pytest.raises(ValueError, match="unknown option"):
        parse_method(f"{name}:no_such_option=1")


@pytest.mark.parametrize("name", NAMES)
def test_invalid_options_rejected_with_name(name):
    for options, option_name in METHODS[name].invalid_options:
        with pytest.raises(ValueError, match=option_name):
            parse_method(name, **options)


@pytest.mark.parametrize("name", NAMES)
def test_describe_lists_options(name):
    info = METHODS[name].describe()
    assert info["name"] == name and info["summary"]
    assert all(o["help"] for o in info["options"] + info["tuning"]), "every option needs a help text"
    assert len(info["options"]) <= 12, f"{name}: more options than a user chooses; mark the rest tuning=True"
    assert set(METHODS[name].budget_options) <= {o["name"] for o in info["options"]}, (
        "budgets are user options"
    )


@pytest.mark.parametrize("name", NAMES)
def test_the_ranges_kvweave_methods_shows_are_the_ones_enforced(name):
    """Each shown range is recorded from the method's own checks: a value just outside it is refused with a
    line naming the option, a value of a listed choice is taken."""
    info = METHODS[name].describe()
    shown = [o for o in info["options"] + info["tuning"] if o["range"]]
    if name != "full":
        assert shown, f"{name}: no option shows its range"
    for option in shown:
        text, default = option["range"], option["default"]
        if text.startswith("one of "):
            first = text.removeprefix("one of ").split(", ")[0]
            parse_method(name, **{option["name"]: first})
            with pytest.raises(ValueError, match=option["name"]):
                parse_method(name, **{option["name"]: "no-such-choice" if isinstance(default, str) else 999})
            continue
        low = text.strip("[]").split(", ")[0]
        if low == "-inf":
            continue
        below = float(low) - (1 if isinstance(default, int) and not isinstance(default, bool) else 0.01)
        value = int(below) if isinstance(default, int) else below
        with pytest.raises(ValueError, match=option["name"]):
            parse_method(name, **{option["name"]: value})


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("name", NAMES)
def test_generate_batch_left_padding(name, arch):
    model = tiny_model(arch)
    torch.manual_seed(1)
    ids = torch.randint(3, 150, (2, 40))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    cache = kvweave.make_cache(_method(name), model)
    new = _generate(model, ids, mask, cache)
    assert new.shape == (2, 6)
    assert cache.get_seq_length() == 40 + 5  # the last generated token is not fed back
    # batch rows equal their own single-row runs (batch alignment)
    if METHODS[name].supports_batch:
        single = _generate(model, ids[1:, 7:], mask[1:, 7:], kvweave.make_cache(_method(name), model))
        assert torch.equal(new[1], single[0])


@pytest.mark.parametrize("name", NAMES)
def test_prefix_pattern_continues_exactly(name):
    """Prefill a context, then generate(context + question) == feeding the question by hand."""
    model = tiny_model("llama")
    torch.manual_seed(2)
    context, question = torch.randint(3, 150, (1, 48)), torch.randint(3, 150, (1, 7))
    full_ids = torch.cat([context, question], dim=1)

    cache = kvweave.make_cache(_method(name), model)
    with torch.no_grad():
        model(context, **{cache_kwarg(model): cache})
    via_generate = _generate(model, full_ids, torch.ones_like(full_ids), cache)

    cache = kvweave.make_cache(_method(name), model)
    by_hand, step = [], question
    with torch.no_grad():
        model(context, **{cache_kwarg(model): cache})
        for _ in range(6):
            logits = model(step, **{cache_kwarg(model): cache}).logits[:, -1]
            step = logits.argmax(-1, keepdim=True)
            by_hand.append(step)
    assert torch.equal(via_generate, torch.cat(by_hand, dim=1))


@pytest.mark.parametrize("name", NAMES)
def test_nbytes_counts_held_tensors_and_compresses(name):
    model = tiny_model("llama")
    cache = kvweave.make_cache(_method(name), model)
    ids = torch.randint(3, 150, (1, 64))
    with torch.no_grad():
        model(ids, **{cache_kwarg(model): cache})
    held = (
        cache.nbytes()
    )  # that it counts what is held: test_nbytes_equals_an_independent_walk_of_every_tensor
    assert held > 0
    full_fp32 = cache.full_kv_bytes(bits=32)
    if METHODS[name].exact:
        assert held == full_fp32
    elif not METHODS[name].compresses:  # position-only methods (pi): the exact cache + a little bookkeeping
        assert held <= full_fp32 * 1.01
    else:
        assert held < full_fp32, f"{name} holds {held} B, the exact fp32 cache {full_fp32} B"


def reachable_tensors(cache) -> list[torch.Tensor]:
    """Every tensor reachable from the cache's layers and its layer groups, found by walking attributes,
    containers and dataclasses (not through the model-built parts: modules, the method, RoPE tables)."""
    from kvweave.cache import CacheContext, KVCache
    from kvweave.ops.rope import RopeTable, Rotary
    from kvweave.registry import Method

    skip = (torch.nn.Module, Method, KVCache, CacheContext, RopeTable, Rotary, torch.device, torch.dtype)
    visited: set[int] = set()
    found: list[torch.Tensor] = []

    def walk(obj) -> None:
        if id(obj) in visited or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
            return
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, skip):
            return
        elif isinstance(obj, dict):
            for key, value in obj.items():
                walk(key)
                walk(value)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for item in obj:
                walk(item)
        elif hasattr(obj, "__dict__"):
            walk(vars(obj))

    for layer in cache.layers:
        walk(layer)
    walk(cache.context.groups)
    if getattr(cache.method, "recall", 0) > 0:  # DepthWeave's recall: its state and the ids it reads
        walk(cache.context.decode_state)
        walk(cache.context.prompt_ids)
    return found


@pytest.mark.parametrize("name", NAMES)
def test_nbytes_equals_an_independent_walk_of_every_tensor(name):
    """``cache.nbytes()`` (hand-written per method) against the storages of every reachable tensor, after a
    prefill and after decoding past a fold / tier move."""
    model = tiny_model("llama")
    cache = kvweave.make_cache(_method(name), model)
    ids = torch.randint(3, 150, (1, 64))
    _generate(model, ids, torch.ones_like(ids), cache, new_tokens=24)
    storages: dict[int, int] = {}
    for tensor in reachable_tensors(cache):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
    walked = sum(storages.values())
    assert cache.nbytes() == walked, f"{name}: nbytes() says {cache.nbytes()} B, its tensors hold {walked} B"


STORING = [n for n in NAMES if "storage" in METHODS[n].__dataclass_fields__]


@pytest.mark.parametrize("name", STORING)
def test_exact_tokens_held_at_16_bits_on_a_float32_model(name):
    """Equal bytes: ``storage=auto`` (the default) holds kept tokens at 16 bits on a float32 model, as a
    deployed 16-bit cache would, and ``storage=model`` keeps the model's width (the rows before spec 3)."""
    model = tiny_model("llama")
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    ids = torch.randint(3, 150, (1, 64))
    held = {}
    for storage in ("auto", "model"):
        cache = kvweave.make_cache(parse_method(name, **METHODS[name].test_options, storage=storage), model)
        with torch.no_grad():
            model.generate(
                ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, **{cache_kwarg(model): cache}
            )
        # DK-Cache's page summaries are bounds of q·k (float32 so they stay bounds), not tokens
        far = [getattr(layer, "far", None) for layer in cache.layers]
        bounds = {id(getattr(f, n, None)) for f in far for n in ("page_min", "page_max")}
        wide = [
            tuple(t.shape)
            for t in reachable_tensors(cache)
            if id(t) not in bounds
            and t.dtype in (torch.float32, torch.float64)
            and t.dim() >= 2
            and t.shape[-1] == head_dim
            and t.shape[-2] > 1
        ]
        held[storage] = (cache.nbytes(), wide)
    assert not held["auto"][1], f"{name}: float32 token rows held with storage=auto: {held['auto'][1]}"
    assert held["model"][1], f"{name}: storage=model holds no token rows at the model's width"
    assert held["auto"][0] < held["model"][0]


@pytest.mark.parametrize("name", [n for n in NAMES if METHODS[n].bounded_memory])
def test_memory_bounded_during_long_decoding(name):
    model = tiny_model("llama")
    cache = kvweave.make_cache(_method(name), model)
    ids = torch.randint(3, 150, (1, 40))
    _generate(model, ids, torch.ones_like(ids), cache, new_tokens=10)
    after_short = cache.nbytes()
    _generate(
        model, torch.randint(3, 150, (1, 40)), None, cache := kvweave.make_cache(_method(name), model), 60
    )
    assert cache.nbytes() <= after_short * 1.05


@pytest.mark.parametrize("name", [n for n in NAMES if METHODS[n].exact])
def test_exact_methods_equal_dynamic_cache(name):
    model = tiny_model("qwen2")
    ids = torch.randint(3, 150, (2, 30))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=5,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    ref = model.generate(ids, **kwargs, **{cache_kwarg(model): DynamicCache(config=model.config)})
    out = model.generate(ids, **kwargs, **{cache_kwarg(model): kvweave.make_cache(name, model)})
    assert torch.equal(ref.sequences, out.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits, strict=True)) <= 1e-5


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("name", NAMES)
def test_shared_prefill_replay_equals_real_prefill(name, arch):
    """The evaluation's shared prefill leaves each cache exactly as a real forward pass would (for every
    method that says its prefill of this prompt is exact)."""
    from kvweave.eval.prefill import record_prefill, replay_prefill

    model = tiny_model(arch)
    if not _method(name).replays_prefill(model.config, 52):
        pytest.skip(f"{name} changes prefill attention")
    torch.manual_seed(4)
    context, question = torch.randint(3, 150, (1, 52)), torch.randint(3, 150, (1, 6))
    full_ids = torch.cat([context, question], dim=1)

    real = kvweave.make_cache(_method(name), model)
    with torch.no_grad():
        model(context, **{cache_kwarg(model): real})
    replayed = kvweave.make_cache(_method(name), model)
    replay_prefill(replayed, record_prefill(model, context), context)
    assert replayed.nbytes() == real.nbytes()
    if METHODS[name].reads_token_ids:  # handed over as the forward pass hands them
        assert torch.equal(replayed.context.prompt_ids, real.context.prompt_ids)
    assert replayed.get_seq_length() == real.get_seq_length()
    assert torch.equal(_generate(model, full_ids, None, real), _generate(model, full_ids, None, replayed))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_chunked_prefill_recording_replays_as_the_whole_one(arch, tmp_path):
    """``record_prefill(chunk=N)`` (the prompt N tokens at a time, recorded into memory-mapped files) gives
    every replaying method the cache the whole-prompt recording gives: the same bytes and the same next-token
    logits up to the summation order of chunked attention; the spill files are gone from the folder at once."""
    from kvweave.eval.prefill import record_prefill, replay_prefill

    model = tiny_model(arch)
    torch.manual_seed(5)
    ids = torch.randint(3, 150, (2, 70))
    whole_logits: list[torch.Tensor] = []
    chunk_logits: list[torch.Tensor] = []
    whole = record_prefill(model, ids, logits=whole_logits)
    seen: list[tuple[int, int]] = []
    chunked = record_prefill(
        model, ids, logits=chunk_logits, chunk=16, spill=tmp_path, progress=lambda d, t: seen.append((d, t))
    )
    assert seen == [(16, 70), (32, 70), (48, 70), (64, 70), (70, 70)]
    assert list(tmp_path.iterdir()) == []
    torch.testing.assert_close(chunk_logits[0], whole_logits[0], atol=1e-4, rtol=1e-4)
    nxt = torch.randint(3, 150, (2, 1))
    for name in NAMES:
        if not _method(name).replays_prefill(model.config, 70):
            continue
        caches = [kvweave.make_cache(_method(name), model) for _ in range(2)]
        for cache, recorded in zip(caches, (whole, chunked), strict=True):
            replay_prefill(cache, recorded, ids)
        assert caches[0].nbytes() == caches[1].nbytes(), name
        assert caches[0].get_seq_length() == caches[1].get_seq_length() == 70, name
        with torch.no_grad():
            a, b = (model(nxt, **{cache_kwarg(model): c}).logits for c in caches)
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-3, msg=name)


def test_a_chunked_recording_refuses_padding_and_bad_chunks():
    from kvweave.eval.prefill import record_prefill

    model = tiny_model("llama")
    ids = torch.randint(3, 150, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :3] = 0
    with pytest.raises(ValueError, match="without padding.*--prefill-chunk 0"):
        record_prefill(model, ids, attention_mask=mask, chunk=8)
    with pytest.raises(ValueError, match="--prefill-chunk must be 0"):
        record_prefill(model, ids, chunk=-1)


@pytest.mark.parametrize("name", [n for n in NAMES if not METHODS[n].exact])
def test_nan_in_prompt_keys_is_refused_with_the_way_out(name):
    """A prompt whose keys or values hold NaN/Inf (an overflowing model) is refused, never compressed."""
    model = tiny_model("llama")
    cache = kvweave.make_cache(_method(name), model)
    layer = cache.layers[0]
    heads, dim = cache.num_kv_heads, cache.head_dim
    key, value = torch.randn(1, heads, 8, dim), torch.randn(1, heads, 8, dim)
    bad_key = key.clone()
    bad_key[0, 0, 3, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN/Inf.*float32 or bfloat16"):
        layer.update(bad_key, value, 0)
    bad_value = value.clone()
    bad_value[0, 1, 5, 0] = float("inf")
    with pytest.raises(ValueError, match=f"{name}: layer 0"):
        kvweave.make_cache(_method(name), model).layers[0].update(key, bad_value, 0)


def test_renamed_options_read_under_their_current_names():
    """One budget vocabulary: DK-Cache's per-step budget is ``attended`` (not ``ratio``, which evictors use for
    what they hold) and DepthWeave's is ``compression``; old specs (committed result rows) still read."""
    from kvweave.report.specs import canonical_spec

    assert parse_method("dkcache:ratio=0.25").attended == 0.25
    assert parse_method("dkcache:ratio=0.25").spec() == "dkcache:attended=0.25"
    assert parse_method("depthweave", target_ratio=4.0).compression == 4.0
    assert (
        canonical_spec("dkcache:ratio=0.125,decouple=False,pages=8")
        == "dkcache:attended=0.125,decouple=False,pages=8"
    )
    assert canonical_spec("depthweave:target_ratio=16.0") == "depthweave:compression=16.0"
    assert canonical_spec("snapkv:ratio=0.25") == "snapkv:ratio=0.25"
    assert canonical_spec("kvpress:SnapKV:0.5") == "kvpress:SnapKV:0.5"
    for name in NAMES:
        cls = METHODS[name]
        fields = {f for f in cls.__dataclass_fields__}
        assert set(cls.budget_options) <= fields, f"{name}: budget_options names options it lacks"
        assert not set(cls.renamed_options) & fields, f"{name}: a renamed option still exists"


def test_old_rows_keep_their_meaning_when_defaults_change():
    """A row written before the current defaults reads as what it measured (legacy defaults made explicit)."""
    from kvweave.report.specs import canonical_spec

    assert (
        canonical_spec("dkcache:ratio=0.125", legacy=True)
        == "dkcache:attended=0.125,decouple=True,bits=16,storage=model"
    )
    assert (
        canonical_spec("depthweave", legacy=True)
        == "depthweave:protect=0.0,protect_names=0,protect_records=0,decode_tokens=0,recall=0,quote=0,quote_after=48"
    )
    assert canonical_spec("depthweave") == "depthweave"
    # spec version 4: DepthWeave protects retrievable-looking tokens; version-3 rows did not
    assert (
        canonical_spec("depthweave", version=3)
        == "depthweave:protect=0.0,protect_names=0,protect_records=0,recall=0,quote=0,quote_after=48"
    )
    assert (
        canonical_spec(
            "depthweave:protect=0.02,protect_names=2,protect_records=6,recall=8,quote=3,quote_after=16",
            version=3,
        )
        == "depthweave"
    )
    # spec version 6: DepthWeave keeps long numbers' names exact; version-5 rows did not
    assert (
        canonical_spec("depthweave", version=5)
        == "depthweave:protect_names=0,protect_records=0,recall=0,quote=0,quote_after=48"
    )
    assert (
        canonical_spec("depthweave:protect_names=2,protect_records=6,recall=8", version=5)
        == "depthweave:quote=0,quote_after=48"
    )
    # spec version 7: DepthWeave keeps repeated records' fields exact; version-6 rows did not
    assert (
        canonical_spec("depthweave", version=6)
        == "depthweave:protect_records=0,recall=0,quote=0,quote_after=48"
    )
    assert (
        canonical_spec("depthweave:protect_records=6,recall=8", version=6)
        == "depthweave:quote=0,quote_after=48"
    )
    # spec version 8: DepthWeave rebuilds copied passages from their ids; version-7 rows did not
    assert canonical_spec("depthweave", version=7) == "depthweave:recall=0,quote=0,quote_after=48"
    assert canonical_spec("depthweave:recall=8", version=7) == "depthweave:quote=0,quote_after=48"
    assert (
        canonical_spec("depthweave:protect_records=0", version=8)
        == "depthweave:protect_records=0,quote=0,quote_after=48"
    )
    assert canonical_spec("xkv", version=7) == "xkv"  # xKV never had recall
    # spec version 9: DepthWeave rebuilds what a question fed after its document quotes; version-8 rows did not
    assert canonical_spec("depthweave", version=8) == "depthweave:quote=0,quote_after=48"
    assert canonical_spec("depthweave:quote=3,quote_after=16", version=8) == "depthweave"
    assert canonical_spec("depthweave:quote=3", version=8) == "depthweave:quote_after=48"
    assert canonical_spec("depthweave:quote=0", version=9) == "depthweave:quote=0"
    assert canonical_spec("xkv", version=8) == "xkv"  # xKV never quotes
    # spec version 3: exact tokens at 16 bits on float32 models; version-2 rows held them at the model's width
    assert canonical_spec("window:ratio=0.25", version=2) == "window:ratio=0.25,storage=model"
    assert canonical_spec("window:ratio=0.25", version=3) == "window:ratio=0.25"
    assert canonical_spec("dkcache", version=2) == "dkcache:storage=model"
    recorded = parse_method("dkcache:attended=0.25").options()
    assert canonical_spec("dkcache:attended=0.25", recorded) == "dkcache:attended=0.25"
    old = {**recorded, "bits": 16, "decouple": True}
    old["ratio"] = old.pop("attended")
    del old["storage"]  # an option since spec version 3
    assert (
        canonical_spec("dkcache:ratio=0.25", old, legacy=True)
        == "dkcache:attended=0.25,decouple=True,bits=16,storage=model"
    )


@pytest.mark.parametrize("name", [n for n in NAMES if not METHODS[n].exact])
def test_a_filled_cache_refuses_another_batch_or_dtype(name):
    """A cache continues the batch it was filled with: another batch size or dtype is refused with the way
    out, never mixed in silently."""
    model = tiny_model("llama")
    cache = kvweave.make_cache(_method(name), model)
    with torch.no_grad():
        model(torch.randint(3, 150, (1, 40)), **{cache_kwarg(model): cache})
        with pytest.raises(ValueError, match="make a new cache"):
            model(torch.randint(3, 150, (2, 4)), **{cache_kwarg(model): cache})
    layer = next(layer for layer in cache.layers if hasattr(layer, "check_matches"))
    with pytest.raises(ValueError, match="torch.float16"):
        layer.check_matches(torch.zeros(1, 2, 1, 16, dtype=torch.float16))


@pytest.mark.parametrize("name", NAMES)
def test_every_per_row_tensor_is_declared_a_batch_field(name):
    """Row selection (beam search, batch repeats) reorders the tensors a layer declares per row, not whatever
    happens to be as long as the batch: after a batch-3 generate (3 matching no other dimension of the tiny
    model), every tensor of a layer whose first dimension is 3 is declared, and selection keeps them aligned."""
    model = tiny_model("llama")
    cache = kvweave.make_cache(_method(name), model)
    ids = torch.randint(3, 150, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                       **{cache_kwarg(model): cache})  # fmt: skip
    for layer in cache.layers:
        if not hasattr(layer, "batch_fields"):
            continue  # transformers' own layers (full, sliding windows)
        per_row = {
            k for k, v in vars(layer).items() if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == 3
        }
        assert per_row <= set(layer.batch_fields), (
            f"{type(layer).__name__}: undeclared {per_row - set(layer.batch_fields)}"
        )
    before = cache.nbytes()
    cache.reorder_cache(torch.tensor([2, 0, 1]))
    assert cache.nbytes() == before
    cache.batch_select_indices(torch.tensor([0, 2]))
    for layer in cache.layers:
        for field in getattr(layer, "batch_fields", ()):
            value = getattr(layer, field, None)
            if isinstance(value, torch.Tensor) and value.dim() and value.shape[0]:
                assert value.shape[0] == 2, (name, type(layer).__name__, field)
