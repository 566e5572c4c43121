"""Agreement of the fused kernel with the reference, per case (run on a GPU):
fractions of identical FP4 codes / scale bytes and where the differences come from."""
from __future__ import annotations

import argparse
import itertools

import torch

import indexer_q
from indexer_q import reference as ref
from indexer_q.testing import fp4_signed_codes, make_inputs, scale_bytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[1, 128, 4096])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--k", type=int, default=1536)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--cublas", action="store_true", help="also score the cuBLAS-based unfused chain")
    ap.add_argument("--tactic", nargs="+", default=[""], help="'field=value,...' over the heuristic's")
    args = ap.parse_args()
    from indexer_q.tactics import heuristic
    import dataclasses

    from tuning.bench import parse_fields

    for spec, m, hadamard, rounding, seed in itertools.product(
            args.tactic, args.m, (False, True), ("floor-ties", "rne"), range(args.seeds)):
        fields = parse_fields(spec) if spec else {}
        tactic = dataclasses.replace(heuristic("sm_90a", m, args.n, args.k), **fields)
        x = make_inputs(m, args.n, args.k, p=4096, seed=seed, device="cuda")
        w = indexer_q.prepare_weights(x["weight"], x["weight_scale"])
        q, s = indexer_q.fused_indexer_q(x["qr"], w, x["positions"], x["cos_sin"], hadamard=hadamard,
                                         fp4_rounding=rounding, tactic=tactic)
        rq, rs = ref.fused_indexer_q(x["qr"], x["weight"], x["weight_scale"], x["positions"], x["cos_sin"],
                                     hadamard=hadamard, fp4_rounding=rounding)
        if args.cublas and m > 1:
            # the unfused Hopper chain's accuracy: cuBLAS block-scaled GEMM, then SPEC steps 3-5
            from tuning.bench import cublas_reference_chain

            cq, cs = cublas_reference_chain(x, hadamard=hadamard, out_format="mxfp4", fp4_rounding=rounding)
            cd = fp4_signed_codes(cq) != fp4_signed_codes(rq)
            print(f"   cublas chain: codes_eq={1 - cd.double().mean().item():.6f}")
        a, b = fp4_signed_codes(q), fp4_signed_codes(rq)
        same_scale = (scale_bytes(s) == scale_bytes(rs)).repeat_interleave(32, -1)
        diff = a != b
        codes_eq = 1 - diff.double().mean().item()
        print(f"[{spec}] M={m:6d} had={int(hadamard)} {rounding:10s} seed={seed} codes_eq={codes_eq:.6f} "
              f"scales_eq={(scale_bytes(s) == scale_bytes(rs)).double().mean().item():.6f} "
              f"diff_codes={int(diff.sum())} of {diff.numel()} "
              f"max_step_same_scale={int(torch.where(same_scale, (a - b).abs(), 0).max())}", flush=True)


if __name__ == "__main__":
    main()
