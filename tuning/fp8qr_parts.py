"""The op given quantized qr against DeepGEMM's GEMM on the same inputs, split into its
probe and its epilogue tail: `python -m tuning.fp8qr_parts [--shapes v4-pro] [--m 128 256]
[--twin pdl=False ...]`.

Timed as the bench times (tuning/bench.py: CUDA graphs of 20 calls, cold L2, median,
replays interleaved), in one process, per (shape, M):
  dg_nopdl, dg_pdl  DeepGEMM's GEMM alone without / with programmatic dependent launch
  op                the op on quantized qr (`qr_scale`), the tactic its table picks
  probe             the same kernel without the epilogue math (`epilogue=False`)
  op[F=V], probe[F=V]  the same with each --twin's fields replaced
tail = op - probe: what the epilogue adds once the K loop is done (one tile a CTA at
M <= ~16K / heads, so nothing hides it). Nsight Compute counts the same in cycles for
one launch (tuning/profile.sh); this is the bench's view, with launches back to back.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from tuning.bench import SHAPES, cold_input_sets, n_cold_sets, parse_fields, time_graphs
from tuning.peers import deepgemm


def measure(m: int, n: int, k: int, twins: list[dict]) -> dict:
    import indexer_q
    from indexer_q import dispatch

    sets = cold_input_sets(m, n, k, n_cold_sets(m, n, k))
    ws = [indexer_q.prepare_weights(x["weight"], x["weight_scale"]) for x in sets]
    quantized = [indexer_q.quantize_act_fp8(x["qr"]) for x in sets]
    table_tactic = dispatch.choose_tactic("sm_90a", sets[0]["qr"].device, m, n, k, None, quantized_input=True)
    variants = {"": table_tactic}
    for fields in twins:
        name = ",".join(f"{f}={v}" for f, v in fields.items())
        variants[f"[{name}]"] = dataclasses.replace(table_tactic, **fields)

    def op(i, tactic):
        x = sets[i]
        return dispatch.run_fused(quantized[i][0], ws[i], x["positions"], x["cos_sin"], hadamard=True,
                                  fp4_rounding="floor-ties", out_format="mxfp4", tactic=tactic,
                                  verified_only=False, qr_scale=quantized[i][1])

    calls = {}
    for suffix, tactic in variants.items():
        calls[f"op{suffix}"] = lambda i, t=tactic: op(i, t)
        calls[f"probe{suffix}"] = lambda i, t=dataclasses.replace(tactic, epilogue=False): op(i, t)
    deepgemm.load()
    dargs = [deepgemm.gemm_args(x, *q) for x, q in zip(sets, quantized)]
    deepgemm.run_gemm(dargs[0])  # its JIT compile, outside the timing
    torch.cuda.synchronize()
    calls["dg_nopdl"] = lambda i: deepgemm.run_gemm_pdl(dargs[i], False)
    if deepgemm.set_pdl(False):
        calls["dg_pdl"] = lambda i: deepgemm.run_gemm_pdl(dargs[i], True)
    us = time_graphs(calls, len(sets), replays=21)
    dg = min(v for name, v in us.items() if name.startswith("dg_"))
    row = {"M": m, "N": n, "K": k, "tactic": table_tactic.as_dict(), **{f"{a}_us": b for a, b in us.items()},
           "dg_us": dg}
    for suffix in variants:
        row[f"tail{suffix}_us"] = us[f"op{suffix}"] - us[f"probe{suffix}"]
        row[f"op{suffix}_over_dg"] = us[f"op{suffix}"] / dg
        row[f"probe{suffix}_over_dg"] = us[f"probe{suffix}"] / dg
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tuning.fp8qr_parts", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--shapes", nargs="+", default=["v4-pro"], choices=list(SHAPES))
    ap.add_argument("--twin", nargs="*", default=[], help="field=value[,field=value] over the table's tactic")
    ap.add_argument("--out", default=None, help="JSON lines file")
    args = ap.parse_args(argv)
    twins = [parse_fields(t) for t in args.twin]
    for shape in args.shapes:
        n, k = SHAPES[shape]
        for m in args.m:
            row = {"shape": shape, **measure(m, n, k, twins)}
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
