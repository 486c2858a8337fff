"""smollm2-135m (trained 8K): next-token NLL beyond 8K with the plain model vs dkcache's compensated prefill.

Usage: python benchmarks/dkcache_beyond_trained.py 16384 [out.json]
"""

import json
import pydoc_data.topics as topics
import sys
import time

import torch

import kvweave
from kvweave._compat import cache_kwarg

torch.set_num_threads(2)
model, tok = kvweave.load_model("smollm2-135m")
text = "\n\n".join(topics.topics.values())
ids = tok(text, return_tensors="pt").input_ids[:, : int(sys.argv[1]) if len(sys.argv) > 1 else 10240]
n = ids.shape[1]
spans = {"7K-8K": (7168, 8192), "9K-10K": (9216, 10240), "12K-13K": (12288, 13312), "15K-16K": (15360, 16384)}


def nll(logits, lo, hi):
    lp = torch.log_softmax(logits[0, lo - 1 : hi - 1].float(), -1)
    return -lp.gather(-1, ids[0, lo:hi].view(-1, 1)).mean().item()


results = {"tokens": n}
for name, spec in [("plain", None), ("dkcache", "dkcache")]:
    t = time.time()
    kwargs = {} if spec is None else {cache_kwarg(model): kvweave.make_cache(spec, model)}
    with torch.no_grad():
        logits = model(ids, **kwargs).logits
    results[name] = {k: round(nll(logits, lo, hi), 4) for k, (lo, hi) in spans.items() if hi <= n}
    results[name]["seconds"] = round(time.time() - t, 1)
    if spec:
        results[name]["group_size"] = kwargs[cache_kwarg(model)].stats()["layers"][0]["group_size"]
    print(name, results[name], flush=True)
out = sys.argv[2] if len(sys.argv) > 2 else f"dkcache_beyond_trained_{n}.json"
json.dump(results, open(out, "w"), indent=1)
