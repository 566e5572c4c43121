"""Where a call's time goes between kernels: `python -m tuning.chain_timeline --shapes v4-pro --m 64
--tactic kind=swap_ab,...` (GPU). Captures the bench's CUDA graph of 20 calls (cold L2: the input
sets rotate) for each tactic given (and the table's choice), replays it under the PyTorch
profiler and prints, per call, each kernel's start and end as CUPTI records them (start: its
first CTA; end: its last), relative to the previous call's GEMM end. Under PDL a kernel starts
before the previous one ends, so what matters is the ends: for the separate quantizer,
`quantizer end - previous GEMM end` is its time on the critical path and `GEMM end -
quantizer end` the GEMM's after its wait. Medians over the graph's calls 2-19. A measuring
tool, like trace_decode."""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from tuning.bench import SHAPES, _capture, cold_input_sets, n_cold_sets, parse_fields

CALLS = 20


def kernel_events(graph) -> list:
    """(name, start_us, end_us) of every kernel of one replay, by start."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0:
            out.append((e.name, e.time_range.start, e.time_range.end))
    return sorted(out, key=lambda t: t[1])


def split_calls(events: list, gemm_key: str) -> list:
    """Per call: {'gemm': (start, end), 'quantizer': (start, end) or absent}."""
    calls, pending = [], {}
    for name, start, end in events:
        if gemm_key in name:
            calls.append(dict(pending, gemm=(start, end)))
            pending = {}
        else:
            pending["quantizer"] = (start, end)
    return calls


def measure(shape: str, m: int, tactic) -> dict:
    import indexer_q

    n, k = SHAPES[shape]
    n_sets = n_cold_sets(m, n, k)
    sets = cold_input_sets(m, n, k, n_sets)
    weights = [indexer_q.prepare_weights(x["weight"], x["weight_scale"]) for x in sets]

    def call(i):
        x = sets[i]
        return indexer_q.fused_indexer_q(x["qr"], weights[i], x["positions"], x["cos_sin"], hadamard=True,
                                         tactic=tactic)

    graph = _capture(call, n_sets, CALLS)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    events = kernel_events(graph)
    calls = split_calls(events, "FusedIndexerQ")
    if len(calls) < 3:
        raise SystemExit(f"{len(calls)} GEMM kernels found among {sorted({e[0] for e in events})}")
    rows = []
    for prev, cur in zip(calls[1:-1], calls[2:]):
        g0 = prev["gemm"][1]
        row = {"gemm_start": cur["gemm"][0] - g0, "gemm_end": cur["gemm"][1] - g0}
        if "quantizer" in cur:
            row |= {"quantizer_start": cur["quantizer"][0] - g0, "quantizer_end": cur["quantizer"][1] - g0}
        rows.append(row)
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    return {"shape": shape, "M": m, "tactic": None if tactic is None else tactic.spec(), "calls": len(rows),
            "us_since_previous_gemm_end": med}


def main(argv=None):
    from indexer_q.tactics import Tactic

    ap = argparse.ArgumentParser(prog="python -m tuning.chain_timeline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["v4-pro"], choices=list(SHAPES))
    ap.add_argument("--m", type=int, nargs="+", default=[64])
    ap.add_argument("--tactic", nargs="*", default=[], help="tactics 'field=value,...' (the table's is timed too)")
    args = ap.parse_args(argv)
    tactics = [None] + [Tactic(**parse_fields(s)) for s in args.tactic]
    for shape in args.shapes:
        for m in args.m:
            for tactic in tactics:
                print(json.dumps(measure(shape, m, tactic)), flush=True)


if __name__ == "__main__":
    main()
