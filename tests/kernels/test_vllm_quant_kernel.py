"""The fused CPU decode kernel for kvweave's vLLM ``quant`` blocks against its torch reference (the backend's
own unpack + attention), on blocks written the way the backend writes them (engine-free: the layout is torch)."""

from __future__ import annotations

import pytest
import torch

from kvweave.kernels import cpu_vllm_quant
from kvweave.vllm.config import QuantSlot

pytestmark = pytest.mark.skipif(
    cpu_vllm_quant.load() is None, reason=f"C++ kernel not buildable: {cpu_vllm_quant.unavailable_reason()}"
)


def _written(layout: QuantSlot, keys: torch.Tensor, values: torch.Tensor, ids: list[int], quantized: int):
    """Pages holding ``keys, values: [N, H, D]`` in blocks ``ids`` as the backend writes them: values packed per
    token, keys of every finished group quantized per channel with their header in the block's tails, and the
    exact keys of the unfinished group's block returned as the residual ``[H, block_size, D]``."""
    n, heads, dim = keys.shape
    size = layout.block_size
    pages = torch.randint(0, 256, (max(ids) + 2, heads, size, layout.nbytes), dtype=torch.uint8)  # garbage
    c, start = layout.code_bytes, layout.code_bytes + layout.value_bytes
    for i in range(n):
        pages[ids[i // size], :, i % size, c : c + layout.value_bytes] = layout.pack_values(
            values[i : i + 1]
        )[0]
    for first in range(0, quantized, layout.key_group):
        block, offset = ids[first // size], first % size
        group = keys[first : first + layout.key_group].transpose(0, 1).unsqueeze(0)  # [1, H, kg, D]
        codes, header = layout.quantize_keys(group)
        pages[block, :, offset : offset + layout.key_group, :c] = codes[0]
        tails = pages[block, :, :, start:].flatten(-2).clone()
        g, width = offset // layout.key_group, header.shape[-1]
        tails[:, g * width : (g + 1) * width] = header[0]
        pages[block, :, :, start:] = tails.unflatten(-1, (size, -1))
    residual = torch.randn(heads, size, dim)
    if quantized < n:
        base = quantized // size * size
        residual[:, quantized - base : n - base] = keys[quantized:n].transpose(0, 1)
    return pages, residual


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize(
    ("tokens", "quantized", "heads", "groups", "dim", "block", "key_group", "group"),
    [
        (100, 96, 2, 7, 64, 32, 16, 32),  # qwen-like: 7 query heads per KV head, a partial key group
        (64, 64, 1, 1, 32, 16, 16, 0),  # every group finished, one value group per head
        (37, 32, 3, 2, 16, 8, 8, 8),  # a partial last block
        (5, 0, 2, 4, 16, 16, 16, 16),  # nothing quantized yet: every key from the residual
        # head sizes 64 and 128 take the vectorized tile (AVX2 where built): query heads in 4s, 2s and 1s,
        # tiles cut short by the key group, the block and the stored length
        (300, 256, 2, 7, 64, 128, 64, 0),
        (200, 192, 1, 5, 128, 64, 32, 32),
        (77, 64, 2, 3, 64, 32, 16, 16),
        (141, 128, 1, 8, 64, 128, 128, 64),
        (70, 0, 1, 1, 128, 128, 128, 0),
    ],
)
def test_decode_matches_the_torch_path(bits, tokens, quantized, heads, groups, dim, block, key_group, group):
    torch.manual_seed(bits + tokens)
    layout = QuantSlot(dim, bits, group or dim, key_group, block)
    keys = torch.randn(tokens, heads, dim) * 2 + torch.randn(dim)
    values = torch.randn(tokens, heads, dim)
    held = -(-tokens // block)
    ids = torch.randperm(held + 3)[:held]
    pages, residual = _written(layout, keys, values, ids.tolist(), quantized)
    query = torch.randn(heads, groups, dim)
    args = (query, pages, ids, residual, tokens, quantized, layout, dim**-0.5)
    want_out, want_lse = cpu_vllm_quant.decode_reference(*args)
    for splits in (1, 3):
        out, lse = cpu_vllm_quant.decode(*args, splits=splits)
        torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lse, want_lse, rtol=1e-4, atol=1e-4)


def test_decode_of_nothing_is_empty():
    layout = QuantSlot(16, 4, 16, 16, 16)
    pages = torch.zeros(2, 1, 16, layout.nbytes, dtype=torch.uint8)
    out, lse = cpu_vllm_quant.decode(
        torch.randn(1, 2, 16), pages, torch.tensor([0]), None, 0, 0, layout, 0.25
    )
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("bits", [2, 4])
def test_decode_rows_matches_the_torch_path_row_by_row(bits):
    """Several decode rows of one layer in one call: different lengths (one with no finished key group, one
    whose groups are all finished), blocks interleaved in one page pool, each row's new token merged."""
    torch.manual_seed(bits)
    heads, groups, dim, block, key_group = 2, 7, 64, 32, 16
    layout = QuantSlot(dim, bits, 32, key_group, block)
    lengths, quantized = [100, 5, 64, 300], [96, 0, 64, 288]
    helds = [-(-n // block) for n in lengths]
    order = torch.randperm(sum(helds) + 2)
    tables, residuals, rows, first = [], [], [], 0
    pages = None
    for n, z, held in zip(lengths, quantized, helds, strict=True):
        ids = order[first : first + held]
        first += held
        keys = torch.randn(n, heads, dim) * 2 + torch.randn(dim)
        written, residual = _written(layout, keys, torch.randn(n, heads, dim), ids.tolist(), z)
        if pages is None:
            pages = torch.zeros(len(order) + 2, heads, block, layout.nbytes, dtype=torch.uint8)
        pages[ids] = written[ids]
        tables.append(torch.nn.functional.pad(ids, (0, 12 - held), value=0))
        if z < n:
            rows.append(len(residuals))
            residuals.append(residual)
        else:
            rows.append(-1)
    table = torch.stack(tables)
    query = torch.randn(len(lengths), heads, groups, dim)
    new = (torch.randn(len(lengths), heads, dim), torch.randn(len(lengths), heads, dim))
    args = (query, new, pages, table, lengths, quantized, torch.stack(residuals), rows, layout, dim**-0.5)
    want_out, want_lse = cpu_vllm_quant.decode_rows_reference(*args)
    for item_blocks in (None, 1, 5):
        out, lse = cpu_vllm_quant.decode_rows(*args, item_blocks=item_blocks)
        torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lse, want_lse, rtol=1e-4, atol=1e-4)


def test_decode_rows_refuses_a_row_past_its_block_table():
    layout = QuantSlot(16, 4, 16, 16, 16)
    pages = torch.zeros(4, 1, 16, layout.nbytes, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="more than its block table"):
        cpu_vllm_quant.decode_rows(
            torch.randn(1, 1, 2, 16),
            None,
            pages,
            torch.tensor([[0, 1]]),
            [40],
            [32],
            torch.randn(1, 1, 16, 16),
            [0],
            layout,
            0.25,
        )


@pytest.mark.parametrize(("bits", "group"), [(2, 64), (4, 64), (4, 16), (8, 32)])
def test_write_values_is_the_torch_packing_bit_for_bit(bits, group):
    """Values written by the C++ write hook are ``QuantSlot.pack_values`` byte for byte, slot bytes around
    them untouched; ties on the rounding grid and constant groups (scale 0) included."""
    torch.manual_seed(bits + group)
    layout = QuantSlot(64, bits, group, 16, 16)
    values = torch.randn(9, 2, 64) * 3
    values[0] = 1.5  # one constant token: scale 0
    values[1, :, :8] = torch.arange(8).float() / 2  # values on half steps of the grid
    blocks, offsets = torch.tensor([3, 3, 0, 5, 5, 5, 1, 2, 4]), torch.tensor([0, 1, 7, 2, 3, 15, 0, 9, 4])
    pages = torch.randint(0, 256, (6, 2, 16, layout.nbytes), dtype=torch.uint8)
    want = pages.clone()
    c = layout.code_bytes
    want[blocks, :, offsets, c : c + layout.value_bytes] = layout.pack_values(values)
    cpu_vllm_quant.write_values(values, pages, blocks, offsets, layout)
    assert torch.equal(pages, want)
    with pytest.raises(ValueError, match="NaN/Inf"):
        cpu_vllm_quant.write_values(
            torch.full((1, 2, 64), float("nan")), pages, blocks[:1], offsets[:1], layout
        )
