"""Side-by-side timing of the fused op and its peers (one process, CUDA graphs, cold L2).

Each contender is captured in a CUDA graph that calls it `reps` times, cycling through
enough independent input sets that every call reads its operands from HBM, not L2.
The figure is the median over replays of (graph time / reps).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics

import torch

import indexer_q
from indexer_q import reference as ref
from indexer_q.testing import make_inputs

H200_FP8_PEAK_TFLOPS = 1979.0  # dense, datasheet
L2_BYTES = 60 * 2**20


def time_graph(call, n_sets: int, reps: int = 20, replays: int = 15) -> float:
    """Median microseconds per call of `call(i)` (i = input set), replayed in a graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(n_sets, 3)):  # warm up: compile, allocate
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for r in range(reps):
            call(r % n_sets)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def measure_copy_bandwidth() -> float:
    """Bytes read + written per second of a large device-to-device copy."""
    src = torch.empty(2**28, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    us = time_graph(lambda i: dst.copy_(src), 1, reps=5, replays=7)
    return 2 * src.numel() * src.element_size() / (us * 1e-6)


def cublas_args(x):
    """torch._scaled_mm operands for the SPEC's block scales (see CUTEDSL-NOTES.md)."""
    a, sa = ref.quantize_act_fp8(x["qr"])
    return dict(a=a, sa=sa.t().contiguous().t(), b=x["weight"].t(), sb=x["weight_scale"].t())


def run_cublas(c):
    return torch._scaled_mm(c["a"], c["b"], scale_a=c["sa"], scale_b=c["sb"], out_dtype=torch.bfloat16)


def problem_bytes(m, n, k) -> int:
    # qr (bf16) + weight (fp8) + its scales + q_fp4 + q_scale + positions + cos_sin rows
    return m * k * 2 + n * k + (n // 128) * (k // 128) * 4 + m * n // 2 + m * (n // 128) * 4 + m * 8 + m * 256


def bench_shape(m, n, k, bw, *, hadamard=True, out_format="mxfp4", tactics=None) -> dict:
    one_set = m * k * 2 + n * k + m * n
    n_sets = max(2, math.ceil(3 * L2_BYTES / one_set))
    sets = [make_inputs(m, n, k, p=4096, seed=s, device="cuda") for s in range(n_sets)]
    weights = [indexer_q.prepare_weights(x["weight"], x["weight_scale"]) for x in sets]
    row = {"M": m, "N": n, "K": k, "hadamard": hadamard, "out_format": out_format}

    def fused(i, tactic=None):
        x = sets[i]
        return indexer_q.fused_indexer_q(x["qr"], weights[i], x["positions"], x["cos_sin"],
                                         hadamard=hadamard, out_format=out_format, tactic=tactic)

    row["fused_us"] = time_graph(fused, n_sets)
    for name, tac in (tactics or {}).items():
        row[f"fused[{name}]_us"] = time_graph(lambda i, t=tac: fused(i, t), n_sets)
    row["act_quant_us"] = time_graph(lambda i: indexer_q.quantize_act_fp8(sets[i]["qr"]), n_sets)
    if m > 1:  # cuBLAS rejects M = 1
        cargs = [cublas_args(x) for x in sets]
        row["cublas_gemm_us"] = time_graph(lambda i: run_cublas(cargs[i]), n_sets)
    flops = 2 * m * n * k
    row["floor_us"] = max(problem_bytes(m, n, k) / bw, flops / (H200_FP8_PEAK_TFLOPS * 1e12)) * 1e6
    row["fused_tflops"] = flops / (row["fused_us"] * 1e-6) / 1e12
    if "cublas_gemm_us" in row:
        row["fused_over_cublas"] = row["fused_us"] / row["cublas_gemm_us"]
    row["fused_over_floor"] = row["fused_us"] / row["floor_us"]
    return row


def parse_fields(spec: str) -> dict:
    out = {}
    for item in spec.split(","):
        key, value = item.split("=")
        out[key] = value == "True" if value in ("True", "False") else int(value) if value.isdigit() else value
    return out


def environment() -> dict:
    import cutlass

    props = torch.cuda.get_device_properties(0)
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cutlass_dsl": getattr(cutlass, "__version__", "?"),
        "indexer_q": indexer_q.__version__ if hasattr(indexer_q, "__version__") else "?",
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--m", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--shapes", nargs="+", default=["v4-pro", "v4-flash"])
    ap.add_argument("--no-hadamard", action="store_true")
    ap.add_argument("--out-format", default="mxfp4")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tactic", nargs="*", default=[],
                    help="also time forced tactics, each 'field=value,field=value' over the heuristic's")
    args = ap.parse_args(argv)
    shapes = {"v4-pro": (8192, 1536), "v4-flash": (8192, 1024), "tp8-pro": (1024, 1536)}
    bw = measure_copy_bandwidth()
    env = environment() | {"copy_bandwidth_TBps": bw / 1e12}
    print(json.dumps(env))
    rows = []
    for shape in args.shapes:
        n, k = shapes[shape]
        for m in args.m:
            from indexer_q.tactics import heuristic
            import dataclasses

            tactics = {spec: dataclasses.replace(heuristic("sm_90a", m, n, k), **parse_fields(spec))
                       for spec in args.tactic}
            row = {"shape": shape} | bench_shape(m, n, k, bw, hadamard=not args.no_hadamard,
                                                  out_format=args.out_format, tactics=tactics)
            rows.append(row)
            print(json.dumps({a: (round(b, 3) if isinstance(b, float) else b) for a, b in row.items()}),
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
