"""`indexer-q bench`: the fused op and its peers side by side, in one process.

Every contender is captured in a CUDA graph that calls it `reps` times, cycling through
enough independent input sets (more than 3x the L2) that each call reads its operands
from HBM. The figure is the median over replays of (graph time / reps). The contenders'
replays are interleaved, the order rotating each round (--sequential: one contender
after another, which let the same kernel measure up to 8% apart by its place in line).

Contenders, per (shape, M):
  fused            the op with its default tactic choice (table, else heuristic)
  fused[<tactic>]  each valid tactic forced (--all-tactics, or those whose fields match
                   --tactics-where) or those given by --tactic; fused[table+<fields>] the
                   op's own choice with those fields replaced (--table-twin)
  unfused          the chain a Hopper engine runs today: activation quantization (our
                   kernel), cuBLAS block-scaled FP8 GEMM (torch._scaled_mm, 1x128 /
                   128x128 scales, bf16 out), the Triton RoPE + Hadamard + MXFP4 kernel
                   (tuning/peers); cuBLAS rejects M not a multiple of 4, so
                   the peers run on inputs padded to one (as an engine would)
  cublas_gemm      cuBLAS's GEMM alone, on pre-quantized activations
  deepgemm_chain   the unfused chain with DeepGEMM's SM90 FP8 GEMM (deep_gemm.fp8_gemm_nt,
                   the same 1x128 / 128x128 scales, bf16 out) for cuBLAS's: our activation
                   quantization, the act scale's relayout DeepGEMM needs (MN-major, M padded
                   to 4: one copy), the GEMM, the Triton kernel; on the real M (DeepGEMM
                   takes any M)
  deepgemm_gemm    DeepGEMM's GEMM alone (the faster of its launches with and without
                   programmatic dependent launch, deepgemm_gemm_{pdl,nopdl}), on pre-quantized
                   activations whose scale is already laid out for it; real M. DeepGEMM is
                   a benchmark peer only (tuning/peers/deepgemm.py; the package never
                   imports it): where
                   `deep_gemm` does not import or run, the row says why (deepgemm_error)
  peer_epilogue    the chain's Triton kernel alone, on the GEMM's bf16 output
  torch            the reference ops on the GPU (step 2 in float64)
  floor            max(bytes / measured copy bandwidth, FLOPs / FP8 peak)
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import math
import statistics
import sys
from pathlib import Path

import torch

import indexer_q
from indexer_q import table
from indexer_q.constants import OUT_FORMATS, Q_BYTES_PER_HEAD, SCALED_FORMATS
from indexer_q import reference as ref
from indexer_q.testing import make_inputs
from tuning.peers import deepgemm

H200_FP8_PEAK_TFLOPS = 1979.0  # dense, datasheet
L2_BYTES = 60 * 2**20
SHAPES = {"v4-pro": (8192, 1536), "v4-flash": (8192, 1024), "tp8-pro": (1024, 1536)}
FULL_MS = sorted({2**i for i in range(15)} | {3, 13, 1000})
QUICK_MS = [1, 128, 4096, 16384]
RESULTS = Path(__file__).resolve().parent / "results"


def cold_input_sets(m: int, n: int, k: int, n_sets: int, seed: int = 0, warm_activations: bool = False,
                    device: str = "cuda") -> list:
    """n_sets copies of one random problem, each in its own GPU memory: a cold L2 needs
    distinct addresses, not distinct values, and drawing random numbers on the CPU was
    most of a sweep's time (a fresh problem per set and per tactic). `warm_activations`:
    only the weight is copied; the sets share qr and the positions, which stay in L2 as in
    an engine, where the kernel before wrote them."""
    x = make_inputs(m, n, k, p=4096, seed=seed, device=device)
    copied = WEIGHT_INPUTS if warm_activations else tuple(x)
    return [x] + [{name: (t.clone() if name in copied else t) for name, t in x.items()} for _ in range(n_sets - 1)]


WEIGHT_INPUTS = ("weight", "weight_scale")
COLD_WORDING = {"cold": "cold L2", "warm": "cold L2 for the weights, activations warm in L2"}


def n_cold_sets(m: int, n: int, k: int, warm_activations: bool = False) -> int:
    """Input sets whose copied inputs together take more than 3x the L2."""
    copied = n * k if warm_activations else m * k * 2 + n * k + m * n
    return max(2, math.ceil(3 * L2_BYTES / copied))


def _capture(call, n_sets: int, reps: int):
    """A CUDA graph of `reps` calls of `call(i)`, cycling through the input sets."""
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
    return graph


def _replay_us(graph, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def time_graph(call, n_sets: int, reps: int = 20, replays: int = 15) -> float:
    """Median microseconds per call of `call(i)` (i = input set), replayed in a graph."""
    graph = _capture(call, n_sets, reps)
    return statistics.median(_replay_us(graph, reps) for _ in range(replays))


def time_graphs(calls: dict, n_sets: int, reps: int = 20, replays: int = 15) -> dict:
    """time_graph for several contenders, their replays interleaved (the order rotating
    every round), so that a GPU warming up and clocking down over the run weighs on all
    of them alike. Timed one after another, the same kernel measured up to 8% slower
    later in the sequence on the H200."""
    if not calls:
        return {}
    graphs = {name: _capture(call, n_sets, reps) for name, call in calls.items()}
    names = list(graphs)
    times = {name: [] for name in names}
    for r in range(replays):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(_replay_us(graphs[name], reps))
    return {name: statistics.median(t) for name, t in times.items()}


def time_eager(call, n_sets: int, reps: int = 3) -> float:
    """Median microseconds of `call(i)` run eagerly (for peers a graph cannot capture)."""
    for i in range(min(n_sets, 2)):
        call(i)
    times = []
    for r in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call(r % n_sets)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def measure_copy_bandwidth() -> float:
    """Bytes read + written per second of a device-to-device copy of 256 MB, the size of
    the largest operands here. (On the H200 a copy of 256 MB runs at ~4.2 TB/s but one of
    512 MB or more at ~2.8: until 2026-11-30 this copied 1 GiB, which understated the
    bandwidth, so the floor at weight-bound M was 1.5x too high.)"""
    src = torch.empty(2**26, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(20):  # bring the clocks up from idle first
        dst.copy_(src)
    us = min(time_graph(lambda i: dst.copy_(src), 1, reps=5, replays=7) for _ in range(3))
    return 2 * src.numel() * src.element_size() / (us * 1e-6)


PEER_M_MULTIPLE = 4  # cuBLAS's block-scaled GEMM on the H200 takes M in multiples of 4 only


def cublas_args(x):
    """torch._scaled_mm operands for the SPEC's block scales (see CUTEDSL-NOTES.md)."""
    a, sa = indexer_q.quantize_act_fp8(x["qr"])
    return dict(a=a, sa=sa.t().contiguous().t(), b=x["weight"].t(), sb=x["weight_scale"].t())


def run_cublas(c):
    return torch._scaled_mm(c["a"], c["b"], scale_a=c["sa"], scale_b=c["sb"], out_dtype=torch.bfloat16)


def cublas_gemm(x):
    """cuBLAS's block-scaled GEMM of the problem `x`, bf16 [T, N]. Rows are independent, so
    T is padded to a multiple of 16 (cuBLAS refuses some small T) and the padding dropped."""
    t = x["qr"].shape[0]
    padded = dict(x, qr=torch.nn.functional.pad(x["qr"], (0, 0, 0, -t % 16)))
    return run_cublas(cublas_args(padded))[:t]


def cublas_reference_chain(x, *, hadamard, out_format, fp4_rounding="floor-ties", q=None):
    """What an unfused Hopper engine computes: cuBLAS's GEMM (or its output `q`), then the
    reference's steps 3-6. Returns (q, q_scale) as the fused op does."""
    from indexer_q import reference as ref

    t = x["qr"].shape[0]
    q = (cublas_gemm(x) if q is None else q).reshape(t, -1, 128)
    q = ref.apply_rope(q, x["positions"], x["cos_sin"])
    q = ref.hadamard_128(q) if hadamard else q
    return ref.output_format(q, out_format, fp4_rounding)


def unfused_chain(x, *, hadamard, fp4_rounding="floor-ties"):
    from tuning.peers.triton_rope_hadamard_mxfp4 import rope_hadamard_mxfp4

    a, sa = indexer_q.quantize_act_fp8(x["qr"])
    q = torch._scaled_mm(a, x["weight"].t(), scale_a=sa.t().contiguous().t(), scale_b=x["weight_scale"].t(),
                         out_dtype=torch.bfloat16)
    return rope_hadamard_mxfp4(q, x["positions"], x["cos_sin"], hadamard=hadamard, fp4_rounding=fp4_rounding)


def problem_bytes(m, n, k, out_format="mxfp4") -> int:
    q_bytes = m * (n // 128) * Q_BYTES_PER_HEAD[out_format]
    scale_bytes = m * (n // 128) * 4 if out_format in SCALED_FORMATS else 0
    return m * k * 2 + n * k + (n // 128) * (k // 128) * 4 + q_bytes + scale_bytes + m * 8 + m * 256


def _per_set(make, sets, warm_activations, with_weight):
    """A peer's operands for each input set; with warm activations its activation part
    (quantized or padded copy, scale layouts) made once and shared, so it stays in L2 like
    the sets' qr, and only the weight differs (`with_weight(shared, set)`)."""
    if not warm_activations:
        return [make(x) for x in sets]
    shared = make(sets[0])
    return [shared] + [with_weight(shared, x) for x in sets[1:]]


def bench_shape(m, n, k, bw, *, hadamard=True, out_format="mxfp4", tactics=None, peers=True,
                interleave=True, warm_activations=False) -> dict:
    n_sets = n_cold_sets(m, n, k, warm_activations)
    sets = cold_input_sets(m, n, k, n_sets, warm_activations=warm_activations)
    weights = [indexer_q.prepare_weights(x["weight"], x["weight_scale"]) for x in sets]
    row = {"M": m, "N": n, "K": k, "hadamard": hadamard, "out_format": out_format}

    def fused(i, tactic=None):
        x = sets[i]
        if tactic is not None and not tactic.epilogue:  # the profiling probe writes nothing
            from indexer_q import dispatch

            return dispatch.run_fused(x["qr"], weights[i], x["positions"], x["cos_sin"], hadamard=hadamard,
                                      fp4_rounding="floor-ties", out_format=out_format, tactic=tactic,
                                      verified_only=False)
        return indexer_q.fused_indexer_q(x["qr"], weights[i], x["positions"], x["cos_sin"],
                                         hadamard=hadamard, out_format=out_format, tactic=tactic)

    calls = {"fused_us": fused}
    for name, tac in (tactics or {}).items():
        calls[f"fused[{name}]_us"] = lambda i, t=tac: fused(i, t)
    calls["act_quant_us"] = lambda i: indexer_q.quantize_act_fp8(sets[i]["qr"])
    # The op on qr quantized already (qr_scale): what an engine that quantizes qr for the
    # attention's own wq_b GEMM runs; its inputs are DeepGEMM's GEMM's (quantized outside the timing).
    quantized = _per_set(lambda x: indexer_q.quantize_act_fp8(x["qr"]), sets, warm_activations, lambda a, x: a)
    calls["fused_fp8_qr_us"] = lambda i: indexer_q.fused_indexer_q(
        quantized[i][0], weights[i], sets[i]["positions"], sets[i]["cos_sin"], hadamard=hadamard,
        out_format=out_format, qr_scale=quantized[i][1])
    if peers:
        # cuBLAS's block-scaled GEMM rejects M that is not a multiple of 4 on the H200 (1, 2,
        # 3, 13, ...). An engine then pads the tokens, so the peers run there on inputs
        # padded (outside the timing) to the next multiple: `peer_m` says so.
        peer_sets = sets
        peer_m = -(-m // PEER_M_MULTIPLE) * PEER_M_MULTIPLE
        if peer_m != m:
            peer_sets = _per_set(  # (warm: one padded activation, shared like the sets' qr)
                lambda x: dict(x, qr=torch.nn.functional.pad(x["qr"], (0, 0, 0, peer_m - m)),
                               positions=torch.nn.functional.pad(x["positions"], (0, peer_m - m))),
                sets, warm_activations, lambda p, x: dict(x, qr=p["qr"], positions=p["positions"]))
            row["peer_m"] = peer_m
        try:
            cargs = _per_set(cublas_args, peer_sets, warm_activations,
                             lambda c, x: dict(c, b=x["weight"].t(), sb=x["weight_scale"].t()))
            run_cublas(cargs[0])
            torch.cuda.synchronize()
        except RuntimeError as exc:
            row["cublas_error"] = str(exc).splitlines()[0][:120]
        else:
            calls["cublas_gemm_us"] = lambda i: run_cublas(cargs[i])
            if out_format == "mxfp4":
                from tuning.peers.triton_rope_hadamard_mxfp4 import rope_hadamard_mxfp4

                calls["unfused_us"] = lambda i: unfused_chain(peer_sets[i], hadamard=hadamard)
                # the chain's last stage alone, on the GEMM's bf16 output: the chain's parts
                # should add up to it
                q_bf16 = _per_set(run_cublas, cargs, warm_activations, lambda q, c: q)  # (warm: one, in L2)
                calls["peer_epilogue_us"] = lambda i: rope_hadamard_mxfp4(
                    q_bf16[i], peer_sets[i]["positions"], peer_sets[i]["cos_sin"], hadamard=hadamard)
        # DeepGEMM takes any M (1, 2, 3 included): it runs on the real M, on `sets`, not on
        # the padded `peer_sets`. Its first call JIT-compiles the kernel (nvcc): done here,
        # outside the timing.
        try:
            deepgemm.load()  # ImportError with the reason where it does not import
            dargs = _per_set(lambda x: deepgemm.gemm_args(x, *indexer_q.quantize_act_fp8(x["qr"])), sets,
                             warm_activations, lambda c, x: dict(c, w=x["weight"], sw=x["weight_scale"]))
            deepgemm.run_gemm(dargs[0])
            torch.cuda.synchronize()
        except Exception as exc:  # not importable (ImportError), or refused / failed to build
            row["deepgemm_error"] = (str(exc).splitlines() or [type(exc).__name__])[0][:120]
        else:
            # with and without PDL (DeepGEMM supports it; the fused op launches with it):
            # deepgemm_gemm_us is the faster of the two, the strongest peer
            calls["deepgemm_gemm_nopdl_us"] = lambda i: deepgemm.run_gemm_pdl(dargs[i], False)
            if deepgemm.set_pdl(False):
                calls["deepgemm_gemm_pdl_us"] = lambda i: deepgemm.run_gemm_pdl(dargs[i], True)
            if out_format == "mxfp4":
                calls["deepgemm_chain_us"] = lambda i: deepgemm.chain(sets[i], hadamard=hadamard)
    if interleave:
        row.update(time_graphs(calls, n_sets))
    else:
        row.update({name: time_graph(call, n_sets) for name, call in calls.items()})
    dg = [row[k] for k in ("deepgemm_gemm_nopdl_us", "deepgemm_gemm_pdl_us") if k in row]
    if dg:
        row["deepgemm_gemm_us"] = min(dg)
    if peers and out_format == "mxfp4":
        # The reference reads values back to the host (checks, constants), which a graph
        # capture does not allow, so the torch chain is timed eagerly.
        row["torch_us"] = time_eager(
            lambda i: ref.fused_indexer_q(sets[i]["qr"], sets[i]["weight"], sets[i]["weight_scale"],
                                          sets[i]["positions"], sets[i]["cos_sin"], hadamard=hadamard,
                                          validate=False), n_sets)
    flops = 2 * m * n * k
    row["floor_us"] = max(problem_bytes(m, n, k, out_format) / bw, flops / (H200_FP8_PEAK_TFLOPS * 1e12)) * 1e6
    row["fused_tflops"] = flops / (row["fused_us"] * 1e-6) / 1e12
    for peer in ("cublas_gemm", "unfused", "deepgemm_gemm", "deepgemm_chain", "torch"):
        if f"{peer}_us" in row:
            row[f"fused_over_{peer}"] = row["fused_us"] / row[f"{peer}_us"]
    if "deepgemm_gemm_us" in row:
        row["fused_fp8_qr_over_deepgemm_gemm"] = row["fused_fp8_qr_us"] / row["deepgemm_gemm_us"]
    row["fused_over_floor"] = row["fused_us"] / row["floor_us"]
    return row


def parse_fields(spec: str) -> dict:
    out = {}
    for item in spec.split(","):
        key, value = item.split("=")
        out[key] = value == "True" if value in ("True", "False") else int(value) if value.isdigit() else value
    return out


def environment() -> dict:
    import importlib.metadata as md

    props = torch.cuda.get_device_properties(0)
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cutlass_dsl": md.version("nvidia-cutlass-dsl") if _has("nvidia-cutlass-dsl") else "kit",
        "triton": _triton_version(),
        "deepgemm": deepgemm.version(),
        "indexer_q": indexer_q.__version__,
        "commit": _git_commit(),
        **_tables_record(),
    }


def _tables_record() -> dict:
    """Where the `fused` column's tactics come from, and why any table was passed over
    (a table tuned on other kernels is ignored: its fingerprint differs)."""
    d = table.describe_tables()
    return {"tactic_table": str(d["path"] or "none (heuristic)"),
            "tactic_tables_skipped": [f"{path} ({source}): {why}" for path, source, why in d["skipped"]]}


def tactics_sentence(env: dict) -> str:
    """The markdown's line on the `fused` column's tactics."""
    skipped = env.get("tactic_tables_skipped") or []
    if env.get("tactic_table", "").startswith("none"):
        why = f" ({'; '.join(skipped)})" if skipped else ""
        return f"**The `fused` column ran the heuristic's tactics: no tactic table served this setup{why}.**"
    out = f"The `fused` column ran the tactics of {env.get('tactic_table', 'an unrecorded table')}"
    return out + (f", after passing over {'; '.join(skipped)}." if skipped else ".")


def _git_commit() -> str:
    import os
    import subprocess

    if os.environ.get("INDEXER_Q_COMMIT"):  # set by whoever runs a copy without .git
        return os.environ["INDEXER_Q_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _has(pkg):
    import importlib.metadata as md

    try:
        md.version(pkg)
        return True
    except md.PackageNotFoundError:
        return False


def _triton_version():
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "none"


def progress(i, total, label):
    width = 30
    done = int(width * i / total)
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{total} {label:<40}")
    sys.stderr.flush()
    if i == total:
        sys.stderr.write("\n")


def write_outputs(env, rows, stem: Path, plots=True):
    stem.parent.mkdir(parents=True, exist_ok=True)
    with open(stem.with_suffix(".json"), "w") as f:
        json.dump({"environment": env, "rows": rows}, f, indent=1)
    lead = ["shape", "M", "N", "K"]
    keys = lead + sorted({k for r in rows for k in r} - set(lead))
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow(r)
    lines = [f"# indexer-q bench, {env['date']}, {env['gpu']} ({env['sms']} SMs), torch {env['torch']}, "
             f"CUDA {env['cuda']}, CuTe DSL {env['cutlass_dsl']}, Triton {env['triton']}, "
             f"DeepGEMM {env.get('deepgemm', 'not recorded')}", "",
             f"Copy bandwidth measured in this run: {env['copy_bandwidth_TBps']:.2f} TB/s. Microseconds "
             f"(CUDA graphs, {COLD_WORDING[env.get('activations', 'cold')]}, median, "
             f"{env.get('timing', 'sequential')} timing); ratios are fused / peer (below 1 = fused faster). "
             f"M marked * : cuBLAS refuses it, so the unfused and cuBLAS peers ran on inputs padded to "
             f"the next multiple of {PEER_M_MULTIPLE} rows, as an engine would pad them; the DeepGEMM peers "
             f"always run on the real M. \"unfused\" is the chain with cuBLAS, \"DeepGEMM chain\" the same "
             f"chain with DeepGEMM's GEMM (plus the activation scale's relayout it needs).", "",
             tactics_sentence(env), "",
             "\"fused, fp8 qr\" is the op given qr quantized already (`qr_scale`: the inputs DeepGEMM's GEMM "
             "takes); its ratio is to DeepGEMM's GEMM alone.", "",
             "| shape | format | M | fused | unfused | DeepGEMM chain | cuBLAS GEMM | DeepGEMM GEMM | torch | floor "
             "| /unfused | /DeepGEMM chain | /cuBLAS | /DeepGEMM GEMM | /floor | fused, fp8 qr "
             "| fp8 qr /DeepGEMM GEMM |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def fmt(r, k, d=1):
        return f"{r[k]:.{d}f}" if k in r else "-"

    for r in rows:
        m_mark = f"{r['M']}*" if "peer_m" in r else f"{r['M']}"
        lines.append(f"| {r['shape']} | {r['out_format']} | {m_mark} | {fmt(r, 'fused_us')} | {fmt(r, 'unfused_us')} | "
                     f"{fmt(r, 'deepgemm_chain_us')} | {fmt(r, 'cublas_gemm_us')} | {fmt(r, 'deepgemm_gemm_us')} | "
                     f"{fmt(r, 'torch_us')} | {fmt(r, 'floor_us')} | "
                     f"{fmt(r, 'fused_over_unfused', 2)} | {fmt(r, 'fused_over_deepgemm_chain', 2)} | "
                     f"{fmt(r, 'fused_over_cublas_gemm', 2)} | {fmt(r, 'fused_over_deepgemm_gemm', 2)} | "
                     f"{fmt(r, 'fused_over_floor', 2)} | {fmt(r, 'fused_fp8_qr_us')} | "
                     f"{fmt(r, 'fused_fp8_qr_over_deepgemm_gemm', 2)} |")
    lines += forced_lines(rows)
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    if plots:
        plot(rows, stem)


def forced_lines(rows) -> list:
    """The forced contenders (`fused[<name>]_us`: --tactic, --table-twin, --tactics-where,
    --all-tactics) beside the op's own `fused`, as markdown: a table a row of the bench."""
    names = sorted({k[len("fused["):-len("]_us")] for r in rows for k in r
                    if k.startswith("fused[") and k.endswith("]_us")})
    if not names:
        return []
    lines = ["", "Forced tactics (us; `fused` is the op's own choice, as above):", "",
             "| shape | format | M | fused | " + " | ".join(f"f{i}" for i in range(len(names))) + " |",
             "|---|---|---:|---:|" + "---:|" * len(names)]
    for r in rows:
        cells = [f"{r[f'fused[{n}]_us']:.2f}" if f"fused[{n}]_us" in r else "-" for n in names]
        own = f"{r['fused_us']:.2f}" if "fused_us" in r else "-"
        lines.append(f"| {r['shape']} | {r['out_format']} | {r['M']} | {own} | " + " | ".join(cells) + " |")
    lines += [""] + [f"- f{i}: `{n}`" for i, n in enumerate(names)]
    return lines


def plot(rows, stem: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r["shape"], r["out_format"]) for r in rows})
    contenders = [("fused_us", "fused op"), ("fused_fp8_qr_us", "fused op, fp8 qr in (qr_scale)"),
                  ("unfused_us", "unfused chain (act-quant + cuBLAS + Triton)"),
                  ("deepgemm_chain_us", "unfused chain (act-quant + relayout + DeepGEMM + Triton)"),
                  ("cublas_gemm_us", "cuBLAS GEMM alone"), ("deepgemm_gemm_us", "DeepGEMM GEMM alone"),
                  ("torch_us", "plain torch"), ("floor_us", "floor")]
    peers = [c for c in contenders if c[0] not in ("fused_us", "fused_fp8_qr_us", "floor_us")]
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, (shape, fmt_) in zip(axes[0], shapes):
        rs = sorted((r for r in rows if r["shape"] == shape and r["out_format"] == fmt_), key=lambda r: r["M"])
        for key, label in contenders:
            pts = [(r["M"], r[key]) for r in rs if key in r]
            if pts:
                ax.plot(*zip(*pts), "--" if key == "floor_us" else "-o", label=label, markersize=3)
        ax.set(xscale="log", yscale="log", xlabel="M (tokens)", ylabel="us", title=f"{shape}, {fmt_}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(stem.with_name(stem.name + "_time.png"), dpi=110)
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, (shape, fmt_) in zip(axes[0], shapes):
        rs = sorted((r for r in rows if r["shape"] == shape and r["out_format"] == fmt_), key=lambda r: r["M"])
        for key, label in peers:
            pts = [(r["M"], r[key] / r["fused_us"]) for r in rs if key in r]
            if pts:
                ax.plot(*zip(*pts), "-o", label=f"over {label}", markersize=3)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set(xscale="log", yscale="log", xlabel="M (tokens)", ylabel="speedup of the fused op",
               title=f"{shape}, {fmt_}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(stem.with_name(stem.name + "_speedup.png"), dpi=110)


def forced_tactics(m: int, n: int, k: int, specs=(), where=(), every=False, twins=()) -> dict:
    """The forced contenders at (M, N, K): each spec's fields over the heuristic's tactic
    (named by the spec), each twin's fields over the tactic the op picks (`table+<twin>`: a
    kernel change A/B'd on the tables' own choices), then every valid tactic (`every`) or
    those matching any of `where`'s fields (named by their fields)."""
    import torch

    from indexer_q.dispatch import choose_tactic
    from indexer_q.tactics import can_run, heuristic, valid_tactics

    tactics = {spec: dataclasses.replace(heuristic("sm_90a", m, n, k), **parse_fields(spec)) for spec in specs}
    for twin in twins:  # skipped where the twin cannot run (e.g. a field the picked kind lacks)
        try:
            t = dataclasses.replace(choose_tactic("sm_90a", torch.device("cuda"), m, n, k), **parse_fields(twin))
        except (TypeError, ValueError):
            continue
        if can_run("sm_90a", t, n, k):
            tactics[f"table+{twin}"] = t
    wanted = [parse_fields(spec) for spec in where]
    for t in valid_tactics("sm_90a", m, n, k) if every or wanted else []:
        if every or any(all(getattr(t, f) == v for f, v in w.items()) for w in wanted):
            tactics.setdefault(json.dumps(t.as_dict(), sort_keys=True), t)
    return tactics


def main(argv=None):
    ap = argparse.ArgumentParser(prog="indexer-q bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"M in {QUICK_MS} only")
    ap.add_argument("--m", type=int, nargs="+", default=None)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--out-format", nargs="+", default=["mxfp4"], choices=OUT_FORMATS)
    ap.add_argument("--no-hadamard", action="store_true")
    ap.add_argument("--tactic", nargs="*", default=[],
                    help="also time forced tactics, each 'field=value,...' over the heuristic's")
    ap.add_argument("--table-twin", nargs="*", default=[],
                    help="also time the tactic the op picks with these fields replaced, each "
                         "'field=value,...' (e.g. tensor_core_hadamard=True)")
    ap.add_argument("--all-tactics", action="store_true", help="also time every valid tactic")
    ap.add_argument("--tactics-where", nargs="*", default=[],
                    help="also time every valid tactic with these fields, each 'field=value,...' "
                         "(e.g. cluster_m=2: the candidates a kernel change added)")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--warm-activations", action="store_true",
                    help="only the weights cycle through more than L2 holds; every contender's activation "
                         "(qr, and the peers' quantized copy) stays in L2, as after the kernel that wrote it")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--sequential", action="store_true",
                    help="time contenders one after another instead of interleaving their replays")
    ap.add_argument("--out", default=None, help="output stem (default tuning/results/bench_<date>)")
    ap.add_argument("--json", default=None, help="(compat) also write the JSON here")
    args = ap.parse_args(argv)

    ms = args.m or (QUICK_MS if args.quick else FULL_MS)
    bw = measure_copy_bandwidth()
    env = environment() | {"copy_bandwidth_TBps": bw / 1e12,
                           "timing": "sequential" if args.sequential else "interleaved",
                           "activations": "warm" if args.warm_activations else "cold"}
    print(json.dumps(env), flush=True)
    if env["tactic_table"].startswith("none"):
        print(f"bench: {tactics_sentence(env)}", file=sys.stderr, flush=True)
    jobs = [(s, f, m) for s in args.shapes for f in args.out_format for m in ms]
    rows = []
    for i, (shape, fmt_, m) in enumerate(jobs):
        progress(i, len(jobs), f"{shape} {fmt_} M={m}")
        n, k = SHAPES[shape]
        tactics = forced_tactics(m, n, k, args.tactic, args.tactics_where, args.all_tactics, args.table_twin)
        row = {"shape": shape} | bench_shape(m, n, k, bw, hadamard=not args.no_hadamard, out_format=fmt_,
                                              tactics=tactics, peers=not args.no_peers,
                                              interleave=not args.sequential,
                                              warm_activations=args.warm_activations)
        rows.append(row)
        print(json.dumps({a: (round(b, 3) if isinstance(b, float) else b) for a, b in row.items()}), flush=True)
    progress(len(jobs), len(jobs), "done")
    stem = Path(args.out) if args.out else RESULTS / f"bench_{env['date']}"
    write_outputs(env, rows, stem, plots=not args.no_plots)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
