"""How fast the H200 moves bytes from L2 (or DRAM) into its SMs, as the swapped kernel reads
them: `python -m tuning.fabric_probe` (GPU). Not a package kernel: a measuring tool (Triton),
like wgmma_pace.

G CTAs (one an SM) each read a slice of 196608 bytes (a V4 head's weight: 12 K blocks of
128 x 128 e4m3); `share` CTAs read the same slice (share 2: the two 32-token tiles of a head,
as the table's V4-Pro M = 64 tactic reads it). Two read paths: `tma` (16 KB boxes through a
tensor descriptor, pipelined, as the kernel's ring) and `lsu` (16-byte loads, as the fused
quantizer reads qr). `warm`: one buffer, read again and again (L2-resident after the first
read); `cold`: eight copies rotated, so each read misses L2 where eight copies exceed it (the
H200's 50 MB: a launch's unique bytes over ~7 MB; smaller sets stay warm). Timed in CUDA graphs of 16
launches, median of 5 replays, an empty launch of the same grid subtracted. Printed per case:
us a launch, the bytes that crossed into SMs, that rate (TB/s) and per SM (GB/s).

Also prints how many clusters of 1, 2, 4 and 8 CTAs of one CTA an SM can be resident at once
(cuOccupancyMaxActiveClusters), which bounds the cluster shapes a one-wave grid may use."""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl

from tuning.bench import _capture, _replay_us

SLICE = 12 * 128 * 128  # bytes a CTA reads
BOX = 128  # rows (and bytes a row) of a TMA box: one 16 KB K block


@triton.jit
def _read_lsu(src, out, SLICE_WORDS: tl.constexpr, SHARE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    base = (pid // SHARE) * SLICE_WORDS
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in tl.static_range(SLICE_WORDS // BLOCK):
        acc += tl.load(src + base + i * BLOCK + tl.arange(0, BLOCK))
    tl.store(out + pid, tl.sum(acc))


@triton.jit
def _read_tma(desc, out, BLOCKS: tl.constexpr, SHARE: tl.constexpr, BOX_ROWS: tl.constexpr,
              BOX_WORDS: tl.constexpr):
    pid = tl.program_id(0)
    row0 = (pid // SHARE) * BLOCKS * BOX_ROWS
    acc = tl.zeros([BOX_ROWS, BOX_WORDS], dtype=tl.int32)
    for i in tl.range(BLOCKS, num_stages=4):
        acc += desc.load([row0 + i * BOX_ROWS, 0])
    tl.store(out + pid, tl.sum(acc))


@triton.jit
def _read_weight(desc, out, BLOCKS: tl.constexpr, SHARE: tl.constexpr, BLOCKED: tl.constexpr,
                 STAGES: tl.constexpr):
    """A head's 12 K blocks of 128 x 128 bytes (as 128 x 32 int32 words), from the checkpoint's
    [N, K] layout (BLOCKED False: a box strided by K) or one where each block is contiguous."""
    head = tl.program_id(0) // SHARE
    acc = tl.zeros([128, 32], dtype=tl.int32)
    for kb in tl.range(BLOCKS, num_stages=STAGES):
        if BLOCKED:
            acc += desc.load([(head * BLOCKS + kb) * 128, 0])
        else:
            acc += desc.load([head * 128, kb * 32])
    tl.store(out + tl.program_id(0), tl.sum(acc))


@triton.jit
def _empty(out):
    tl.store(out + tl.program_id(0), 0)


def _graph_time(launches, replays: int = 5) -> float:
    """us a launch: `launches` (callables) captured in one CUDA graph (the bench's capture),
    median of replays."""
    graph = _capture(lambda i: launches[i](), len(launches), len(launches))
    return statistics.median(_replay_us(graph, len(launches)) for _ in range(replays))


def measure(path: str, ctas: int, share: int, cold: bool, launches: int = 16) -> dict:
    from triton.tools.tensor_descriptor import TensorDescriptor

    slices = -(-ctas // share)
    copies = 8 if cold else 1
    bufs = [torch.randint(0, 4, (slices * SLICE,), dtype=torch.uint8, device="cuda") for _ in range(copies)]
    out = torch.empty(ctas, dtype=torch.int32, device="cuda")
    if path == "lsu":
        words = [b.view(torch.int32) for b in bufs]
        calls = [lambda w=w: _read_lsu[(ctas,)](w, out, SLICE // 4, share, 8192, num_warps=8) for w in words]
    else:
        # a 16 KB box of 128 rows x 128 bytes, read as int32 words (the kernel's K block)
        words = BOX // 4
        descs = [TensorDescriptor(b.view(torch.int32).view(-1, words), [b.numel() // BOX, words], [words, 1],
                                  [BOX, words]) for b in bufs]
        calls = [lambda d=d: _read_tma[(ctas,)](d, out, SLICE // (BOX * BOX), share, BOX, words, num_warps=8)
                 for d in descs]
    seq = [calls[i % copies] for i in range(launches)]
    t = _graph_time(seq)
    t0 = _graph_time([lambda: _empty[(ctas,)](out)] * launches)
    moved = ctas * SLICE
    net = max(t - t0, 1e-3)
    return {"path": path, "ctas": ctas, "share": share, "state": "cold" if cold else "warm", "us": t,
            "empty_us": t0, "MB_into_SMs": moved / 1e6, "unique_MB": slices * SLICE / 1e6,
            "TB_s": moved / net / 1e6, "GB_s_per_sm": moved / ctas / net / 1e3}


def measure_weight(layout: str, share: int, stages: int, heads: int = 64, k: int = 1536,
                   launches: int = 16) -> dict:
    """The swapped kernel's weight stream without its compute: `heads` x `share` CTAs, each
    reading its head's K blocks through a TMA ring of `stages` - 1 boxes in flight, from
    sixteen weight copies rotated (cold: 16 x 12.6 MB is four times L2)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    blocks, copies, words = k // 128, 16, k // 4
    ctas = heads * share
    bufs = [torch.randint(0, 4, (heads * 128, k), dtype=torch.uint8, device="cuda") for _ in range(copies)]
    out = torch.empty(ctas, dtype=torch.int32, device="cuda")
    if layout == "blocked":  # [head][K block][128 rows][128 bytes]
        views = [b.view(heads, 128, blocks, 128).permute(0, 2, 1, 3).contiguous().view(torch.int32).view(-1, 32)
                 for b in bufs]
    else:
        views = [b.view(torch.int32) for b in bufs]
    descs = [TensorDescriptor(v, list(v.shape), [v.shape[1], 1], [128, 32]) for v in views]
    calls = [lambda d=d: _read_weight[(ctas,)](d, out, blocks, share, layout == "blocked", stages, num_warps=8)
             for d in descs]
    t = _graph_time([calls[i % copies] for i in range(launches)])
    t0 = _graph_time([lambda: _empty[(ctas,)](out)] * launches)
    unique = heads * 128 * k
    return {"path": "weight", "layout": layout, "ctas": ctas, "share": share, "stages": stages, "us": t,
            "empty_us": t0, "unique_MB": unique / 1e6, "MB_into_SMs": unique * share / 1e6,
            "dram_TB_s": unique / max(t - t0, 1e-3) / 1e6}


def max_active_clusters() -> dict:
    try:
        from cutlass.utils import HardwareInfo

        torch.zeros(1, device="cuda")  # torch's primary context, current on this thread for the driver API
        torch.cuda.synchronize()
        info = HardwareInfo()
        return {size: info.get_max_active_clusters(size) for size in (1, 2, 4, 8)}
    except Exception as e:  # a measuring tool: say why, go on
        return {"error": repr(e)}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tuning.fabric_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctas", type=int, nargs="+", default=[1, 8, 32, 64, 128, 132])
    ap.add_argument("--paths", nargs="+", default=["weight", "tma", "lsu"], choices=["weight", "tma", "lsu"])
    ap.add_argument("--out", help="also write the rows as JSON lines here")
    args = ap.parse_args(argv)
    torch.cuda.init()
    rows = [{"max_active_clusters_one_cta_an_sm": max_active_clusters()}]
    print(json.dumps(rows[0]), flush=True)
    if "weight" in args.paths:
        for layout in ("kmajor", "blocked"):
            for share in (1, 2):
                for stages in (4, 10):
                    try:
                        row = measure_weight(layout, share, stages)
                    except Exception as e:
                        row = {"path": "weight", "layout": layout, "share": share, "stages": stages,
                               "error": repr(e)[:300]}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    for path in [p for p in args.paths if p != "weight"]:
        for ctas in args.ctas:
            for share in (1, 2):
                for cold in (False, True):
                    try:
                        row = measure(path, ctas, share, cold)
                    except Exception as e:  # one path failing must not hide the other's numbers
                        row = {"path": path, "ctas": ctas, "share": share, "cold": cold, "error": repr(e)[:300]}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
