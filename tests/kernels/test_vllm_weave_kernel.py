"""The fused CPU decode kernel for kvweave's vLLM ``depthweave`` blocks against its torch reference, on blocks
packed with the backend's layout (engine-free: the layout is torch): coordinates on per-request bases, exact rows
in the blocks' tails, sinks and a newest partial block beside them."""

from __future__ import annotations

import pytest
import torch

from kvweave.kernels import cpu_vllm_weave
from kvweave.kernels.cpu_vllm_weave import WeaveRow
from kvweave.vllm.config import VllmMethod, WeaveSlot, rope_cos_sin

pytestmark = pytest.mark.skipif(
    cpu_vllm_weave.load() is None, reason=f"C++ kernel not buildable: {cpu_vllm_weave.unavailable_reason()}"
)

HEADS, DIM, BLOCK = 2, 64, 16


def _pages(layout: WeaveSlot, blocks: int, generator: torch.Generator) -> torch.Tensor:
    """Every slot's codes and scales from random coordinates, every block's tails holding its exact rows (one
    of them empty in some blocks), the bytes past them garbage."""
    pages = torch.randint(
        0, 256, (blocks, HEADS, BLOCK, layout.nbytes), dtype=torch.uint8, generator=generator
    )
    tokens = blocks * BLOCK
    k = torch.randn(tokens, layout.rank_k, generator=generator)
    v = torch.randn(tokens, layout.rank_v, generator=generator)
    packed = layout.pack(k, v).view(blocks, BLOCK, HEADS, -1).transpose(1, 2)  # [blocks, H, BLOCK, scale_end]
    pages[..., : layout.scale_end] = packed
    e = layout.exact
    offsets = torch.stack([torch.randperm(BLOCK, generator=generator)[:e] for _ in range(blocks * HEADS)])
    offsets = offsets.view(blocks, HEADS, e)
    offsets[::2, 0, -1] = -1  # an empty entry
    errors = torch.rand(blocks, HEADS, e, generator=generator)
    keys = torch.randn(blocks, HEADS, e, DIM, generator=generator)
    values = torch.randn(blocks, HEADS, e, DIM, generator=generator)
    pages[..., layout.scale_end :] = layout.write_exact(offsets, errors, keys, values)
    return pages


def _row(
    layout: WeaveSlot, cached: int, recent_first: int, sinks: int, generator: torch.Generator
) -> WeaveRow:
    def basis(rank: int) -> torch.Tensor:
        return torch.randn(rank, HEADS * DIM, generator=generator) / rank**0.5

    recent = recent_first < cached
    return WeaveRow(
        cached=cached,
        kb=basis(layout.rank_k),
        kmean=torch.randn(HEADS * DIM, generator=generator) * 0.3,
        vb=basis(layout.rank_v),
        vmean=torch.randn(HEADS * DIM, generator=generator) * 0.3,
        sink_k=torch.randn(sinks, HEADS, DIM, generator=generator),
        sink_v=torch.randn(sinks, HEADS, DIM, generator=generator),
        recent_first=recent_first,
        recent_k=torch.randn(HEADS, BLOCK, DIM, generator=generator) if recent else torch.empty(0),
        recent_v=torch.randn(HEADS, BLOCK, DIM, generator=generator) if recent else torch.empty(0),
    )


@pytest.mark.parametrize("bits,group", [(4, 7), (8, 2), (4, 1)])
def test_decode_rows_matches_the_torch_reference(bits: int, group: int) -> None:
    """Rows of different lengths in one call: one with a newest partial block, one of whole blocks, one shorter
    than its sinks and inside its first (partial) block, one with no sinks held."""
    layout = WeaveSlot.of(
        VllmMethod("depthweave", bits=bits, rank_k=32, rank_v=48, exact=2), DIM, HEADS, BLOCK
    )
    generator = torch.Generator().manual_seed(bits * 10 + group)
    pages = _pages(layout, 16, generator)
    table = torch.randperm(16, generator=generator)[:12].view(3, 4).int()
    table = torch.cat([table, table[:1]])  # a fourth row reads the first row's blocks
    rows = [
        _row(layout, 40, 32, 4, generator),
        _row(layout, 48, 48, 4, generator),
        _row(layout, 3, 0, 4, generator),
        _row(layout, 37, 37, 0, generator),
    ]
    queries = torch.randn(4, HEADS, group, DIM, generator=generator)
    new = torch.randn(4, HEADS, DIM, generator=generator), torch.randn(4, HEADS, DIM, generator=generator)
    inv_freq = 1.0 / (10_000 ** (torch.arange(0, DIM, 2).float() / DIM))
    cos, sin = rope_cos_sin(inv_freq, torch.arange(64))
    args = (queries, new, pages, table, rows, cos, sin, layout, DIM**-0.5)
    want = cpu_vllm_weave.decode_rows_reference(*args)
    got = cpu_vllm_weave.decode_rows(*args)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_decode_rows_reads_only_the_chosen_blocks_as_the_reference_masks_them(bits: int) -> None:
    """Selective decode: each row and KV head reads the blocks it chose (padding -1, a head choosing fewer,
    repeated and out-of-range indices ignored), and gives the reference's attention over those blocks' tokens; a
    choice of every block gives the unselected call's output."""
    layout = WeaveSlot.of(
        VllmMethod("depthweave", bits=bits, rank_k=32, rank_v=48, exact=2, decode_tokens=16),
        DIM,
        HEADS,
        BLOCK,
    )
    generator = torch.Generator().manual_seed(bits)
    pages = _pages(layout, 16, generator)
    table = torch.randperm(16, generator=generator)[:12].view(2, 6).int()
    rows = [_row(layout, 90, 80, 4, generator), _row(layout, 96, 96, 2, generator)]
    chosen = torch.tensor(
        [
            [[0, 2, 5, -1], [0, 1, 3, 5]],  # row 0: head 0 chose three blocks, head 1 four
            [[0, 4, 5, -1], [5, 0, -1, 9]],  # row 1: head 1 out of order, padded, one index past its blocks
        ]
    )
    queries = torch.randn(2, HEADS, 7, DIM, generator=generator)
    new = torch.randn(2, HEADS, DIM, generator=generator), torch.randn(2, HEADS, DIM, generator=generator)
    cos, sin = rope_cos_sin(1.0 / (10_000 ** (torch.arange(0, DIM, 2).float() / DIM)), torch.arange(96))
    args = (queries, new, pages, table, rows, cos, sin, layout, DIM**-0.5)
    want = cpu_vllm_weave.decode_rows_reference(*args, chosen=chosen)
    got = cpu_vllm_weave.decode_rows(*args, chosen=chosen)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    everything = torch.arange(6).expand(2, HEADS, 6).contiguous()
    torch.testing.assert_close(
        cpu_vllm_weave.decode_rows(*args, chosen=everything), cpu_vllm_weave.decode_rows(*args)
    )
    assert not torch.allclose(
        got, cpu_vllm_weave.decode_rows(*args), atol=1e-3
    )  # the choice changed something


def test_decode_rows_refuses_rows_without_their_newest_exact_rows() -> None:
    layout = WeaveSlot.of(VllmMethod("depthweave"), DIM, HEADS, BLOCK)
    generator = torch.Generator().manual_seed(0)
    pages = _pages(layout, 4, generator)
    row = _row(layout, 20, 20, 4, generator)
    row.recent_first = 16  # tokens 16.. from the newest block, but no rows given for them
    cos, sin = rope_cos_sin(torch.ones(DIM // 2), torch.arange(32))
    with pytest.raises(RuntimeError, match="newest block"):
        cpu_vllm_weave.decode_rows(
            torch.randn(1, HEADS, 2, DIM),
            (torch.randn(1, HEADS, DIM), torch.randn(1, HEADS, DIM)),
            pages,
            torch.arange(2).view(1, 2).int(),
            [row],
            cos,
            sin,
            layout,
            0.125,
        )


@pytest.mark.parametrize("bits,dtype", [(4, torch.float32), (8, torch.bfloat16), (4, torch.float16)])
def test_store_rows_writes_what_the_torch_store_writes(bits: int, dtype: torch.dtype) -> None:
    """A step's decode rows stored in one call: the same codes (to one quantization step: the kernel sums in
    another order), scales, exact rows and tails as ``WeaveSlot.store`` — a row starting its block (the old exact
    rows dropped), rows whose error beats one old entry, both or none, a row written again at an exact row's
    offset (its own entry replaced) — and each row's exact key and value in its residual rows."""
    from kvweave.vllm.config import Basis

    layout = WeaveSlot.of(
        VllmMethod("depthweave", bits=bits, rank_k=32, rank_v=48, exact=2, decode_tokens=16),
        DIM,
        HEADS,
        BLOCK,
    )
    generator = torch.Generator().manual_seed(bits + dtype.itemsize)
    pages = _pages(layout, 8, generator)
    old_offsets, _, _, _ = layout.read_exact(layout.tails(pages))
    rewrite = int(old_offsets[5, 0, 0])  # block 5: a token written again where head 0 keeps an exact row
    blocks, offsets = [1, 3, 5, 6, 7], [0, 9, rewrite, 15, 11]
    bases = []
    for _ in blocks:
        fitted = torch.randn(40, 16, generator=generator) @ torch.randn(16, HEADS * DIM, generator=generator)
        bases.append((Basis.fit(fitted, layout.rank_k), Basis.fit(fitted.flip(-1), layout.rank_v)))
    k_bases, v_bases = [b[0] for b in bases], [b[1] for b in bases]
    k_pre = torch.stack([b.mean for b in k_bases]) + torch.randn(5, HEADS * DIM, generator=generator)
    k_pre[3] *= 30  # far off its basis: an error above both old entries
    v_flat = torch.randn(5, HEADS * DIM, generator=generator)
    exact = (torch.randn(5, HEADS, DIM, generator=generator).to(dtype), torch.randn(5, HEADS, DIM).to(dtype))
    residual = (
        torch.zeros(4, HEADS, BLOCK, DIM, dtype=dtype),
        torch.zeros(4, HEADS, BLOCK, DIM, dtype=dtype),
    )
    rows = ([0, 2, -1, 3, 1], [1, 3, -1, 0, 2])
    want, got = pages.clone(), pages.clone()
    cpu_vllm_weave.store_rows_reference(
        (k_pre, v_flat), exact, want, blocks, offsets, (k_bases, v_bases), layout
    )
    cpu_vllm_weave.store_rows(
        (k_pre, v_flat), exact, got, blocks, offsets, (k_bases, v_bases), layout, residual, rows
    )
    untouched = torch.ones(8, dtype=torch.bool)
    untouched[blocks] = False
    assert torch.equal(got[untouched], want[untouched])
    at = torch.tensor(blocks), torch.tensor(offsets)
    slots_got, slots_want = got[at[0], :, at[1]], want[at[0], :, at[1]]  # [5, H, nbytes]
    scales = slots_want[..., layout.code_end : layout.scale_end].contiguous().view(torch.float16).float()
    for (a, b), scale in zip(
        zip(layout.unpack(slots_got.transpose(0, 1)), layout.unpack(slots_want.transpose(0, 1)), strict=True),
        (scales[..., 0], scales[..., 1]),
        strict=True,
    ):
        step = scale.repeat_interleave(a.shape[-1] // HEADS, dim=-1)  # [5, r]: each coordinate's head scale
        assert bool(((a - b).abs() <= step * 1.001 + 1e-6).all())
        assert float((a != b).float().mean()) < 0.02
    torch.testing.assert_close(
        slots_got[..., layout.code_end : layout.scale_end].contiguous().view(torch.float16),
        slots_want[..., layout.code_end : layout.scale_end].contiguous().view(torch.float16),
        rtol=1e-3,
        atol=0,
    )
    off_got, err_got, k_got, v_got = layout.read_exact(layout.tails(got[at[0]]))
    off_want, err_want, k_want, v_want = layout.read_exact(layout.tails(want[at[0]]))
    assert torch.equal(off_got, off_want)
    assert bool((off_want[0] == 0).any()) and bool((off_want[0] == -1).any())  # block 1 restarted: one row
    assert bool((off_want[2, 0] == rewrite).sum() == 1)  # the rewritten token holds one entry
    assert bool((off_want[3] == 15).any(-1).all())  # far off its basis: exact in both heads
    torch.testing.assert_close(err_got, err_want, rtol=1e-2, atol=1e-4)
    assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)
    assert torch.equal(got[at[0], :, :, layout.scale_end :], want[at[0], :, :, layout.scale_end :]) or bool(
        (err_got != err_want).any()
    )  # the tails' bytes too, unless an error's float16 rounding differs
    for side in (0, 1):
        for n, row in enumerate(rows[side]):
            if row >= 0:
                assert torch.equal(residual[side][row, :, offsets[n]], exact[side][n])
    assert not bool(residual[0][:, :, 13].any())  # nothing else written


@pytest.mark.parametrize("decode_tokens,sinks,group", [(48, 4, 7), (16, 0, 2), (32, 40, 1)])
def test_choose_rows_picks_the_blocks_the_torch_choice_picks(
    decode_tokens: int, sinks: int, group: int
) -> None:
    """Selective decode's block choice in one call: per row and KV head the same blocks as
    ``WeaveSlot.choose_blocks`` (the sinks' blocks, the newest full and partial ones, the budget's best bounds),
    padded with -1 to the widest row; a row with no more candidates than the budget reads every block."""
    layout = WeaveSlot.of(
        VllmMethod("depthweave", rank_k=32, rank_v=48, exact=2, decode_tokens=decode_tokens),
        DIM,
        HEADS,
        BLOCK,
    )
    generator = torch.Generator().manual_seed(decode_tokens + sinks)
    pages = _pages(layout, 24, generator)
    centre = torch.randn(24, HEADS, DIM, generator=generator)
    spread = torch.rand(24, HEADS, DIM, generator=generator)
    pages[..., layout.scale_end :] = layout.write_bounds(pages, centre - spread, centre + spread)
    table = torch.randperm(24, generator=generator)[:20].view(2, 10).int()
    table = torch.cat([table, table.flip(-1)])
    cached = [150, 37, 129, 90]  # 10 blocks (a partial newest), 3, 9 (a full newest), 6
    queries = torch.randn(4, HEADS, group, DIM, generator=generator)
    args = (queries, pages, table, cached, layout, decode_tokens, sinks)
    want = cpu_vllm_weave.choose_rows_reference(*args)
    got = cpu_vllm_weave.choose_rows(*args)
    assert torch.equal(got, want)
    assert bool((got[1, :, :3] == torch.arange(3)).all())  # three blocks: read whole
    assert bool((got[0] >= 0).sum(-1).lt(10).all())  # the long row skipped some
