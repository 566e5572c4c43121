"""Where the decode time goes: `python -m tuning.decode_parts [--m 1 8] [--tactic field=value,...]`.

Measured in one process, CUDA graphs of 20 calls, cold L2, median, replays interleaved
(tuning/bench.py's timing), for each shape:
  empty          an empty CuTe DSL kernel launched like ours (TVM-FFI, one CTA per SM)
  probe_k128     the fused op's kernel with K = 128 and no epilogue math (`epilogue=False`:
                 launch, prologue, the first weight bytes, one K block, the hand-off)
  probe          the same at the model's K (the whole weight stream)
  full           the fused op
Parts: first weight bytes = probe_k128 - empty; weight stream = probe - probe_k128
(against the weight's bytes at the measured copy bandwidth); epilogue tail = full - probe.

`--chain` (tactics with the separate quantizer): instead of the probes, what the separate
activation quantizer costs inside the op:
  act_quant      the quantizer alone (its PDL launches back to back)
  gemm_only      the fused kernel alone on an activation quantized once, outside the graph
  full           the fused op (quantizer, then the kernel)
chain cost = full - gemm_only, against act_quant alone. `--tables`: each M's tactic from the
packaged tables (as the op picks it) instead of the heuristic's.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import cutlass
import cutlass.cute as cute
import torch

from tuning.bench import SHAPES, cold_input_sets, measure_copy_bandwidth, n_cold_sets, parse_fields, time_graphs


class EmptyKernel:
    """One CTA per SM, 128 threads, no work: the floor of any kernel launch here."""

    @cute.jit
    def __call__(self, x: cute.Tensor, ctas: cutlass.Constexpr, stream):
        self.kernel(x).launch(grid=[ctas, 1, 1], block=[128, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Tensor):
        pass


def compile_empty(ctas: int):
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    x = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=16)
    return cute.compile(EmptyKernel(), x, ctas, make_fake_stream(use_tvm_ffi_env_stream=True),
                        options="--enable-tvm-ffi")


def measure(m: int, n: int, k: int, tactic, bw: float, hadamard: bool = True, out_format: str = "mxfp4",
            warm: bool = False) -> dict:
    import indexer_q
    from indexer_q import dispatch

    empty = compile_empty(torch.cuda.get_device_properties(0).multi_processor_count)
    dummy = torch.zeros(16, dtype=torch.int32, device="cuda")
    probe = dataclasses.replace(tactic, epilogue=False)
    calls = {"empty": lambda i: empty(dummy)}
    # one K block can be neither split, pipelined nor shared by heads: the K = 128 probe runs without them
    one_block = dataclasses.replace(probe, split_k=1, pipelined_promotion=False, cluster_n=1)
    for name, kk, t in (("probe_k128", 128, one_block), ("probe", k, probe),
                        ("full", k, tactic)):
        sets = cold_input_sets(m, n, kk, n_cold_sets(m, n, kk, warm), warm_activations=warm)
        ws = [indexer_q.prepare_weights(x["weight"], x["weight_scale"]) for x in sets]

        def call(i, sets=sets, ws=ws, t=t):
            x = sets[i % len(sets)]
            return dispatch.run_fused(x["qr"], ws[i % len(sets)], x["positions"], x["cos_sin"], hadamard=hadamard,
                                      fp4_rounding="floor-ties", out_format=out_format, tactic=t,
                                      verified_only=False)
        calls[name] = call
    n_sets = max(n_cold_sets(m, n, k, warm), n_cold_sets(m, n, 128, warm))
    us = time_graphs(calls, n_sets, replays=21)
    weight_us = n * k / bw * 1e6
    return {"M": m, "N": n, "K": k, "hadamard": hadamard, "out_format": out_format, "warm_activations": warm,
            "tactic": tactic.as_dict(),
            **{f"{a}_us": b for a, b in us.items()}, "first_bytes_us": us["probe_k128"] - us["empty"],
            "stream_us": us["probe"] - us["probe_k128"], "weight_at_copy_bw_us": weight_us,
            "tail_us": us["full"] - us["probe"]}


def measure_chain(m: int, n: int, k: int, tactic) -> dict:
    """full, gemm_only and act_quant for a tactic with the separate quantizer (module doc)."""
    import indexer_q
    from indexer_q import dispatch, jit
    from indexer_q.reference import empty_outputs

    if tactic.fused_act_quant:
        raise ValueError(f"--chain needs a tactic with the separate quantizer, not {tactic}")
    sets = cold_input_sets(m, n, k, n_cold_sets(m, n, k))
    ws = [indexer_q.prepare_weights(x["weight"], x["weight_scale"]) for x in sets]
    config = tactic.to_config("sm_90a", hadamard=True, fp4_rounding="floor-ties", out_format="mxfp4",
                              positions_dtype="int64" if sets[0]["positions"].dtype == torch.int64 else "int32")
    kernel = jit.compile_fused(config, n, k, sms=torch.cuda.get_device_properties(0).multi_processor_count)
    # each set's activation quantized once, and its outputs, allocated before the capture
    acts = [dispatch.run_act_quant(x["qr"]) for x in sets]
    outs = [empty_outputs(m, n // 128, "mxfp4", x["qr"].device) for x in sets]

    def gemm_only(i):
        j = i % len(sets)
        x, w, (a_fp8, a_scale), (q, q_scale) = sets[j], ws[j], acts[j], outs[j]
        kernel(a_fp8, a_scale, w.weight, w.weight_scale, x["positions"], x["cos_sin"],
               q.view(torch.uint8).view(m, -1).view(torch.int32), q_scale.view(torch.int32))

    def full(i):
        j = i % len(sets)
        x = sets[j]
        return dispatch.run_fused(x["qr"], ws[j], x["positions"], x["cos_sin"], hadamard=True,
                                  fp4_rounding="floor-ties", out_format="mxfp4", tactic=tactic,
                                  verified_only=False)

    calls = {"act_quant": lambda i: dispatch.run_act_quant(sets[i % len(sets)]["qr"]),
             "gemm_only": gemm_only, "full": full}
    us = time_graphs(calls, len(sets), replays=21)
    return {"M": m, "N": n, "K": k, "tactic": tactic.as_dict(), **{f"{a}_us": b for a, b in us.items()},
            "chain_cost_us": us["full"] - us["gemm_only"]}


def main(argv=None):
    from indexer_q import dispatch
    from indexer_q.tactics import heuristic

    ap = argparse.ArgumentParser(prog="python -m tuning.decode_parts", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tactic", default="", help="fields over the heuristic's tactic, e.g. split_k=1")
    ap.add_argument("--chain", action="store_true", help="the separate quantizer's cost (module doc)")
    ap.add_argument("--tables", action="store_true", help="the packaged tables' tactics")
    ap.add_argument("--out-format", default="mxfp4", choices=["mxfp4", "fp8", "fp8-unscaled", "bf16"],
                    help="the op's output format (not with --chain)")
    ap.add_argument("--no-hadamard", action="store_true", help="the op without the Hadamard (not with --chain)")
    ap.add_argument("--warm-activations", action="store_true",
                    help="qr, positions and cos_sin shared by the input sets (warm in L2), only the weight cold")
    ap.add_argument("--out", default=None, help="JSON lines file")
    args = ap.parse_args(argv)
    bw = measure_copy_bandwidth()
    rows = []
    for shape in args.shapes:
        n, k = SHAPES[shape]
        for m in args.m:
            if args.tables:
                tactic = dispatch.choose_tactic("sm_90a", torch.device("cuda"), m, n, k)
            else:
                tactic = heuristic("sm_90a", m, n, k)
            if args.tactic:
                tactic = dataclasses.replace(tactic, **parse_fields(args.tactic))
            parts = (measure_chain(m, n, k, tactic) if args.chain else
                     measure(m, n, k, tactic, bw, hadamard=not args.no_hadamard, out_format=args.out_format,
                             warm=args.warm_activations))
            row = {"shape": shape, "copy_TBps": bw / 1e12} | parts
            rows.append(row)
            print(json.dumps({a: (round(b, 3) if isinstance(b, float) else b) for a, b in row.items()}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
