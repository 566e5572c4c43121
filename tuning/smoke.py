"""One fused call at a given shape and tactic, synchronously; for hang/fault triage:
`timeout 60 python -m tuning.smoke M N K [field=value,...]`."""
import dataclasses
import sys
import time

import torch

import indexer_q
from indexer_q.tactics import heuristic
from indexer_q.testing import make_inputs
from tuning.bench import parse_fields

m, n, k = (int(v) for v in sys.argv[1:4])
fields = parse_fields(sys.argv[4]) if len(sys.argv) > 4 else {}
x = make_inputs(m, n, k, seed=0, device="cuda")
w = indexer_q.prepare_weights(x["weight"], x["weight_scale"])
tactic = dataclasses.replace(heuristic("sm_90a", m, n, k), **fields)
t0 = time.time()
q, s = indexer_q.fused_indexer_q(x["qr"], w, x["positions"], x["cos_sin"], hadamard=True, tactic=tactic)
torch.cuda.synchronize()
print(f"ok M={m} N={n} K={k} {fields} {time.time() - t0:.1f}s", flush=True)
