"""kvweave's vLLM backend against vLLM's own CPU backend, in the vLLM venv (``make vllm-test``; docs/vllm.md).

Each engine runs in its own process (``benchmarks/vllm_bench.py``), one at a time. The main venv skips this
module (no vLLM there). The real-model tests need ``qwen2.5-coder-0.5b`` converted (``kvweave models pull``)
and are marked ``integration``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

# not plain "vllm": with tests/ on sys.path this folder is itself a namespace package named vllm
pytest.importorskip("vllm.v1.attention.backend", reason="vLLM is not installed (scripts/vllm_env.sh)")

import torch  # noqa: E402

from kvweave.ops.quantize import dequantize, quantize  # noqa: E402
from kvweave.vllm.backend import ENV_KERNEL  # noqa: E402
from kvweave.vllm.config import Basis, PageSlot, QuantSlot, VllmMethod, WeaveSlot, rope_cos_sin  # noqa: E402
from kvweave.vllm.drive import feed, slots_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "vllm_bench.py"
sys.path.insert(0, str(BENCH.parent))
from vllm_bench import agreement  # noqa: E402

HOME = Path(os.environ.get("KVWEAVE_HOME", Path.home() / ".cache" / "kvweave"))
QWEN = HOME / "models" / "qwen2.5-coder-0.5b"
SMOL = (
    HOME / "models" / "smollm2-135m"
)  # `make test` pulls it: the tiny model's tokenizer when qwen is absent
DATA = Path(os.environ.get("KVWEAVE_DATA", ROOT.parent / "shared" / "data"))  # evaluation data (essays)
TIE = 0.5  # a greedy mismatch is allowed only where vLLM's own top-2 logprobs are this close (see agreement)


def bench(*args: str, timeout: float = 1800, env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one ``vllm_bench.py`` subcommand (its own vLLM process) and return the JSON it wrote."""
    out = Path(args[args.index("--out") + 1])
    env = {
        **os.environ,
        **(env_extra or {}),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        "KVWEAVE_DATA": str(DATA),
    }
    run = subprocess.run(
        [sys.executable, str(BENCH), *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert run.returncode == 0, (
        f"vllm_bench {' '.join(args)} failed:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    )
    return json.loads(out.read_text())


# ------------------------------------------------------------------------------- layouts (no engine)


def test_slot_bytes_give_the_expected_capacity_ratio() -> None:
    bf16 = 2 * 64 * 2  # vLLM's slot: key + value of one head, bfloat16
    ratios = {bits: bf16 / QuantSlot.of(VllmMethod("quant", bits=bits), 64, 128).nbytes for bits in (8, 4, 2)}
    assert ratios[4] >= 3.5 and ratios[8] >= 1.85 and ratios[2] >= 6.0
    assert (
        PageSlot.of(64, torch.bfloat16, 128).nbytes == bf16 + 4
    )  # summaries cost 4 bytes a slot at 128 tokens


def test_one_write_spanning_more_blocks_than_the_residual_holds_keeps_them_all() -> None:
    """A prefill chunk writes every block of its prompt at once (here 5 blocks with room for 2 requests' rows):
    none of those rows may be reused within the write (the load benchmark's 1K-token prompts crashed vLLM's
    worker with a KeyError here at max_num_seqs=4)."""
    from kvweave.vllm.backend import KeyResidual

    residual = KeyResidual(heads=2, block_size=4, head_size=8, dtype=torch.float32, max_requests=1)
    blocks = torch.arange(5).repeat_interleave(4)
    offsets = torch.arange(4).repeat(5)
    key = torch.randn(20, 2, 8)
    assert residual.store(blocks, offsets, key) is None, "every token kept"
    rows = residual.rows_of(torch.arange(5))
    assert len(set(rows.tolist())) == 5, "every block of the write has its own row"
    assert torch.equal(residual.keys[rows[3], :, 2], key[3 * 4 + 2])
    residual.release(torch.arange(5))  # the blocks filled: their groups were quantized
    residual.store(
        torch.tensor([9]), torch.tensor([0]), torch.randn(1, 2, 8)
    )  # the next request reuses a row
    assert residual.keys.shape[0] <= 8


# ------------------------------------------------------------------------------- depthweave (no engine)


def test_weave_slot_holds_8x_and_full_rank_coordinates_round_trip() -> None:
    """The default per-layer DepthWeave slot is 32 bytes a head (8x a bfloat16 slot); at full rank and 8 bits
    the basis and the codes give the rows back to within a percent."""
    layout = WeaveSlot.of(VllmMethod("depthweave"), 64, 2, 128)
    assert layout.nbytes == 32 and VllmMethod("depthweave").slot_bytes(64, torch.bfloat16, 128, 2) == 32
    torch.manual_seed(0)
    x = torch.randn(300, 128) * torch.linspace(0.1, 5, 128) + 3
    basis = Basis.fit(x, 128)
    torch.testing.assert_close(basis.decode(basis.encode(x)), x, rtol=0, atol=2e-2)
    wide = WeaveSlot.of(VllmMethod("depthweave", bits=8, rank_k=128, rank_v=128), 64, 2, 128)
    coords = basis.encode(x)
    ck, cv = wide.unpack(wide.pack(coords, coords * 2).transpose(0, 1))
    assert (basis.decode(ck) - x).norm() / x.norm() < 0.01 and torch.allclose(cv, 2 * ck, atol=0.05)
    offsets, errors = torch.tensor([[3, -1]]), torch.tensor([[0.5, float("-inf")]])
    rows = torch.randn(1, 2, 64)
    tails = layout.write_exact(offsets, errors, rows, -rows)  # [1, 2, block_size, tail]
    slots = torch.zeros(1, 2, 128, layout.nbytes, dtype=torch.uint8)
    slots[..., layout.scale_end :] = tails.unsqueeze(1).expand(-1, 2, -1, -1)
    got = layout.read_exact(layout.tails(slots))
    assert got[0][0, 0].tolist() == [3, -1] and got[1][0, 0, 1] == float("-inf")
    torch.testing.assert_close(got[2][0, 0].float(), rows[0].half().float())


def test_depthweave_reads_the_models_rope_and_refuses_other_rotary_kinds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The de-rotation's frequencies come from vLLM's model config; a scaled RoPE is refused with one line."""
    from types import SimpleNamespace

    import vllm.config

    from kvweave.vllm.backend import _rope_inv_freq

    def config(**rope: Any) -> Any:
        return lambda: SimpleNamespace(
            model_config=SimpleNamespace(hf_config=SimpleNamespace(rope_parameters=rope))
        )

    monkeypatch.setattr(vllm.config, "get_current_vllm_config", config(rope_type="default", rope_theta=1e6))
    freq = _rope_inv_freq(64)
    assert freq is not None and torch.allclose(freq, 1e6 ** -(torch.arange(0, 64, 2) / 64))
    monkeypatch.setattr(vllm.config, "get_current_vllm_config", config(rope_type="llama3", rope_theta=5e5))
    with pytest.raises(ValueError, match="rotary embedding 'llama3'.*unset KVWEAVE_VLLM_METHOD") as error:
        _rope_inv_freq(64)
    assert "\n" not in str(error.value)


def _weave_run(spec: str, monkeypatch: pytest.MonkeyPatch, keys: torch.Tensor, values: torch.Tensor, chunks):
    """Write ``keys`` (pre-RoPE; rotated here as the model would), ``values`` ``[T, 2, 64]`` of one request
    through the backend in ``chunks`` (prefill chunks, then decode steps), blocks of 16 tokens; returns the impl,
    its float32 page view, the block table and the rotated keys."""
    impl = _impl(spec, monkeypatch)
    impl.inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    length, block = keys.shape[0], 16
    cos, sin = rope_cos_sin(impl.inv_freq, torch.arange(length))
    rotated = keys * cos.unsqueeze(1) + torch.cat([-keys[..., 32:], keys[..., :32]], -1) * sin.unsqueeze(1)
    slot = WeaveSlot.of(impl.method, 64, 2, block)
    cache = torch.zeros(40, 2, block, slot.nbytes // 4)
    table = torch.randperm(40)[: -(-length // block)].int()
    feed(impl, cache, table, rotated, values, chunks, lambda n: torch.randn(n, 4, 64))
    return impl, cache.view(torch.uint8), table, rotated


def test_depthweave_stores_rotated_keys_and_reads_them_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys of rank 32 (pre-RoPE) and values of rank 48 arrive rotated; at those ranks and 8 bits the backend
    gives back the rotated keys and the values to within 2 % over prefill chunks and decode steps — so its
    de-rotation and re-rotation agree — and the request's first tokens exactly (the sinks)."""
    torch.manual_seed(1)
    length = 150
    keys = (torch.randn(length, 32) @ torch.randn(32, 128)).view(length, 2, 64) + 1.0
    values = (torch.randn(length, 48) @ torch.randn(48, 128)).view(length, 2, 64)
    impl, pages, table, rotated = _weave_run(
        "depthweave:bits=8,exact=0", monkeypatch, keys, values, [100, 20] + [1] * 30
    )
    held = -(-length // 16)
    got_k, got_v = impl._stored(pages, impl.layout, table[:held].long(), length, length)
    assert (got_k.transpose(0, 1) - rotated).norm() / rotated.norm() < 0.02
    assert (got_v.transpose(0, 1) - values).norm() / values.norm() < 0.02
    torch.testing.assert_close(got_k.transpose(0, 1)[:4], rotated[:4].half().float())
    last = length - length % 16  # the newest, partial block: exact
    torch.testing.assert_close(got_v.transpose(0, 1)[last:], values[last:])


def test_depthweave_keeps_the_worst_represented_tokens_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """A token off the basis (a needle the prompt's first chunk did not contain) is its block's exact row,
    whether it arrives in a prefill chunk or by a decode step; the others are rebuilt from coordinates."""
    torch.manual_seed(2)
    length = 128
    keys = (torch.randn(length, 16) @ torch.randn(16, 128)).view(length, 2, 64)
    values = (torch.randn(length, 16) @ torch.randn(16, 128)).view(length, 2, 64)
    needles = torch.arange(64 + 5, length, 16)  # one per block after the basis was fitted
    keys[needles] += 8 * torch.randn(len(needles), 2, 64)
    values[needles] += 8 * torch.randn(len(needles), 2, 64)
    impl, pages, table, rotated = _weave_run(
        "depthweave:rank_k=16,rank_v=16,exact=1", monkeypatch, keys, values, [64, 32] + [1] * 32
    )
    got_k, got_v = impl._stored(pages, impl.layout, table.long(), length - 1, length)
    for needle in needles.tolist():
        torch.testing.assert_close(got_v.transpose(0, 1)[needle], values[needle].half().float())
        torch.testing.assert_close(got_k.transpose(0, 1)[needle], rotated[needle].half().float())


def test_depthweave_stores_a_steps_decode_rows_together_as_one_by_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decode rows of several requests in one step (each on its own basis, one crossing into a new block) are
    stored together (:meth:`_weave_store_decode`): the same page bytes, residual rows and attention outputs as
    the same tokens stored one request per step."""
    from kvweave.vllm.backend import KvweaveMetadata

    torch.manual_seed(6)
    block, lengths, prompt = 16, [40, 47, 33], [30, 31, 32]
    spec = "depthweave:rank_k=16,rank_v=16,exact=1"
    data = []
    for length in lengths:
        keys = (torch.randn(length, 16) @ torch.randn(16, 128)).view(length, 2, 64)
        data.append((keys, torch.randn(length, 2, 64)))
    tables = [torch.tensor([3, 9, 4, 11]), torch.tensor([0, 7, 2, 14]), torch.tensor([5, 1, 13, 6])]
    outputs, pages = [], []
    for together in (True, False):
        impl = _impl(spec, monkeypatch)
        impl.inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
        slot = WeaveSlot.of(impl.method, 64, 2, block)
        cache = torch.zeros(16, 2, block, slot.nbytes // 4)
        for (keys, values), table, first in zip(data, tables, prompt, strict=True):
            feed(
                impl,
                cache,
                table.int(),
                keys[:first],
                values[:first],
                [first],
                lambda n: torch.randn(n, 4, 64),
            )
        torch.manual_seed(7)
        got = []
        for step in range(8):
            rows = [i for i in range(3) if prompt[i] + step < lengths[i]]
            groups = [rows] if together else [[i] for i in rows]
            for group in groups:
                at = [prompt[i] + step for i in group]
                keys = torch.stack([data[i][0][t] for i, t in zip(group, at, strict=True)])
                values = torch.stack([data[i][1][t] for i, t in zip(group, at, strict=True)])
                cos, sin = rope_cos_sin(impl.inv_freq, torch.tensor(at))
                rotated = keys * cos.unsqueeze(1) + torch.cat(
                    [-keys[..., 32:], keys[..., :32]], -1
                ) * sin.unsqueeze(1)
                meta = KvweaveMetadata(
                    num_actual_tokens=len(group),
                    query_start=list(range(len(group) + 1)),
                    seq_lens=[t + 1 for t in at],
                    block_table=torch.stack([tables[i] for i in group]).int(),
                    slot_mapping=torch.tensor(
                        [
                            int(tables[i][t // block]) * block + t % block
                            for i, t in zip(group, at, strict=True)
                        ]
                    ),
                )
                impl.do_kv_cache_update(None, rotated, values, cache, meta.slot_mapping)
                query = torch.stack(
                    [
                        torch.randn(4, 64, generator=torch.Generator().manual_seed(100 * i + t))
                        for i, t in zip(group, at, strict=True)
                    ]
                )
                out = torch.empty(len(group), 4, 64)
                impl.forward(None, query, rotated, values, cache, meta, out)
                got += [(i, t, out[j]) for j, (i, t) in enumerate(zip(group, at, strict=True))]
        outputs.append(sorted(got, key=lambda x: (x[0], x[1])))
        pages.append(cache.view(torch.uint8).clone())
    assert torch.equal(pages[0], pages[1])
    for (i, t, a), (_, _, b) in zip(*outputs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"request {i}, token {t}")


@pytest.mark.parametrize("length", [150, 131, 3])
def test_depthweave_decode_weights_value_coordinates_as_attention_over_the_rebuilt_values(
    monkeypatch: pytest.MonkeyPatch, length: int
) -> None:
    """A decode row of the factored path (scores on rebuilt keys, attention weights on the value coordinates,
    exact rows, sinks and the newest partial block added as values) equals attention over every value rebuilt
    (the reference path) — with needles off the basis held exact, and for a request shorter than its sinks."""
    torch.manual_seed(3)
    keys = (torch.randn(length, 16) @ torch.randn(16, 128)).view(length, 2, 64)
    values = (torch.randn(length, 16) @ torch.randn(16, 128)).view(length, 2, 64) + 0.5
    needles = torch.arange(min(64 + 5, length), length, 16)
    keys[needles] += 8 * torch.randn(len(needles), 2, 64)
    values[needles] += 8 * torch.randn(len(needles), 2, 64)
    chunks = [min(64, length - 1)] + [1] * (length - 1 - min(64, length - 1))
    impl, pages, table, rotated = _weave_run(
        "depthweave:rank_k=16,rank_v=16,exact=1", monkeypatch, keys, values, chunks
    )
    query, k_new, v_new = torch.randn(1, 4, 64), torch.randn(1, 2, 64), torch.randn(1, 2, 64)
    cached = length - 1
    held = -(-cached // 16)
    old_k, old_v = impl._stored(pages, impl.layout, table[:held].long(), cached, length)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1),
        torch.cat([old_k, k_new.transpose(0, 1)], 1),
        torch.cat([old_v, v_new.transpose(0, 1)], 1),
        scale=0.125,
        enable_gqa=True,
    ).transpose(0, 1)
    out = impl._weave_decode(query, k_new, v_new, pages, impl.layout, table, cached)
    torch.testing.assert_close(out, expected.reshape(1, 4, 64), rtol=1e-4, atol=1e-5)
    from kvweave.kernels import cpu_vllm_weave
    from kvweave.vllm.backend import KvweaveMetadata

    if cpu_vllm_weave.load() is not None:  # the fused kernel's call for the same row gives the same
        meta = KvweaveMetadata(
            num_actual_tokens=1,
            query_start=[0, 1],
            seq_lens=[length],
            block_table=table.view(1, -1),
            slot_mapping=torch.tensor([0]),
        )
        fused = torch.empty(1, 4, 64)
        impl._fused_weave_decode(query, k_new, v_new, pages, impl.layout, meta, [0], fused)
        torch.testing.assert_close(fused, expected.reshape(1, 4, 64), rtol=1e-4, atol=1e-5)
    if length > 64 + 5:  # the needles' values are exact in the reference: what the comparison covers
        torch.testing.assert_close(old_v.transpose(0, 1)[needles[0]], values[needles[0]].half().float())


def test_depthweave_selective_decode_reads_the_blocks_its_bounds_choose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``decode_tokens``: every full block's tails bound its keys as a decode step reads them; a decode row
    reads the sinks' block, the newest full and partial blocks and the ``decode_tokens / block_size`` blocks of
    largest bound (here the needle's), and each decode path (factored torch, fused kernel, rebuilding reference)
    gives attention over exactly those blocks' tokens; with a budget of every block, the unselected output."""
    from kvweave.kernels import cpu_vllm_weave
    from kvweave.vllm.backend import KvweaveMetadata

    torch.manual_seed(11)
    length, block = 150, 16
    keys = (torch.randn(length, 16) @ torch.randn(16, 128)).view(length, 2, 64) * 0.3
    values = (torch.randn(length, 16) @ torch.randn(16, 128)).view(length, 2, 64)
    needle = 16 * 5 + 7  # block 5: far from the sinks' block and the newest ones
    direction = torch.randn(2, 64)
    keys[needle] += 4 * direction
    chunks = [64] + [1] * (length - 1 - 64)
    spec = "depthweave:rank_k=16,rank_v=16,exact=1,decode_tokens=32"
    impl, pages, table, rotated = _weave_run(spec, monkeypatch, keys, values, chunks)
    layout, cached = impl.layout, length - 1
    held, full = -(-cached // block), cached // block
    ids = table[:held].long()
    old_k, old_v = impl._stored(pages, layout, ids, cached, length)  # [H, cached, D] as decode reads them
    low, high = layout.read_bounds(
        pages[ids[:full], :, layout.bounds_slots, layout.scale_end :]
    )  # [full, H, D]
    for b in range(1, full):  # block 0 holds the sinks (read every step, its bounds not laid over them)
        k = old_k[:, b * block : (b + 1) * block]
        assert bool((k >= low[b].unsqueeze(1)).all() and (k <= high[b].unsqueeze(1)).all()), f"block {b}"
    cos, sin = rope_cos_sin(impl.inv_freq, torch.tensor([cached]))
    q_dir = (
        direction * cos + torch.cat([-direction[:, 32:], direction[:, :32]], -1) * sin
    )  # rotated like keys
    query = (q_dir.repeat_interleave(2, 0) + 0.1 * torch.randn(4, 64)).unsqueeze(0)  # [1, Hq, D]
    k_new, v_new = torch.randn(1, 2, 64), torch.randn(1, 2, 64)
    chosen = impl._weave_choose(query[0].view(2, 2, 64), pages, layout, ids, cached)
    assert chosen is not None and chosen.shape == (2, 5)  # block 0, 2 chosen, newest full (8), partial (9)
    for head in range(2):
        assert {0, 5, 8, 9} <= set(chosen[head].tolist()), chosen
    query = torch.randn(1, 4, 64) * 2  # a query no block stands out for: what is left out matters
    chosen = impl._weave_choose(query[0].view(2, 2, 64), pages, layout, ids, cached)
    assert chosen is not None
    picked = torch.zeros(2, held, dtype=torch.bool).scatter_(1, chosen, True)
    visible = torch.cat([picked[:, torch.arange(cached) // block], torch.ones(2, 1, dtype=torch.bool)], 1)
    mask = visible.repeat_interleave(2, 0).view(1, 4, 1, length)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0),
        torch.cat([old_k, k_new.transpose(0, 1)], 1).unsqueeze(0),
        torch.cat([old_v, v_new.transpose(0, 1)], 1).unsqueeze(0),
        attn_mask=mask,
        scale=0.125,
        enable_gqa=True,
    )[0].transpose(0, 1)
    unselected = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1),
        torch.cat([old_k, k_new.transpose(0, 1)], 1),
        torch.cat([old_v, v_new.transpose(0, 1)], 1),
        scale=0.125,
        enable_gqa=True,
    ).transpose(0, 1)
    assert not torch.allclose(expected, unselected, atol=1e-3)  # the choice leaves out weight that mattered
    factored = impl._weave_decode(query, k_new, v_new, pages, layout, table, cached)
    torch.testing.assert_close(factored, expected.reshape(1, 4, 64), rtol=1e-4, atol=1e-5)
    impl.weave_factored = False  # the rebuilding reference path (KVWEAVE_VLLM_KERNEL=torch)
    rebuilt = impl._attend(query, k_new, v_new, pages, layout, table, length)
    torch.testing.assert_close(rebuilt.reshape(1, 4, 64), expected.reshape(1, 4, 64), rtol=1e-4, atol=1e-5)
    impl.weave_factored = True
    meta = KvweaveMetadata(
        num_actual_tokens=1,
        query_start=[0, 1],
        seq_lens=[length],
        block_table=table.view(1, -1),
        slot_mapping=torch.tensor([0]),
    )
    if cpu_vllm_weave.load() is not None:
        fused = torch.empty(1, 4, 64)
        impl._fused_weave_decode(query, k_new, v_new, pages, layout, meta, [0], fused)
        torch.testing.assert_close(fused, expected.reshape(1, 4, 64), rtol=1e-4, atol=1e-5)
        # rows of different lengths chosen together (one scoring of their bounds) as each alone
        shorter = 16 * 7 + 3
        two = KvweaveMetadata(
            num_actual_tokens=2,
            query_start=[0, 1, 2],
            seq_lens=[length, shorter],
            block_table=torch.stack([table, table]),
            slot_mapping=torch.tensor([0, 0]),
        )
        queries2 = torch.cat([query, torch.randn(1, 4, 64) * 2])
        new2 = torch.cat([k_new, torch.randn(1, 2, 64)]), torch.cat([v_new, torch.randn(1, 2, 64)])
        together = torch.empty(2, 4, 64)
        impl._fused_weave_decode(queries2, *new2, pages, layout, two, [0, 1], together)
        torch.testing.assert_close(together[:1], fused, rtol=1e-5, atol=1e-6)
        alone = impl._weave_decode(queries2[1:], new2[0][1:], new2[1][1:], pages, layout, table, shorter - 1)
        torch.testing.assert_close(together[1:], alone, rtol=1e-4, atol=1e-5)
    object.__setattr__(impl.method, "decode_tokens", block * held)  # a budget of every block: nothing chosen
    assert impl._weave_choose(query[0].view(2, 2, 64), pages, layout, ids, cached) is None
    every = impl._weave_decode(query, k_new, v_new, pages, layout, table, cached)
    torch.testing.assert_close(every, unselected.reshape(1, 4, 64), rtol=1e-4, atol=1e-5)


def test_bad_method_specs_fail_with_one_line() -> None:
    for spec, word in (
        ("quant:bits=3", "bits"),
        ("h2o", "choose from"),
        ("quant:rank=2", "cannot read"),
        ("dkcache:top_blocks=8", "'pages'"),  # the old name of the page retrieval: not DK-Cache itself
        ("quant:bits=4,bits=2", "given twice"),  # read by the registry's spec reader, as every spec is
        ("quant:", "nothing after ':'"),
        ("depthweave:bits=2", "choose 8 or 4"),
    ):
        with pytest.raises(ValueError, match=word) as error:
            VllmMethod.parse(spec)
        assert "\n" not in str(error.value) and "KVWEAVE_VLLM_METHOD" in str(error.value)
    with pytest.raises(ValueError, match="does not fit head_size"):
        QuantSlot.of(VllmMethod("quant", bits=4, group=48), 64, 128)
    with pytest.raises(ValueError, match="must divide vLLM's block size"):
        QuantSlot.of(VllmMethod("quant", bits=4, key_group=48), 64, 128)
    with pytest.raises(ValueError, match="rank_k=30 must be a multiple of 4"):
        WeaveSlot.of(VllmMethod("depthweave", rank_k=30), 64, 2, 128)


def _impl(method: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    from kvweave.vllm.backend import KvweaveAttentionImpl

    monkeypatch.setenv("KVWEAVE_VLLM_METHOD", method)
    return KvweaveAttentionImpl(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quant_store_is_kivi_per_channel_keys_per_token_values(
    bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunked prefill then decode steps through vLLM's write hook: what attention reads back is kvweave's
    quantizer — keys per channel over each finished 64-token group, exact in the unfinished one; values per
    token — and a block's residual row is released once the block is full."""
    impl = _impl(f"quant:bits={bits}", monkeypatch)
    torch.manual_seed(bits)
    block, length = 128, 300
    slot = QuantSlot.of(impl.method, 64, block)
    cache = torch.zeros(10, 2, block, slot.nbytes // 2, dtype=torch.bfloat16)
    keys = (
        torch.randn(length, 2, 64) * torch.linspace(0.1, 6, 64)
    ).bfloat16()  # outlier channels, as real keys
    values = torch.randn(length, 2, 64).bfloat16()
    table = torch.tensor([7, 2, 5, 0], dtype=torch.int32)
    slots = slots_of(table[:3], block, length)
    written = 0
    for count in [70, 70, 60] + [1] * 100:
        impl.do_kv_cache_update(
            None,
            keys[written : written + count],
            values[written : written + count],
            cache,
            slots[written : written + count],
        )
        written += count
        if written not in (140, 256, 257, 300):
            continue
        held = -(-written // block)
        got_keys, got_values = impl._stored(
            cache.view(torch.uint8), impl.layout, table[:held].long(), written - 1, written
        )
        expected = keys[:written].float().clone()
        for group in range(written // 64):
            part = slice(group * 64, (group + 1) * 64)
            expected[part] = dequantize(*quantize(expected[part], 0, bits))
        torch.testing.assert_close(got_keys.transpose(0, 1), expected[: written - 1], rtol=0, atol=0)
        expected_values = dequantize(*quantize(values[: written - 1].float(), -1, bits))
        torch.testing.assert_close(got_values.transpose(0, 1), expected_values, rtol=0, atol=0)
    assert impl.residual is not None and list(impl.residual.row_of) == [5]  # blocks 7 and 2 are full


def test_retrieval_decode_reads_the_needle_block_and_matches_attention_over_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Blocks of 16 tokens; block 6 holds keys aligned with the query. The top-1 far block by the Quest bound
    must be block 6, and the output must equal exact attention over sinks + block 6 + the core."""
    impl = _impl("pages:sink_blocks=1,core_blocks=2,top_blocks=1", monkeypatch)
    torch.manual_seed(0)
    block, held, length = 16, 12, 12 * 16 - 5
    slot = PageSlot.of(64, torch.float32, block)
    cache = torch.zeros(20, 2, block, slot.nbytes // 4)  # vLLM's page view, float32
    table = torch.randperm(20)[:held].int()
    keys, values = torch.randn(length, 2, 64), torch.randn(length, 2, 64)
    query = torch.randn(1, 4, 64)
    keys[6 * block : 7 * block] += 4 * query[0, ::2]  # kv head h serves query heads 2h, 2h+1
    slots = slots_of(table, block, length)
    for first in range(0, length, 50):  # chunked writes, as prefill chunks and decode steps do
        impl.do_kv_cache_update(
            None, keys[first : first + 50], values[first : first + 50], cache, slots[first : first + 50]
        )
    pages = cache.view(torch.uint8)
    out = impl._retrieval_decode(query, pages, impl._layout(cache, torch.float32), table, length)
    kept = torch.cat(
        [torch.arange(0, block), torch.arange(6 * block, 7 * block), torch.arange(10 * block, length)]
    )
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1),
        keys[kept].transpose(0, 1),
        values[kept].transpose(0, 1),
        scale=0.125,
        enable_gqa=True,
    ).transpose(0, 1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    low, high = slot.summaries(pages[table.long()])
    torch.testing.assert_close(low[3], keys[3 * block : 4 * block].amin(0))
    torch.testing.assert_close(high[11], keys[11 * block :].amax(0))  # the partial last block


def test_backend_refuses_what_it_does_not_implement(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvweave.vllm.backend import KvweaveAttentionImpl

    monkeypatch.setenv("KVWEAVE_VLLM_METHOD", "quant:bits=4")
    with pytest.raises(ValueError, match="sliding-window attention.*unset KVWEAVE_VLLM_METHOD"):
        KvweaveAttentionImpl(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2, sliding_window=128)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'"):
        KvweaveAttentionImpl(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2, kv_cache_dtype="fp8")


# ------------------------------------------------------------------------- tiny random model in vLLM


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    source = QWEN if QWEN.exists() else SMOL if SMOL.exists() else None
    if source is None:
        pytest.skip(f"no tokenizer to copy: {QWEN} and {SMOL} are missing (kvweave models pull smollm2-135m)")
    subprocess.run(
        [sys.executable, str(BENCH), "tiny", "--out", str(folder), "--tokenizer-from", str(source)],
        check=True,
        capture_output=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    return folder


def generate(
    tiny: Path, method: str, out: Path, *extra: str, env_extra: dict[str, str] | None = None
) -> dict[str, Any]:
    """``vllm_bench.py generate`` on the tiny model in float32 (no bf16 logit ties): its JSON result."""
    return bench(
        "generate",
        "--model",
        str(tiny),
        "--method",
        method,
        "--dtype",
        "float32",
        *extra,
        "--out",
        str(out),
        env_extra=env_extra,
    )


JOBS = int(os.environ.get("KVWEAVE_VLLM_TEST_JOBS", "2"))
"""Tiny-model engines run this many at a time, each in its own process with ``OMP_NUM_THREADS`` threads (1 by
default under ``make vllm-test``): on CI's two cores, two one-thread engines at once halve the fixture's wall time."""


FULL_RANK_WEAVE = "depthweave:bits=8,rank_k=128,rank_v=128"


@pytest.fixture(scope="module")
def tiny_runs(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """float32 (no bf16 logit ties): vLLM's backend, pages (exact storage), quant at 8 and 4 bits, DepthWeave
    (default and at full rank). Every engine runs with prefix caching on and its ~400-token prompts sent twice
    (the second pass reads the first pass's full blocks), so one engine start serves both the token tests and
    the prefix-caching tests: one process per method, the cost of CI's quick target."""
    out = tmp_path_factory.mktemp("tiny-runs")
    methods = (
        "none",
        "pages",
        "quant:bits=8",
        "quant:bits=4",
        "quant:bits=4 torch",
        "depthweave",
        FULL_RANK_WEAVE,
    )

    def run(method: str) -> dict[str, Any]:
        name = method.replace(":", "-").replace("=", "").replace(" ", "-").replace(",", "-")
        kernel = "torch" if method.endswith(" torch") else "auto"
        return generate(
            tiny,
            method.removesuffix(" torch"),
            out / f"{name}.json",
            "--prefix-caching",
            env_extra={ENV_KERNEL: kernel},
        )

    with ThreadPoolExecutor(max_workers=max(1, JOBS)) as pool:
        return dict(zip(methods, pool.map(run, methods), strict=True))


def test_tiny_exact_storage_matches_vllm_tokens(tiny_runs: dict[str, dict[str, Any]]) -> None:
    assert tiny_runs["pages"]["tokens"] == tiny_runs["none"]["tokens"]


def test_tiny_quant8_greedy_tokens_differ_only_at_near_ties(tiny_runs: dict[str, dict[str, Any]]) -> None:
    result = agreement(tiny_runs["none"], tiny_runs["quant:bits=8"], TIE)
    assert result["confident_mismatches"] == 0, result
    assert sum(p["matched"] for p in result["prompts"]) >= len(result["prompts"]) * 16 // 2, result


def test_tiny_quant_decode_kernel_gives_the_torch_paths_tokens(tiny_runs: dict[str, dict[str, Any]]) -> None:
    """Decode steps read the packed blocks in the fused C++ kernel (counted), and the greedy tokens agree with
    the torch path's (gather, dequantize, SDPA) except where the two paths' top-2 logits are near a tie."""
    fused, reference = tiny_runs["quant:bits=4"], tiny_runs["quant:bits=4 torch"]
    assert (
        fused["stats"].get("fused_decode_rows", 0) > 0 and reference["stats"].get("fused_decode_rows", 0) == 0
    )
    result = agreement(reference, fused, TIE)
    assert result["confident_mismatches"] == 0, result


@pytest.mark.parametrize("bits", [8, 4])
def test_tiny_kv_capacity_follows_the_slot_bytes(tiny_runs: dict[str, dict[str, Any]], bits: int) -> None:
    """float32 here: vLLM's slot is 512 bytes a head, so the ratio is ≈ 32 / bits less the scales."""
    ratio = tiny_runs[f"quant:bits={bits}"]["kv_tokens"] / tiny_runs["none"]["kv_tokens"]
    expected = (2 * 64 * 4) / QuantSlot.of(VllmMethod("quant", bits=bits), 64, 128).nbytes
    assert abs(ratio - expected) / expected < 0.01, (ratio, expected)
    assert ratio >= 0.85 * 32 / bits


def test_tiny_depthweave_capacity_is_its_slot_bytes(tiny_runs: dict[str, dict[str, Any]]) -> None:
    """Default per-layer DepthWeave: 32 bytes a slot against vLLM's 512 in float32 (16x; 8x against bf16),
    and the bases it keeps beside the pages are counted."""
    run = tiny_runs["depthweave"]
    assert run["kv_tokens"] == 16 * tiny_runs["none"]["kv_tokens"]
    assert run["stats"]["weave_bases"] > 0 and run["stats"]["weave_side_bytes"] > 0


@pytest.mark.parametrize("method", ["quant:bits=8", "pages", FULL_RANK_WEAVE])
def test_tiny_prefix_caching_gives_the_same_tokens(tiny_runs: dict[str, dict[str, Any]], method: str) -> None:
    """The second pass (vLLM reports the cached tokens) gives the first pass's greedy tokens."""
    run = tiny_runs[method]
    half = len(run["tokens"]) // 2
    assert all(cached >= 128 for cached in run["cached_tokens"][half:]), run["cached_tokens"]
    assert run["tokens"][half:] == run["tokens"][:half]


def test_tiny_depthweave_at_full_rank_gives_vllms_tokens(tiny_runs: dict[str, dict[str, Any]]) -> None:
    """At full rank and 8 bits, blocks rebuilt from coordinates and rotated back to their positions (and
    prefix-cached blocks read with the basis of the request that wrote them) give the greedy tokens of exact
    storage except at near ties."""
    result = agreement(tiny_runs["pages"], tiny_runs[FULL_RANK_WEAVE], TIE)
    assert result["confident_mismatches"] == 0, result
    stats = tiny_runs[FULL_RANK_WEAVE]["stats"]
    assert stats["weave_bases"] > 0
    from kvweave.kernels import cpu_vllm_weave

    if cpu_vllm_weave.load() is not None:  # its decode rows ran the fused kernel
        assert stats["fused_decode_rows"] == stats["weave_decode_rows"] > 0, stats


# ------------------------------------------------------------------------------ qwen2.5-coder-0.5b


needs_qwen = pytest.mark.skipif(
    not QWEN.exists(), reason=f"{QWEN} missing (kvweave models pull qwen2.5-coder-0.5b)"
)


@pytest.fixture(scope="module")
def qwen_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("qwen-runs")
    runs = {}
    for method, dtype in (
        ("none", "float32"),
        ("quant:bits=8", "float32"),
        ("none", "bfloat16"),
        ("quant:bits=4", "bfloat16"),
    ):
        name = f"{method.replace(':', '-').replace('=', '')}-{dtype}"
        runs[f"{method}/{dtype}"] = bench(
            "generate",
            "--model",
            str(QWEN),
            "--method",
            method,
            "--dtype",
            dtype,
            "--kv-space",
            "2",
            "--tokens",
            "24",
            "--out",
            str(out / f"{name}.json"),
        )
    os.environ.pop(ENV_KERNEL, None)
    return runs


@pytest.mark.integration
@needs_qwen
def test_qwen_quant8_greedy_tokens_match_vllm(qwen_runs: dict[str, dict[str, Any]]) -> None:
    result = agreement(qwen_runs["none/float32"], qwen_runs["quant:bits=8/float32"], TIE)
    assert result["confident_mismatches"] == 0, result


@pytest.mark.integration
@needs_qwen
def test_qwen_quant4_holds_at_least_3_5x_the_kv_tokens(qwen_runs: dict[str, dict[str, Any]]) -> None:
    ratio = qwen_runs["quant:bits=4/bfloat16"]["kv_tokens"] / qwen_runs["none/bfloat16"]["kv_tokens"]
    assert ratio >= 3.5, ratio


def _transformers_accuracy(run: str, method: str) -> float:
    """Passkey accuracy of kvweave's transformers path in a committed ``kvweave eval`` run."""
    rows = [
        json.loads(line)
        for line in (ROOT / "docs" / "data" / "runs" / run / "rows.jsonl").read_text().splitlines()
    ]
    scores = [r["score"] for r in rows if r["method"] == method and r["task"] == "passkey"]
    assert scores, f"no {method} passkey rows in docs/data/runs/{run}"
    return sum(scores) / len(scores)


@pytest.mark.integration
@needs_qwen
def test_qwen_passkey_4k_over_http_scores_as_the_transformers_path(tmp_path: Path) -> None:
    run = bench(
        "serve-passkey",
        "--model",
        str(QWEN),
        "--method",
        "quant:bits=4",
        "--context",
        "4096",
        "--trials",
        "9",
        "--max-model-len",
        "4608",
        "--kv-space",
        "1",
        "--out",
        str(tmp_path / "http.json"),
        timeout=3600,
    )
    assert run["accuracy"] >= _transformers_accuracy("passkey-4k", "quant"), run["rows"]


@pytest.mark.integration
@needs_qwen
@pytest.mark.skipif(
    not (DATA / "pg_essays").exists(), reason=f"no essays haystack under {DATA} (KVWEAVE_DATA)"
)
def test_qwen_pages_reads_a_quarter_of_the_blocks_at_8k(tmp_path: Path) -> None:
    run = bench(
        "passkey",
        "--model",
        str(QWEN),
        "--method",
        "pages",
        "--context",
        "8192",
        "--trials",
        "3",
        "--haystack",
        "essays",
        "--tokens",
        "12",
        "--max-model-len",
        "8704",
        "--kv-space",
        "1",
        "--out",
        str(tmp_path / "dk.json"),
        timeout=3600,
    )
    assert run["decode_blocks_read_fraction"] <= 0.25, run["stats"]
    assert run["accuracy"] >= _transformers_accuracy("dkcache-8k", "dkcache:ratio=0.125"), run["rows"]


@pytest.mark.parametrize("bits", [4, 2])
def test_quant_decode_rows_of_one_step_match_the_torch_path_row_by_row(
    bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three requests of different lengths (one with an unfinished key group, one whose groups are all finished,
    one shorter than a group) decode in one step: the fused kernel's single call for all rows gives what the
    torch path gives one row at a time, each row's new token included."""
    from kvweave.vllm.backend import KvweaveMetadata

    impl = _impl(f"quant:bits={bits},key_group=64", monkeypatch)
    torch.manual_seed(bits)
    block, lengths = 128, [200, 128, 40]
    slot = QuantSlot.of(impl.method, 64, block)
    cache = torch.zeros(12, 2, block, slot.nbytes // 4)
    order = torch.randperm(12)
    tables, new_slots, new_keys, new_values = [], [], [], []
    for r, n in enumerate(lengths):
        table = order[4 * r : 4 * r + 2].int()
        keys = torch.randn(n + 1, 2, 64) * torch.linspace(0.5, 3, 64)
        values = torch.randn(n + 1, 2, 64)
        feed(impl, cache, table, keys[:n], values[:n], [n], lambda c: torch.randn(c, 4, 64))
        tables.append(torch.nn.functional.pad(table, (0, 2), value=0))
        new_slots.append(slots_of(table, block, n + 1)[-1])
        new_keys.append(keys[n])
        new_values.append(values[n])
    meta = KvweaveMetadata(
        num_actual_tokens=3,
        query_start=[0, 1, 2, 3],
        seq_lens=[n + 1 for n in lengths],
        block_table=torch.stack(tables),
        slot_mapping=torch.stack(new_slots),
    )
    key, value, query = torch.stack(new_keys), torch.stack(new_values), torch.randn(3, 4, 64)
    impl.do_kv_cache_update(None, key, value, cache, meta.slot_mapping)
    # the same rows with a request between them that has no new token this step: the decode rows are then not
    # one run of the batch (gathered, not sliced)
    gapped = KvweaveMetadata(
        num_actual_tokens=3,
        query_start=[0, 1, 1, 2, 3],
        seq_lens=[lengths[0] + 1, 7, lengths[1] + 1, lengths[2] + 1],
        block_table=torch.stack([tables[0], tables[0], tables[1], tables[2]]),
        slot_mapping=meta.slot_mapping,
    )
    outs = {}
    for fused in (True, False):
        impl.pin_decode("cpu", fused=fused, factored=True)
        outs[fused] = impl.forward(None, query, key, value, cache, meta, torch.empty(3, 4, 64))
        outs[fused, "gapped"] = impl.forward(None, query, key, value, cache, gapped, torch.empty(3, 4, 64))
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[True, "gapped"], outs[False], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[False, "gapped"], outs[False], rtol=1e-4, atol=1e-4)


def test_quant_few_token_write_is_the_tensor_paths_byte_for_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps of two requests through the write hook's few-token path (one C++ call for values and
    residual keys, slots as Python ints) and through its tensor path: the same page bytes and the same exact
    keys, across finished key groups and a full block, with a padding slot in every step."""
    from kvweave.vllm.backend import KeyResidual

    block, prompt, steps = 128, 100, 60  # key groups finish at 128 and 192 tokens; block 0 fills at 128
    torch.manual_seed(5)
    keys = torch.randn(2, prompt + steps, 2, 64) * torch.linspace(0.5, 3, 64)
    values = torch.randn(2, prompt + steps, 2, 64)
    tables = [torch.tensor([3, 0]).int(), torch.tensor([1, 4]).int()]
    held: dict[bool, tuple[torch.Tensor, KeyResidual]] = {}
    for fused in (True, False):
        impl = _impl("quant:bits=4,key_group=64", monkeypatch)
        impl.pin_decode("cpu", fused=fused, factored=True)
        cache = torch.zeros(6, 2, block, QuantSlot.of(impl.method, 64, block).nbytes // 4)
        for r in range(2):
            feed(
                impl,
                cache,
                tables[r],
                keys[r, :prompt],
                values[r, :prompt],
                [prompt],
                lambda c: torch.randn(c, 4, 64),
            )
        for t in range(prompt, prompt + steps):
            slots = torch.stack(
                [slots_of(tables[r], block, t + 1)[-1] for r in range(2)] + [torch.tensor(-1)]
            )
            pad = torch.zeros(1, 2, 64)
            impl.do_kv_cache_update(
                None, torch.cat([keys[:, t], pad]), torch.cat([values[:, t], pad]), cache, slots
            )
        held[fused] = cache, impl.residual
    (few, few_res), (tensor, tensor_res) = held[True], held[False]
    assert torch.equal(few.view(torch.uint8), tensor.view(torch.uint8))
    assert few_res.row_of.keys() == tensor_res.row_of.keys() == {0, 4}, "full blocks released their rows"
    for b in (0, 4):
        row_few, row_tensor = few_res.row_of[b], tensor_res.row_of[b]
        assert torch.equal(few_res.keys[row_few, :, :32], tensor_res.keys[row_tensor, :, :32])


def test_decode_step_benchmark_writes_a_row_per_path_close_to_vllms_attention(tmp_path: Path) -> None:
    """``benchmarks/vllm_decode_op.py`` at a small point (no engine): a row for every (method, path), each
    output close to vLLM's own exact attention over the same keys and values, and the paths of one method
    agreeing with each other. Keeps the benchmark behind docs/vllm.md's decode-step figures runnable."""
    out = tmp_path / "step.jsonl"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "vllm_decode_op.py"),
            "--methods",
            "none,quant:bits=8,depthweave:bits=8,rank_k=128,rank_v=128",
            "--tokens",
            "300",
            "--rows",
            "3",
            "--rounds",
            "1",
            "--steps",
            "2",
            "--chunk",
            "256",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    paths = {(r["method"].split(":")[0], r["path"]) for r in rows}
    assert paths == {("none", "vllm"), ("quant", "fused"), ("quant", "torch"), ("depthweave", "fused"),
                     ("depthweave", "factored"), ("depthweave", "rebuild")}  # fmt: skip
    for row in rows:
        assert row["tokens"] == 300 and row["rows"] == 3 and row["ms_per_step"] > 0
        assert row["difference_from_exact"] < 0.05, row
        assert row["difference_from_reference_path"] < 1e-3, row
