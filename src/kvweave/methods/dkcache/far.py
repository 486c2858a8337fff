"""DK-Cache's far tier: tokens older than the steady tier, stored per row by real-token index (padding is never
stored), the first ``sinks`` exact, the rest in pages with per-channel min/max key summaries (Quest, Tang et al.
2024, arXiv:2406.10774) from which the pages with the largest upper bound of ``q·k`` are retrieved; optionally
INT8 and in host memory (:func:`far_device`)."""

from __future__ import annotations

import torch

from kvweave.kernels.registry import Kernel
from kvweave.methods.dkcache import tiers
from kvweave.methods.dkcache.tiers import KeyMap
from kvweave.ops.pages import page_upper_bounds
from kvweave.ops.quantize import dequantize_int8, quantize_int8
from kvweave.ops.rope import RopeTable
from kvweave.state import Stateful

Part = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""An attention part: ``keys, values [B, H, T, D]``, ``positions [B, 1 or H, T]``, ``slots [B, 1 or H, T]``."""


PAGE_SCORES = Kernel("dkcache far-page scores", triton="kvweave.kernels.triton_pages")
"""Scoring the far pages by their key summaries: torch (two matmuls) or one Triton kernel on CUDA."""


def page_scores(
    query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, backend: str = "torch"
) -> torch.Tensor:
    """``[B, H, P]`` the largest upper bound of ``q·k`` over the rows of ``query: [B, H, n, D]`` for each page
    of the summaries ``page_min, page_max: [B, H, P, D]``; ``backend="triton"`` in one kernel (no ``[B, H, n,
    P]`` bounds written)."""
    if backend == "triton":
        from kvweave.kernels import triton_pages

        return triton_pages.page_scores(query, page_min, page_max)
    return page_upper_bounds(query, page_min, page_max).amax(2)


def far_device(device: torch.device, offload: bool) -> torch.device:
    """Where the far tier lives: host memory when offloading from an accelerator, else with the model."""
    return torch.device("cpu") if offload and device.type != "cpu" else device


def _write_range(
    buffer: torch.Tensor,
    dim: int,
    low: int,
    block: torch.Tensor,
    source: torch.Tensor,
    uniform: int | None = None,
) -> None:
    """``buffer[b, .., low + w, ..] = block[b, .., source[b, w], ..]`` where ``0 <= source < n``, else unchanged.

    Rows write different entries of ``block`` at the same destination range without a host sync or a
    per-token loop: each destination gathers its source (``source: [B, W]`` int64). ``uniform``: the caller
    knows every row's source is ``uniform, uniform + 1, ..`` (no padding): a plain copy.
    """
    b, width = source.shape
    n = block.shape[dim]
    if uniform is not None and 0 <= uniform and uniform + width <= n:  # every row reads the same valid range
        buffer.narrow(dim, low, width).copy_(block.narrow(dim, uniform, width))
        return
    shape = [b] + [1] * (dim - 1) + [width] + [1] * (block.dim() - dim - 1)
    expand = list(block.shape)
    expand[dim] = width
    index = source.clamp(0, max(n - 1, 0)).view(shape).expand(expand)
    valid = ((source >= 0) & (source < n)).view(shape)
    target = buffer.narrow(dim, low, width)
    target.copy_(torch.where(valid, block.gather(dim, index), target))


class FarTier(Stateful):
    """Tokens older than the steady tier, stored per row by real-token index ``r = slot − pad`` (padding is
    never stored): the first ``sinks`` in an exact sink store, the rest (``r − sinks``) in pages of ``page``
    tokens with per-channel min/max key summaries (unless pages are dropped: ``retrieve="never"``)."""

    state_name = "dkcache.FarTier"
    state_fields = (
        "sinks",
        "page",
        "quantized",
        "keep_pages",
        "device",
        "lengths",
        "sink",
        "store",
        "page_min",
        "page_max",
        "summary_groups",
        "clean_pages",
    )

    def __init__(
        self, sinks: int, page: int, quantized: bool, keep_pages: bool, device: torch.device
    ) -> None:
        self.sinks, self.page, self.quantized, self.keep_pages, self.device = (
            sinks,
            page,
            quantized,
            keep_pages,
            device,
        )
        self.lengths: list[int] = []  # real tokens per row in the far tier (sinks included)
        self.sink: dict[str, torch.Tensor] = {}  # keys, values [B, H, S, D]; positions [B, S]
        self.store: dict[str, torch.Tensor] = {}  # keys, values (+ scales) [B, H, cap, D]; positions [B, cap]
        self.page_min: torch.Tensor | None = None  # [B, H, P_cap, D] float32, keys as attention sees them
        self.page_max: torch.Tensor | None = None
        self.summary_groups: list[int] | None = None  # Self-Extend groups the summaries were computed with
        self.clean_pages = 0  # summaries of pages < clean_pages are current

    def paged_lengths(self) -> list[int]:
        return [max(0, n - self.sinks) for n in self.lengths]

    def page_count(self) -> int:
        return -(-max(self.paged_lengths(), default=0) // self.page)

    def add(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        first_slot: int,
        pad: list[int],
        store_dtype: torch.dtype | None = None,
    ) -> None:
        """Store a block of consecutive slots ``first_slot ..`` (``keys, values: [B, H, n, D]``; exact pages
        and the sinks at ``store_dtype``, default theirs)."""
        n = keys.shape[2]
        exact_keys, exact_values = keys.to(store_dtype or keys.dtype), values.to(store_dtype or values.dtype)
        if not self.lengths:
            self.lengths = [0] * keys.shape[0]
        starts = [first_slot - p for p in pad]  # real index of the block's first token, per row
        start = torch.tensor(starts, device=keys.device).view(-1, 1)
        if self.sinks and min(starts) < self.sinks:
            if not self.sink:
                self.sink = {
                    "keys": exact_keys.new_zeros(*keys.shape[:2], self.sinks, keys.shape[3]),
                    "values": exact_values.new_zeros(*values.shape[:2], self.sinks, values.shape[3]),
                    "positions": positions.new_zeros(keys.shape[0], self.sinks),
                }
            source = torch.arange(self.sinks, device=keys.device).view(1, -1) - start
            for name, block in (("keys", exact_keys), ("values", exact_values), ("positions", positions)):
                _write_range(self.sink[name], 2 if name != "positions" else 1, 0, block, source)
        low, high = max(0, min(starts) - self.sinks), max(0, max(starts) + n - self.sinks)
        if self.keep_pages and high > low:
            self._reserve(high, exact_keys, exact_values)
            source = (torch.arange(low, high, device=keys.device).view(1, -1) + self.sinks - start).to(
                self.device
            )
            uniform = low + self.sinks - starts[0] if len(set(starts)) == 1 else None
            blocks: dict[str, torch.Tensor] = {"positions": positions.to(torch.int32)}
            if self.quantized:
                (blocks["keys"], blocks["key_scales"]), (blocks["values"], blocks["value_scales"]) = (
                    quantize_int8(keys),
                    quantize_int8(values),
                )
            else:
                blocks["keys"], blocks["values"] = exact_keys, exact_values
            for name, block in blocks.items():
                _write_range(
                    self.store[name],
                    2 if name != "positions" else 1,
                    low,
                    block.to(self.device),
                    source,
                    uniform,
                )
            self.clean_pages = min(self.clean_pages, low // self.page)
        self.lengths = [max(length, s + n) for length, s in zip(self.lengths, starts, strict=True)]

    def _reserve(self, needed: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Capacity for ``needed`` paged entries (whole pages); grows by at least 1/GROWTH."""
        capacity = self.store["positions"].shape[1] if self.store else 0
        if needed <= capacity:
            return
        grown = needed if not self.store else needed + max(self.page, needed // tiers.GROWTH)
        grown = -(-grown // self.page) * self.page
        b, h = keys.shape[:2]
        fresh = {"positions": torch.zeros(b, grown, dtype=torch.int32, device=self.device)}
        if self.quantized:
            for name, like in (("keys", keys), ("values", values)):
                fresh[name] = torch.zeros(b, h, grown, like.shape[3], dtype=torch.int8, device=self.device)
                fresh[name[:-1] + "_scales"] = torch.ones(
                    b, h, grown, 1, dtype=torch.float32, device=self.device
                )
        else:
            fresh["keys"] = keys.new_zeros(b, h, grown, keys.shape[3], device=self.device)
            fresh["values"] = values.new_zeros(b, h, grown, values.shape[3], device=self.device)
        for name, old in self.store.items():
            fresh[name].narrow(-1 if name == "positions" else 2, 0, capacity).copy_(old)
        self.store = fresh

    def pages_of(
        self, pages: torch.Tensor, dtype: torch.dtype, device: torch.device, with_positions: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Whole pages ``pages: [B, H, k]`` -> ``keys, values: [B, H, k·page, D]`` (``dtype``), ``positions
        [B, H, k·page]`` (``None`` unless ``with_positions``): one row copy per page (the store is contiguous
        and whole pages long)."""
        pages = pages.to(self.device)
        b, h, k = pages.shape
        count = self.store["positions"].shape[1] // self.page
        head = torch.arange(b * h, device=self.device).view(b, h, 1)
        flat = (head * count + pages).flatten()

        def take(name: str) -> torch.Tensor:
            part = self.store[name]
            return part.view(b * h * count, -1).index_select(0, flat).view(b, h, k * self.page, -1).to(device)

        positions = None
        if with_positions:
            rows = (torch.arange(b, device=self.device).view(b, 1, 1) * count + pages).flatten()
            positions = self.store["positions"].view(b * count, self.page).index_select(0, rows)
            positions = positions.view(b, h, k * self.page).to(device, torch.int64)
        if self.quantized:
            return (
                dequantize_int8(take("keys"), take("key_scales"), dtype),
                dequantize_int8(take("values"), take("value_scales"), dtype),
                positions,
            )
        return take("keys").to(dtype), take("values").to(dtype), positions  # .to is a no-op at the same dtype

    def page_range(
        self, first: int, last: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[B, H, (last-first)*page, D]`` and positions ``[B, (last-first)*page]`` of pages ``first..last-1``."""
        low, width = first * self.page, (last - first) * self.page
        keys = self.store["keys"].narrow(2, low, width).to(device)
        if self.quantized:
            keys = dequantize_int8(keys, self.store["key_scales"].narrow(2, low, width).to(device), dtype)
        return keys.to(dtype), self.store["positions"].narrow(1, low, width).to(device, torch.int64)

    def map_keys(self, fn: KeyMap, device: torch.device, chunk_elements: int) -> None:
        """Replace every held key ``k`` (sinks and pages) by ``fn(k, positions)`` in place, computed on ``device``
        in blocks of pages of about ``chunk_elements`` elements."""
        if self.sink:
            keys = self.sink["keys"]
            keys.copy_(fn(keys.to(device), self.sink["positions"].to(device, torch.int64)).to(keys.device))
        if not self.store:
            return
        b, h, capacity, d = self.store["keys"].shape
        step = max(self.page, chunk_elements // max(1, b * h * d) // self.page * self.page)
        for low in range(0, capacity, step):
            width = min(step, capacity - low)
            positions = self.store["positions"].narrow(1, low, width).to(device, torch.int64)
            keys = self.store["keys"].narrow(2, low, width)
            if self.quantized:
                scales = self.store["key_scales"].narrow(2, low, width)
                codes, new_scales = quantize_int8(
                    fn(dequantize_int8(keys.to(device), scales.to(device), torch.float32), positions)
                )
                keys.copy_(codes.to(keys.device))
                scales.copy_(new_scales.to(scales.device))
            else:
                keys.copy_(fn(keys.to(device), positions).to(keys.device))

    # -- attention: sinks, page summaries, retrieval
    def sink_part(
        self, dtype: torch.dtype, device: torch.device, pad_count: torch.Tensor | None
    ) -> tuple[Part, torch.Tensor] | None:
        """The sinks as an attention part (keys, values, positions, slots) and their validity ``[B, 1, S]``."""
        if not self.sink:
            return None
        pad = pad_count.view(-1, 1, 1) if pad_count is not None else 0
        count = torch.tensor([min(self.sinks, n) for n in self.lengths], device=device)
        index = torch.arange(self.sinks, device=device).view(1, 1, -1)
        return (
            (
                self.sink["keys"].to(dtype),
                self.sink["values"].to(dtype),
                self.sink["positions"].unsqueeze(1).to(torch.int64),
                pad + index,
            ),
            index < count.view(-1, 1, 1),
        )

    def refresh_summaries(
        self,
        dtype: torch.dtype,
        device: torch.device,
        groups: list[int],
        table: RopeTable | None,
        chunk_elements: int,
    ) -> None:
        """Per-channel min/max of each page's keys as attention sees them (``table``: held pre-RoPE, rotated at
        the grouped positions ``p // G`` of the current step's ``groups``; ``None``: as held); only pages that
        changed, or all when a row's Self-Extend group changed. Summaries live on ``device``."""
        count = self.page_count()
        if self.summary_groups != groups:
            self.clean_pages, self.summary_groups = 0, list(groups)
        if self.clean_pages >= count:
            return
        b, h, _, d = self.store["keys"].shape
        capacity = self.store["positions"].shape[1] // self.page
        if self.page_min is None or self.page_min.shape[2] < capacity:
            fresh = [torch.zeros(b, h, capacity, d, device=device) for _ in range(2)]
            if self.page_min is not None and self.page_max is not None:
                fresh[0][:, :, : self.page_min.shape[2]] = self.page_min
                fresh[1][:, :, : self.page_max.shape[2]] = self.page_max
            self.page_min, self.page_max = fresh
        page_min, page_max = self.page_min, self.page_max
        assert page_min is not None and page_max is not None
        group = torch.tensor(groups, device=device).view(-1, 1, 1)
        lengths = self.paged_lengths()
        paged = torch.tensor(lengths, device=device).view(-1, 1, 1, 1)
        step = max(1, chunk_elements // max(1, b * h * self.page * d))
        for low in range(self.clean_pages, count, step):
            high = min(count, low + step)
            keys, positions = self.page_range(low, high, dtype, device)
            if table is not None:
                keys = table.rotate(keys, positions.unsqueeze(1) // group)
            keys = keys.float().reshape(b, h, high - low, self.page, d)
            if len(set(lengths)) == 1:  # the same far tokens in every row: only the last page is partial
                whole = max(0, min(high, lengths[0] // self.page) - low)
                if whole:
                    page_min[:, :, low : low + whole] = keys[:, :, :whole].amin(3)
                    page_max[:, :, low : low + whole] = keys[:, :, :whole].amax(3)
                if low + whole < high:
                    rest = keys[:, :, whole, : lengths[0] - (low + whole) * self.page]
                    page_min[:, :, low + whole] = rest.amin(2)
                    page_max[:, :, low + whole] = rest.amax(2)
                continue
            index = torch.arange(low * self.page, high * self.page, device=device).view(1, 1, -1, 1)
            ok = (index < paged).view(b, 1, high - low, self.page, 1)
            any_ok = ok.any(3)
            page_min[:, :, low:high] = keys.masked_fill(~ok, float("inf")).amin(3).masked_fill(~any_ok, 0)
            page_max[:, :, low:high] = keys.masked_fill(~ok, float("-inf")).amax(3).masked_fill(~any_ok, 0)
        self.clean_pages = count

    def retrieve(
        self,
        query: torch.Tensor,
        dtype: torch.dtype,
        device: torch.device,
        pages: int,
        rows_on: torch.Tensor,
        pad_count: torch.Tensor | None,
        with_positions: bool = True,
        backend: str = "torch",
    ) -> tuple[Part, torch.Tensor, torch.Tensor]:
        """The top ``pages`` pages per (row, KV head) by the upper bound of ``q·k`` (summaries current): the
        part (positions only ``with_positions``), its validity ``[B, H, k·page]`` and which of the chosen pages
        are real and retrieved (``rows_on: [B]``) ``[B, H, k]``. ``backend``: where the page scores are
        computed (``torch`` or ``triton``, :data:`PAGE_SCORES`)."""
        assert self.page_min is not None and self.page_max is not None
        count = self.page_count()
        b, hq, n, d = query.shape
        h = self.page_min.shape[1]
        bounds = page_scores(
            query.reshape(b, h, hq // h * n, d),
            self.page_min[:, :, :count],
            self.page_max[:, :, :count],
            backend,
        )  # [B, H, P]
        lengths = self.paged_lengths()
        if len(set(lengths)) == 1:  # rows hold the same far tokens (no padding): every page < count is real
            paged: torch.Tensor | int = lengths[0]
            top = bounds.topk(min(pages, count), dim=-1)
            chosen = rows_on.view(-1, 1, 1).expand(b, h, top.indices.shape[-1])
        else:
            paged = torch.tensor(lengths, device=device).view(-1, 1, 1)
            page_ok = torch.arange(count, device=device).view(1, 1, -1) * self.page < paged
            top = bounds.masked_fill(~page_ok, float("-inf")).topk(min(pages, count), dim=-1)
            chosen = page_ok.expand(b, h, -1).gather(2, top.indices) & rows_on.view(-1, 1, 1)
        index = (top.indices.unsqueeze(-1) * self.page + torch.arange(self.page, device=device)).flatten(2)
        keys, values, positions = self.pages_of(top.indices, dtype, device, with_positions)
        ok = (index < paged) & chosen.repeat_interleave(self.page, dim=2)
        slots = pad_count.view(-1, 1, 1) + self.sinks + index if pad_count is not None else index
        return (keys, values, positions, slots), ok, chosen  # type: ignore[return-value]

    # -- batch, bytes
    def select_rows(self, rows: torch.Tensor) -> None:
        order = rows.tolist()
        self.lengths = [self.lengths[i] for i in order] if self.lengths else []
        if self.summary_groups is not None:
            self.summary_groups = [self.summary_groups[i] for i in order]
        for store in (self.sink, self.store):
            for name, value in store.items():
                store[name] = value.index_select(0, rows.to(value.device))
        if self.page_min is not None and self.page_max is not None:
            self.page_min = self.page_min.index_select(0, rows.to(self.page_min.device))
            self.page_max = self.page_max.index_select(0, rows.to(self.page_max.device))

    def tensors(self) -> list[torch.Tensor]:
        return [
            *self.sink.values(),
            *self.store.values(),
            *(t for t in (self.page_min, self.page_max) if t is not None),
        ]
