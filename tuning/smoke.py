"""Fused calls at given shapes and tactics, synchronously, in one process; for hang/fault
triage and compute-sanitizer: `python -m tuning.smoke M N K [field=value,...]` or
`python -m tuning.smoke --cases M:N:K[:field=value,...] ...`. Each case runs in every
output format of INDEXER_Q_SMOKE_FORMATS (comma-separated; default "mxfp4")."""
import os
import sys
import time

import torch

import indexer_q
from indexer_q import dispatch
from indexer_q.tactics import Tactic
from indexer_q.testing import make_inputs
from tuning.bench import parse_fields


def run_case(m: int, n: int, k: int, fields: dict) -> None:
    x = make_inputs(m, n, k, seed=0, device="cuda")
    w = indexer_q.prepare_weights(x["weight"], x["weight_scale"])
    tactic = Tactic(**fields)  # the fields given over Tactic's defaults (native, tile 128)
    for out_format in os.environ.get("INDEXER_Q_SMOKE_FORMATS", "mxfp4").split(","):
        t0 = time.time()
        if tactic.epilogue:
            indexer_q.fused_indexer_q(x["qr"], w, x["positions"], x["cos_sin"], hadamard=True, tactic=tactic,
                                      out_format=out_format)
        else:  # a profiling probe (no epilogue math): the api refuses it, the dispatcher runs it
            dispatch.run_fused(x["qr"], w, x["positions"], x["cos_sin"], hadamard=True, tactic=tactic,
                               fp4_rounding="floor-ties", out_format=out_format)
        torch.cuda.synchronize()
        print(f"ok M={m} N={n} K={k} {fields} {out_format} {time.time() - t0:.1f}s", flush=True)


def main(argv):
    if argv and argv[0] == "--cases":
        for case in argv[1:]:
            parts = case.split(":")
            run_case(*(int(v) for v in parts[:3]), parse_fields(parts[3]) if len(parts) > 3 else {})
    else:
        run_case(*(int(v) for v in argv[:3]), parse_fields(argv[3]) if len(argv) > 3 else {})


if __name__ == "__main__":
    main(sys.argv[1:])
