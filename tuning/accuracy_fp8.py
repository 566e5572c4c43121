"""Where the FP8 output formats differ from the float64 reference (run on a GPU): per
case, the fraction of identical e4m3 bytes, the largest step, and for every value more
than one step away the reference's |value| (e4m3 units) and the bf16 GEMM output's error,
for our kernel (any tactic) and for cuBLAS's block-scaled GEMM + reference steps 3-6."""
from __future__ import annotations

import argparse
import dataclasses
import itertools

import torch

import indexer_q
from indexer_q import dispatch
from indexer_q import reference as ref
from indexer_q.tactics import heuristic
from indexer_q.testing import e4m3_ordinal, make_inputs


def steps(a, b):
    d = (a - b).abs()
    return torch.where((a.abs() <= 1) & (b.abs() <= 1), d.clamp(max=1), d)


def describe(tag, q, rq):
    a, b = e4m3_ordinal(q.cpu()), e4m3_ordinal(rq.cpu())
    st = steps(a, b)
    far = st > 1
    ref_vals = rq.cpu().float().abs()[far]
    print(f"  {tag:28s} eq={(a == b).double().mean().item():.6f} max_step={int(st.max())} "
          f"n_far={int(far.sum())} far|ref| max={ref_vals.max().item() if ref_vals.numel() else 0:.4g} "
          f"median={ref_vals.median().item() if ref_vals.numel() else 0:.4g}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[1000, 4096])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--k", type=int, default=1536)
    ap.add_argument("--tactic", nargs="+", default=[""])
    args = ap.parse_args()
    from tuning.bench import cublas_gemm, cublas_reference_chain, parse_fields

    for m, hadamard, fmt in itertools.product(args.m, (False, True), ("fp8", "fp8-unscaled")):
        x = make_inputs(m, args.n, args.k, p=4096, seed=m, device="cuda")
        w = indexer_q.prepare_weights(x["weight"], x["weight_scale"])
        print(f"M={m} N={args.n} K={args.k} had={int(hadamard)} {fmt}", flush=True)
        rq, rs = ref.fused_indexer_q(x["qr"], x["weight"], x["weight_scale"], x["positions"], x["cos_sin"],
                                     hadamard=hadamard, out_format=fmt)
        for spec in args.tactic:
            tactic = dataclasses.replace(heuristic("sm_90a", m, args.n, args.k), **(parse_fields(spec) if spec else {}))
            q, s = dispatch.run_fused(x["qr"], w, x["positions"], x["cos_sin"], hadamard=hadamard,
                                      fp4_rounding="floor-ties", out_format=fmt, tactic=tactic, verified_only=False)
            torch.cuda.synchronize()
            describe(f"kernel[{spec or 'default'}]", q, rq)
        qc = cublas_gemm(x)
        cq, cs = cublas_reference_chain(x, hadamard=hadamard, out_format=fmt, q=qc)
        describe("cublas chain", cq, rq)
        for spec in args.tactic:  # the kernel against the reference epilogue on cuBLAS's bf16 q
            tactic = dataclasses.replace(heuristic("sm_90a", m, args.n, args.k), **(parse_fields(spec) if spec else {}))
            q, s = dispatch.run_fused(x["qr"], w, x["positions"], x["cos_sin"], hadamard=hadamard,
                                      fp4_rounding="floor-ties", out_format=fmt, tactic=tactic, verified_only=False)
            same = (q.view(torch.uint8) == cq.view(torch.uint8)).double().mean().item()
            same_s = "-" if s is None else f"{(s == cs).double().mean().item():.6f}"
            print(f"  kernel[{spec or 'default'}] bytes equal to the cuBLAS chain's: {same:.6f} scales {same_s}",
                  flush=True)
        # the bf16 GEMM output itself: cuBLAS against the float64 step 2
        a, sa = ref.quantize_act_fp8(x["qr"])
        q64 = ref.block_scaled_gemm(a, sa, x["weight"], x["weight_scale"])
        err = (qc.float().cpu() - q64.float().cpu()).abs()
        print(f"  cublas bf16 q vs float64: differ={(err > 0).double().mean().item():.6f} "
              f"max_abs_err={err.max().item():.4g} rms_q={q64.float().pow(2).mean().sqrt().item():.4g}", flush=True)


if __name__ == "__main__":
    main()
