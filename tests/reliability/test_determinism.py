"""Determinism: the same inputs and seeds give the same tokens, logits, bytes held and per-layer statistics for every registered method, run twice in one process and in a second process. (Batch rows against
single-row runs: tests/methods/test_contract.py::test_generate_batch_left_padding, for every method.)"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def fingerprints() -> dict[str, dict[str, Any]]:
    """Per method: generated tokens, a hash of the logits, bytes held and a hash of ``cache.stats()``."""
    import torch

    import kvweave
    import kvweave.methods  # noqa: F401  (fills the registry)
    from conftest import tiny_model
    from kvweave._compat import cache_kwarg
    from kvweave.registry import METHODS, parse_method

    model = tiny_model("llama")
    generator = torch.Generator().manual_seed(11)
    ids = torch.randint(3, 150, (1, 48), generator=generator)
    found = {}
    for name in sorted(METHODS):
        spec = parse_method(name, **METHODS[name].test_options)
        cache = kvweave.make_cache(spec, model)
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=8,
                min_new_tokens=8,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                **{cache_kwarg(model): cache},
            )
        logits = torch.stack(out.logits).float().contiguous().numpy().tobytes()
        found[name] = {
            "tokens": out.sequences[0, ids.shape[1] :].tolist(),
            "logits": hashlib.sha256(logits).hexdigest(),
            "nbytes": cache.nbytes(),
            # not the saved storages' bytes: growing buffers' spare capacity is uninitialised memory
            "stats": hashlib.sha256(
                json.dumps(cache.stats(), sort_keys=True, default=str).encode()
            ).hexdigest(),
        }
    return found


def test_twice_in_one_process_and_in_another_process() -> None:
    import torch

    first, second = fingerprints(), fingerprints()
    assert len(first) >= 10 and first == second
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "PYTHONHASHSEED": "0"}
    run = subprocess.run(
        [sys.executable, __file__], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert run.returncode == 0, run.stderr[-2000:]
    other = json.loads(run.stdout.strip().splitlines()[-1])
    differ = {name: (first[name], other.get(name)) for name in first if first[name] != other.get(name)}
    assert not differ, differ


if __name__ == "__main__":  # the second process
    import warnings

    warnings.filterwarnings("ignore")
    sys.path[:0] = [str(HERE.parent), str(HERE)]
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(json.dumps(fingerprints()))
