"""One method, one behaviour: every path a user takes gives the same tokens and the same bytes.

Paths: ``make_cache`` + ``model.generate`` with the prompt handed over explicitly (``set_prompt``, the
reference), the same without (the ids reach the cache from each forward pass), with the tokenizer found from
the model rather than given, the prefix pattern, and save -> load -> continue. The prompt holds digit and name
tokens so content-aware methods (DepthWeave's ``protect`` and router content) have something to read.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import kvweave
import kvweave.methods  # noqa: F401  (fills the registry)
from conftest import tiny_model
from kvweave._compat import cache_kwarg
from kvweave.prompt import remember_tokenizer
from kvweave.registry import METHODS, parse_method

NAMES = sorted(METHODS)
PROMPT_TOKENS, NEW_TOKENS, CONTEXT = 72, 6, 60


class Vocab:
    """A tokenizer's ``convert_ids_to_tokens`` over the tiny model's 160 ids: digits, names, words, ``Ġthe``."""

    def convert_ids_to_tokens(self, ids):
        return [self.word(i) for i in ids]

    @staticmethod
    def word(i: int) -> str:
        if i % 10 == 7:
            return str(i)  # a digit token
        if i % 10 == 3:
            return f"ĠName{i}"  # a capitalised name
        return "Ġharbour" if i % 10 == 5 else "Ġthe"


def _spec(name: str):
    options = dict(METHODS[name].test_options)
    if METHODS[name].reads_token_ids and "protect" in METHODS[name].__dataclass_fields__:
        options["protect"] = 0.2  # enough exact rows at this length that the prompt's content decides them
    return parse_method(name, **options)


def _prompt() -> torch.Tensor:
    torch.manual_seed(5)
    ids = torch.randint(3, 150, (1, PROMPT_TOKENS))
    ids[0, 20:24] = torch.tensor([17, 27, 37, 47])  # a value the content rules look for
    return ids


def _generate(model, ids, cache):
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            **{cache_kwarg(model): cache},
        )
    return out[:, ids.shape[1] :], cache.nbytes()


def _prefill(model, ids, cache) -> None:
    with torch.no_grad():
        model(ids[:, :CONTEXT], **{cache_kwarg(model): cache})


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.mark.parametrize("name", NAMES)
def test_the_prompt_reaches_the_cache_without_set_prompt(name, model):
    ids, vocab = _prompt(), Vocab()
    reference = kvweave.make_cache(_spec(name), model, tokenizer=vocab)
    reference.set_prompt(ids, vocab)
    expected = _generate(model, ids, reference)

    by_itself = kvweave.make_cache(_spec(name), model, tokenizer=vocab)
    tokens, held = _generate(model, ids, by_itself)
    assert torch.equal(tokens, expected[0]) and held == expected[1], name
    if METHODS[name].reads_token_ids:  # what it saw: the prompt and the tokens generated after it
        assert torch.equal(by_itself.context.prompt_ids[:, :PROMPT_TOKENS], ids)
        assert by_itself.context.prompt_ids.shape[1] == PROMPT_TOKENS + NEW_TOKENS - 1


@pytest.mark.parametrize("name", NAMES)
def test_the_tokenizer_load_model_returned_is_found_from_the_model(name):
    model, ids, vocab = tiny_model("llama"), _prompt(), Vocab()
    given = _generate(model, ids, kvweave.make_cache(_spec(name), model, tokenizer=vocab))
    remember_tokenizer(model, vocab)  # what kvweave.load_model does
    found = _generate(model, ids, kvweave.make_cache(_spec(name), model))
    assert torch.equal(found[0], given[0]) and found[1] == given[1], name


@pytest.mark.parametrize("name", NAMES)
def test_the_prefix_pattern_reads_the_prompt_as_set_prompt_gives_it(name, model):
    ids, vocab = _prompt(), Vocab()
    reference = kvweave.make_cache(_spec(name), model, tokenizer=vocab)
    reference.set_prompt(ids, vocab)
    _prefill(model, ids, reference)
    expected = _generate(model, ids, reference)

    cache = kvweave.make_cache(_spec(name), model, tokenizer=vocab)
    _prefill(model, ids, cache)
    tokens, held = _generate(model, ids, cache)
    assert torch.equal(tokens, expected[0]) and held == expected[1], name


@pytest.mark.parametrize("name", NAMES)
def test_save_load_continue_equals_continuing_in_memory(name, tmp_path):
    model, ids, vocab = tiny_model("llama"), _prompt(), Vocab()
    remember_tokenizer(model, vocab)
    in_memory = kvweave.make_cache(_spec(name), model)
    _prefill(model, ids, in_memory)
    kvweave.save_cache(in_memory, model, tmp_path / "prefix.kv", prompt_ids=ids[:, :CONTEXT])
    expected = _generate(model, ids, in_memory)

    loaded, _ = kvweave.load_cache(tmp_path / "prefix.kv", model)
    tokens, held = _generate(model, ids, loaded)
    assert torch.equal(tokens, expected[0]) and held == expected[1], name


def test_content_rules_change_what_depthweave_keeps():
    """The paths above agree because the ids arrive, not because the content rules do nothing here: without
    the ids (``inputs_embeds``), DepthWeave keeps other rows and warns once."""
    model, ids, vocab = tiny_model("llama"), _prompt(), Vocab()
    with_ids = kvweave.make_cache(_spec("depthweave"), model, tokenizer=vocab)
    _prefill(model, ids, with_ids)
    blind = kvweave.make_cache(_spec("depthweave"), model, tokenizer=vocab)
    embeds = model.get_input_embeddings()(ids[:, :CONTEXT])
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        model(inputs_embeds=embeds, **{cache_kwarg(model): blind})
        model(inputs_embeds=embeds[:, :1], **{cache_kwarg(model): blind})  # a second pass: no second warning
    said = [w for w in caught if "inputs_embeds" in str(w.message)]
    assert len(said) == 1 and "cache.set_prompt" in str(said[0].message)
    assert blind.context.prompt_ids is None and with_ids.context.prompt_ids.shape[1] == CONTEXT
    step = ids[:, CONTEXT : CONTEXT + 1]
    with torch.no_grad():
        seeing = model(step, **{cache_kwarg(model): with_ids}).logits
        not_seeing = model(step, **{cache_kwarg(model): blind}).logits
    assert not torch.allclose(seeing, not_seeing), (
        "the content rules made no difference: the test shows nothing"
    )


def test_no_tokenizer_warns_once_with_the_way_out():
    model, ids = tiny_model("llama"), _prompt()
    cache = kvweave.make_cache(_spec("depthweave"), model)  # a random-config model: no folder, no tokenizer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _generate(model, ids, cache)
    said = [str(w.message) for w in caught if "no tokenizer" in str(w.message)]
    assert len(said) == 1 and "tokenizer=tokenizer" in said[0]


def test_restore_removes_the_hook():
    model, ids = tiny_model("llama"), _prompt()
    cache = kvweave.make_cache(_spec("depthweave"), model, tokenizer=Vocab())
    kvweave.restore(model)
    with torch.no_grad():
        model(ids, **{cache_kwarg(model): kvweave.make_cache("full", model)})
    assert cache.context.prompt_ids is None and not model.base_model._forward_pre_hooks
