"""Where a swapped-A/B decode launch spends its time inside the kernel:
`python -m tuning.trace_decode --shapes v4-pro --m 16 64 --tactic kind=swap_ab,tile_m=64,...`.

Runs the tactic's probe (`epilogue=False`) compiled with `trace=True`: each CTA's consumer
and producer write SM clock stamps at phase boundaries into the unused q output
(kernels/gemm_sm90_swap_ab.py, TRACE_SLOTS). Each run flushes L2, then reads qr once (an
engine's qr comes from the kernel before, in L2) and launches eagerly. Printed per phase:
cycles since the consumer's start, the median CTA and the slowest, medians over the runs;
the clock rate from the stamps' global timer. One JSON line per case.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from tuning.bench import SHAPES, parse_fields

PHASES = {  # name: trace slot (kernels/gemm_sm90_swap_ab.py)
    "pdl_wait": 2, "quantized": 3, **{f"kb{i}_ready": 4 + i for i in range(6)}, "k_loop_done": 10,
    "reduced": 11, "handed_off": 12, "producer_start": 14, "producer_issued_all": 15}


def trace_once(kernel, operands, x, m: int, n: int, flush: torch.Tensor) -> torch.Tensor:
    from indexer_q.reference import empty_outputs

    q, q_scale = empty_outputs(m, n // 128, "mxfp4", x["qr"].device)
    q.view(torch.uint8).fill_(0)
    flush.add_(1)  # evicts the weight (and everything else) from L2
    x["qr"].float().sum()  # qr back in L2, as after the kernel that wrote it
    q_words = q.view(torch.uint8).view(m, -1).view(torch.int32)
    kernel(*operands, x["positions"], x["cos_sin"], q_words, q_scale.view(torch.int32))
    torch.cuda.synchronize()
    return q.view(torch.uint8).reshape(-1).view(torch.int64).clone()


def measure(shape: str, m: int, tactic, runs: int) -> dict:
    import indexer_q
    from indexer_q import dispatch, jit
    from indexer_q.kernels.gemm_sm90_swap_ab import TRACE_SLOTS
    from indexer_q.testing import make_inputs

    n, k = SHAPES[shape]
    x = make_inputs(m, n, k, seed=0, device="cuda")
    w = indexer_q.prepare_weights(x["weight"], x["weight_scale"])
    probe = dataclasses.replace(tactic, epilogue=False)
    positions_dtype = "int64" if x["positions"].dtype == torch.int64 else "int32"
    config = dataclasses.replace(probe.to_config("sm_90a", hadamard=True, fp4_rounding="floor-ties",
                                                 out_format="mxfp4", positions_dtype=positions_dtype), trace=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kernel = jit.compile_fused(config, n, k, sms=sms)
    if tactic.fused_act_quant:
        operands = (x["qr"], w.weight, w.weight_scale)
    else:
        operands = dispatch._operands("sm_90a", *dispatch.run_act_quant(x["qr"], None), w)
    # the persistent grid: sms // split_k clusters of split_k CTAs at most (jit's compile_args)
    ctas = min((sms // tactic.split_k) * tactic.split_k, (n // 128) * -(-m // tactic.tile_m) * tactic.split_k)
    if m * (n // 2) < ctas * TRACE_SLOTS * 8:
        raise SystemExit(f"q output too small for the trace at M={m}")
    flush = torch.zeros(64 << 20, dtype=torch.int32, device="cuda")  # 256 MB, five times L2
    per_phase = {name: {"median": [], "max": []} for name in PHASES}
    rates, spans = [], []
    for _ in range(runs):
        stamps = trace_once(kernel, operands, x, m, n, flush).view(-1, TRACE_SLOTS)[:ctas].tolist()
        start = [s[1] for s in stamps]
        for name, slot in PHASES.items():
            d = sorted(s[slot] - s0 for s, s0 in zip(stamps, start) if s[slot] != 0)
            if d:
                per_phase[name]["median"].append(d[len(d) // 2])
                per_phase[name]["max"].append(d[-1])
        rates += [(s[12] - s[1]) / (s[13] - s[0]) for s in stamps if s[13] > s[0]]
        spans.append((max(s[13] for s in stamps) - min(s[0] for s in stamps)) / 1000)  # us, first start to last hand-off
    ghz = statistics.median(rates) if rates else float("nan")
    phases = {name: {"cycles_median_cta": statistics.median(v["median"]), "cycles_slowest_cta": statistics.median(v["max"]),
                     "us_median_cta": statistics.median(v["median"]) / ghz / 1000,
                     "us_slowest_cta": statistics.median(v["max"]) / ghz / 1000}
              for name, v in per_phase.items() if v["median"]}
    return {"shape": shape, "M": m, "N": n, "K": k, "tactic": tactic.as_dict(), "ctas": ctas, "runs": runs,
            "sm_clock_GHz": ghz, "consumer_span_us": statistics.median(spans), "phases": phases}


def main(argv=None):
    from indexer_q.tactics import Tactic

    ap = argparse.ArgumentParser(prog="python -m tuning.trace_decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["v4-pro"], choices=list(SHAPES))
    ap.add_argument("--m", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--tactic", required=True, help="swap_ab tactic fields, e.g. kind=swap_ab,tile_m=64,split_k=2")
    ap.add_argument("--runs", type=int, default=9)
    args = ap.parse_args(argv)
    tactic = Tactic(**parse_fields(args.tactic))
    for shape in args.shapes:
        for m in args.m:
            row = measure(shape, m, tactic, args.runs)
            print(json.dumps(row), flush=True)
            for name, p in row["phases"].items():
                print(f"  {shape} M={m} {name:20s} {p['us_median_cta']:6.2f} us (slowest CTA {p['us_slowest_cta']:6.2f})")


if __name__ == "__main__":
    main()
