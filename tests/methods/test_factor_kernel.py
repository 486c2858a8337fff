"""DepthWeave's fused C++ selective-decode kernel against the torch reference path (gather, dequantize, rebuild,
rotate, matmul), on INT4 and INT8 coordinates, pre- and post-RoPE keys."""

from __future__ import annotations

import pytest
import torch

import kvweave
from conftest import tiny_model
from kvweave._compat import cache_kwarg
from kvweave.kernels import cpu_factor

needs_kernel = pytest.mark.skipif(
    cpu_factor.load() is None,
    reason=f"C++ factor kernel not buildable here: {cpu_factor.unavailable_reason()}",
)

OPTIONS = dict(
    recent=8, block=8, probe=8, window=8, sinks=2, group=2, compression=3.0, decode_tokens=8, page=4
)


def _generate(model, ids, **options):
    cache = kvweave.make_cache("depthweave", model, **{**OPTIONS, **options})
    out = model.generate(
        ids,
        max_new_tokens=10,
        min_new_tokens=10,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **{cache_kwarg(model): cache},
    )
    return out, cache


@needs_kernel
@pytest.mark.parametrize("bits,keys", [(4, "pre_rope"), (8, "pre_rope"), (4, "post_rope")])
def test_fused_kernel_equals_the_torch_path(bits, keys):
    model = tiny_model("llama")
    torch.manual_seed(2)
    ids = torch.randint(3, 150, (1, 90))
    fused, cache = _generate(model, ids, bits=bits, keys=keys, kernel="cpp")
    reference, _ = _generate(model, ids, bits=bits, keys=keys, kernel="torch")
    assert torch.equal(fused.sequences, reference.sequences)
    gap = max((a - b).abs().max().item() for a, b in zip(fused.logits, reference.logits, strict=True))
    assert gap < 1e-4
    store = cache.layers[0].group.rows[0]
    assert sum(s.bounds[0].pages for s in store.segments.values()) > 2  # selection really chose a subset


def test_kernel_cpp_refuses_coordinates_it_cannot_read():
    model = tiny_model("llama")
    ids = torch.randint(3, 150, (1, 90))
    if cpu_factor.load() is None:
        pytest.skip("no C++ kernel here")
    with pytest.raises(RuntimeError, match="kernel=cpp"):
        _generate(model, ids, bits=16, kernel="cpp")
