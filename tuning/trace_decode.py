"""Where a small-M launch spends its time inside the kernel:
`python -m tuning.trace_decode --shapes v4-pro --m 16 64 --tactic kind=swap_ab,tile_m=64,...`
(or a native tactic without pipelined_promotion, e.g. `kind=native,tile_m=128,...`).

Runs the tactic's probe (`epilogue=False`) compiled with `trace=True`: each CTA's consumer
and producer write SM clock stamps at phase boundaries into the unused q output (the slots
are listed in kernels/gemm_sm90_swap_ab.py and kernels/gemm_sm90.py; TRACE_SLOTS a CTA in
kernels/sm90_parts.py). Each run flushes L2, then reads qr once (an
engine's qr comes from the kernel before, in L2) and launches eagerly. Printed per phase:
cycles since the consumer's start, the median CTA and the slowest, medians over the runs;
the clock rate from the stamps' global timer. One JSON line per case.

`--stream`: as the bench sees it, the kernel launched twice back to back in a CUDA graph
(programmatic dependent launch lets the second start during the first's tail), on two
copies of the weight (both cold after the flush); the second launch's stamps are reported,
and each phase also from the end of its PDL wait (`since_pdl_wait`), where the CTA's own
work begins. The eager single launch pays a launch the bench does not see, and its
ranking of two tactics can differ from the bench's (NOTES, eighth session's trace).
`--with-quantizer` (tactics with the separate quantizer): each launch after the activation
quantizer, as the op runs them, so the weight requested before the PDL wait competes with
the quantizer as it does in the bench.
`--whole` (swapped-A/B tactics): the kernel itself, epilogue and all, traced instead of its
probe; the stamps then follow the q output in the same buffer, and the epilogue's first tile
(taken, stored) is stamped too. The probe's phases can mislead where the epilogue competes
with the K loop (30th session: a K loop 0.5 us sooner in the probe, no faster in the bench).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from tuning.bench import SHAPES, parse_fields

KBLOCKS = 12  # the swapped kernel's per-block stamps (kernels/sm90_parts.py TRACE_BLOCKS)
PHASES = {  # kind: {name: trace slot} (kernels/gemm_sm90_swap_ab.py, kernels/gemm_sm90.py)
    "swap_ab": {"pdl_wait": 2, "quantized": 3, **{f"kb{i}_ready": 4 + i for i in range(6)}, "k_loop_done": 10,
                "reduced": 11, "handed_off": 12, "producer_start": 14, "producer_issued_all": 15,
                "quantizer_start": 16, "own_units_quantized": 17, "epilogue_took_first": 18,
                "epilogue_stored_first": 19, **{f"quantizer_batch{j}_done": 20 + j for j in range(3)},
                "quantizer_loads_landed": 23, **{f"kb{i}_wait_began": 24 + i for i in range(KBLOCKS)},
                **{f"kb{i}_in_smem": 24 + KBLOCKS + i for i in range(KBLOCKS)},
                **{f"kb{i}_requested": 24 + 2 * KBLOCKS + i for i in range(KBLOCKS)}},
    "native": {"pdl_wait": 2, "producer_pdl_wait": 3, **{f"kb{i}_ready": 4 + i for i in range(6)},
               "k_loop_done": 10, "handed_off": 12, "producer_start": 14, "producer_issued_all": 15},
}


def trace_outputs(m: int, n: int, device, ctas: int, whole: bool = False):
    """(buffer, q_words, q_scale words, stamps): the MXFP4 q output of M tokens as int32
    words at the start of a zeroed byte buffer that also holds `ctas` CTAs' stamps, a row of
    TRACE_SLOTS int64 a CTA: from the q output's start (a probe writes no q; past its M rows
    where M is small), or (`whole`: the kernel writes q) right after it. `stamps` is that
    part of the buffer."""
    from indexer_q.kernels.sm90_parts import TRACE_SLOTS

    q_bytes = m * (n // 2)
    stamp_bytes = ctas * TRACE_SLOTS * 8
    buffer = torch.zeros(q_bytes + stamp_bytes if whole else max(q_bytes, stamp_bytes), dtype=torch.uint8,
                         device=device)
    q_words = buffer[:q_bytes].view(m, n // 2).view(torch.int32)
    stamps = buffer[q_bytes:] if whole else buffer[:stamp_bytes]
    return buffer, q_words, torch.empty(m, n // 128, dtype=torch.int32, device=device), stamps


def trace_once(kernel, operands, x, m: int, n: int, flush: torch.Tensor, ctas: int, whole: bool) -> torch.Tensor:
    buffer, q_words, scale_words, stamps = trace_outputs(m, n, x["qr"].device, ctas, whole)
    _cold_start(buffer, flush, x)
    kernel(*operands, x["positions"], x["cos_sin"], q_words, scale_words)
    torch.cuda.synchronize()
    return _stamps(stamps)


def _cold_start(buffer: torch.Tensor, flush: torch.Tensor, x: dict) -> None:
    """Before a traced run: the stamps' buffer zeroed, L2 flushed, qr read back into it."""
    buffer.fill_(0)
    flush.add_(1)  # evicts the weight (and everything else) from L2
    x["qr"].float().sum()  # qr back in L2, as after the kernel that wrote it


def _stamps(buffer: torch.Tensor) -> torch.Tensor:
    """The stamps the probe wrote, a row of TRACE_SLOTS int64 a CTA (the buffer's whole rows)."""
    from indexer_q.kernels.sm90_parts import TRACE_SLOTS

    row = TRACE_SLOTS * 8
    return buffer[: buffer.numel() // row * row].view(torch.int64).view(-1, TRACE_SLOTS).clone()


class StreamTrace:
    """Two launches captured back to back in one CUDA graph, the second on its own copy
    of the weight; `run` flushes L2, brings qr back and replays, returning the second
    launch's stamps."""

    def __init__(self, kernel, operands, second_operands, x, m: int, n: int, flush: torch.Tensor, ctas: int,
                 whole: bool, quantize=None):
        """quantize: the activation quantizer, launched before each GEMM into that launch's
        operands (their first two), as the op runs them; None: GEMM launches only."""
        self.x, self.flush = x, flush
        outs = [trace_outputs(m, n, x["qr"].device, ctas, whole) for _ in range(2)]
        self.outputs = outs  # both launches' buffers live as long as the graph that writes them
        self.buffer, self.stamps = outs[1][0], outs[1][3]
        calls = [(ops, q_words, scale_words)
                 for ops, (_, q_words, scale_words, _) in zip((operands, second_operands), outs)]

        def launch_both():
            for ops, q_words, s_words in calls:
                if quantize is not None:
                    quantize(x["qr"], ops[:2])
                kernel(*ops, x["positions"], x["cos_sin"], q_words, s_words)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            launch_both()  # warm up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            launch_both()

    def run(self) -> torch.Tensor:
        _cold_start(self.buffer, self.flush, self.x)
        self.graph.replay()
        torch.cuda.synchronize()
        return _stamps(self.stamps)


def measure(shape: str, m: int, tactic, runs: int, stream: bool = False, with_quantizer: bool = False,
            whole: bool = False) -> dict:
    import indexer_q
    from indexer_q import dispatch, jit
    from indexer_q.testing import make_inputs

    n, k = SHAPES[shape]
    x = make_inputs(m, n, k, seed=0, device="cuda")
    w = indexer_q.prepare_weights(x["weight"], x["weight_scale"])
    probe = tactic if whole else dataclasses.replace(tactic, epilogue=False)
    positions_dtype = "int64" if x["positions"].dtype == torch.int64 else "int32"
    config = dataclasses.replace(probe.to_config("sm_90a", hadamard=True, fp4_rounding="floor-ties",
                                                 out_format="mxfp4", positions_dtype=positions_dtype), trace=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kernel = jit.compile_fused(config, n, k, sms=sms)
    if tactic.fused_act_quant:
        operands = (x["qr"], w.weight, w.weight_scale)
    else:
        operands = dispatch._operands("sm_90a", *dispatch.run_act_quant(x["qr"], None), w)
    # the persistent grid has at most one CTA an SM (jit's compile_args); the CTAs that ran
    # are those that stamped their start (the buffer is zeroed before each run)
    flush = torch.zeros(64 << 20, dtype=torch.int32, device="cuda")  # 256 MB, five times L2
    if stream:
        second = (operands[0], operands[1].clone(), operands[2].clone()) if tactic.fused_act_quant else \
            (*operands[:2], operands[2].clone(), operands[3].clone())
        quantize = dispatch.run_act_quant if with_quantizer and not tactic.fused_act_quant else None
        tracer = StreamTrace(kernel, operands, second, x, m, n, flush, sms, whole, quantize=quantize)
    # phases from the CTA's start, and (stream) from the end of its PDL wait as well
    origins = {"": 1, "since_pdl_wait:": 2} if stream else {"": 1}
    phases_of_kind = PHASES[tactic.kind]
    per_phase = {o + name: {"median": [], "max": []} for o in origins for name in phases_of_kind}
    rates, spans, raw_runs = [], [], []
    for _ in range(runs):
        raw = tracer.run() if stream else trace_once(kernel, operands, x, m, n, flush, sms, whole)
        stamps = [s for s in raw[:sms].tolist() if s[1] != 0]
        raw_runs.append(stamps)
        if not stamps:
            raise SystemExit(f"no CTA stamped its start at {shape} M={m}: is the kernel traced?")
        ctas = len(stamps)
        for origin, origin_slot in origins.items():
            start = [s[origin_slot] for s in stamps]
            for name, slot in phases_of_kind.items():
                d = sorted(s[slot] - s0 for s, s0 in zip(stamps, start) if s[slot] != 0 and s0 != 0)
                if d:
                    per_phase[origin + name]["median"].append(d[len(d) // 2])
                    per_phase[origin + name]["max"].append(d[-1])
        rates += [(s[12] - s[1]) / (s[13] - s[0]) for s in stamps if s[13] > s[0]]
        # us, first start to last hand-off
        spans.append((max(s[13] for s in stamps) - min(s[0] for s in stamps)) / 1000)
    ghz = statistics.median(rates) if rates else float("nan")
    phases = {name: {"cycles_median_cta": statistics.median(v["median"]),
                     "cycles_slowest_cta": statistics.median(v["max"]),
                     "us_median_cta": statistics.median(v["median"]) / ghz / 1000,
                     "us_slowest_cta": statistics.median(v["max"]) / ghz / 1000}
              for name, v in per_phase.items() if v["median"]}
    return {"shape": shape, "M": m, "N": n, "K": k, "tactic": tactic.as_dict(), "ctas": ctas, "runs": runs,
            "launches": ("two in a CUDA graph, the second's stamps" + (", each after the activation quantizer"
                                                                          if with_quantizer else "")
                         if stream else "one, eager"),
            "traced": "the kernel with its epilogue" if whole else "its probe (epilogue=False)",
            "sm_clock_GHz": ghz, "consumer_span_us": statistics.median(spans), "phases": phases,
            "raw_stamps": raw_runs}


def main(argv=None):
    from indexer_q.tactics import Tactic

    ap = argparse.ArgumentParser(prog="python -m tuning.trace_decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["v4-pro"], choices=list(SHAPES))
    ap.add_argument("--m", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--tactic", required=True, help="tactic fields, e.g. kind=swap_ab,tile_m=64,split_k=2 or "
                    "kind=native,tile_m=128,epilogue_warpgroups=2 (native: no pipelined_promotion)")
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--stream", action="store_true",
                    help="two launches back to back in a CUDA graph (PDL), the second's stamps")
    ap.add_argument("--whole", action="store_true",
                    help="trace the kernel with its epilogue (swap_ab), not its probe")
    ap.add_argument("--raw", metavar="FILE", help="also write every run's stamps (a row a CTA, SM clocks) as JSON")
    ap.add_argument("--with-quantizer", action="store_true",
                    help="--stream: each GEMM launch after the activation quantizer, as the op runs them "
                    "(tactics without fused_act_quant)")
    args = ap.parse_args(argv)
    if args.with_quantizer and not args.stream:
        ap.error("--with-quantizer needs --stream")
    tactic = Tactic(**parse_fields(args.tactic))
    if args.whole and tactic.kind != "swap_ab":
        ap.error("--whole: only the swapped-A/B kernel is traced with its epilogue")
    if args.with_quantizer and tactic.fused_act_quant:
        ap.error("--with-quantizer: this tactic quantizes the activation itself (fused_act_quant)")
    raw = []
    for shape in args.shapes:
        for m in args.m:
            row = measure(shape, m, tactic, args.runs, stream=args.stream, with_quantizer=args.with_quantizer,
                          whole=args.whole)
            raw.append({"shape": shape, "M": m, "runs": row.pop("raw_stamps")})
            print(json.dumps(row), flush=True)
            for name, p in row["phases"].items():
                print(f"  {shape} M={m} {name:20s} {p['us_median_cta']:6.2f} us "
                      f"(slowest CTA {p['us_slowest_cta']:6.2f})")
    if args.raw:
        with open(args.raw, "w") as f:
            json.dump(raw, f)


if __name__ == "__main__":
    main()
