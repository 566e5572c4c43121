"""The two-kernel tactic's second launch alone (kernels/row_epilogue.py), by its layout
knobs: `python -m tuning.row_epilogue_bench M:N [...] [--lanes 4 8] [--units 1 2]`.
Prints a JSON line a case and variant: microseconds (CUDA graph, cold L2, median) and the
bytes it moves (y read, q and scales written) a second, against the device copy's rate."""
from __future__ import annotations

import argparse
import json

import torch

from indexer_q import jit
from indexer_q.reference import empty_outputs
from indexer_q.tactics import Tactic
from indexer_q.testing import rope_cos_sin_table
from tuning.bench import L2_BYTES, measure_copy_bandwidth, problem_bytes, time_graphs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("cases", nargs="+", help="M:N")
    ap.add_argument("--lanes", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--units", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out-format", default="mxfp4")
    args = ap.parse_args(argv)
    bw = measure_copy_bandwidth()
    numerics = dict(hadamard=True, fp4_rounding="floor-ties", out_format=args.out_format, positions_dtype="int64")
    config = Tactic(separate_epilogue=True).epilogue_config("sm_90a", **numerics)
    cos_sin = rope_cos_sin_table(4096, device="cuda")
    for case in args.cases:
        m, n = (int(v) for v in case.split(":"))
        y_bytes = m * n * 2
        sets = max(2, -(-3 * L2_BYTES // y_bytes))
        ys = [torch.randn(m, n, device="cuda").to(torch.bfloat16).view(torch.int32) for _ in range(sets)]
        positions = torch.randint(0, 4096, (m,), device="cuda")
        q, s = empty_outputs(m, n // 128, args.out_format, "cuda")
        q_words = q.view(torch.uint8).view(m, -1).view(torch.int32)
        s_words = s.view(torch.int32) if s is not None else torch.empty(1, 1, dtype=torch.int32, device="cuda")
        calls = {}
        for lanes in args.lanes:
            for units in args.units:
                kernel = jit.compile_row_epilogue(config, n, lanes_per_row=lanes, units_per_group=units)
                calls[f"lanes={lanes},units={units}"] = (
                    lambda i, kernel=kernel: kernel(ys[i], positions, cos_sin, q_words, s_words))
        times = time_graphs(calls, sets)
        moved = y_bytes + problem_bytes(m, n, 0, args.out_format)
        for name, us in times.items():
            print(json.dumps({"m": m, "n": n, "variant": name, "us": round(us, 2),
                              "TBps": round(moved / us / 1e6, 3), "copy_TBps": round(bw / 1e12, 3)}), flush=True)


if __name__ == "__main__":
    main()
