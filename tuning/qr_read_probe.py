"""How fast 128 SMs read qr the way the swapped kernel's fused quantizer does: `python -m
tuning.qr_read_probe` (GPU). At V4-Pro M = 64 (32-token tiles, heads in pairs) every CTA
loads its token tile's rows over its rank's half of K, 48 KB, so the 196 KB of qr are read
32 times over (6 MB from L2); the thirty-third session's traces put those loads at 1.0-1.4 us
whether or not the weight's requests run beside them. This reads the same bytes per CTA in
three patterns, in L2 (warm) and with L2 flushed before each launch (cold):

- shared: the quantizer's (token tile, K half) chunks, each read by CTAs / (2 tiles) / 2;
- distinct: every CTA its own rows (the same bytes a CTA, no chunk read twice);
- none: the launch alone (no loads), to subtract.

Cold: one launch after an L2 flush, timed by CUDA events; warm: a CUDA graph of 20 launches,
its time / 20 (medians). Launch costs are in every number; the differences are the reads.
Not a package kernel: a measuring tool (Triton)."""
from __future__ import annotations

import argparse
import statistics

GRAPH = 20  # launches a warm graph


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read_chunks(src, out, row_stride, rows: tl.constexpr, col_blocks: tl.constexpr, tiles: tl.constexpr,
                    mode: tl.constexpr):
        pid = tl.program_id(0)
        if mode == 0:  # shared: token tile pid % tiles, K half (pid // tiles) % 2
            row0 = (pid % tiles) * rows
            col0 = ((pid // tiles) % 2) * col_blocks * 256
        else:  # distinct rows
            row0 = pid * rows
            col0 = 0
        r = tl.arange(0, rows)[:, None]
        c = tl.arange(0, 256)[None, :]
        acc = tl.zeros((rows, 256), dtype=tl.float32)
        if mode < 2:
            for j in tl.static_range(col_blocks):
                x = tl.load(src + (row0 + r) * row_stride + col0 + j * 256 + c)
                acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
        tl.store(out + pid, tl.max(acc))

    return read_chunks


def main(argv=None):
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctas", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--rows", type=int, default=32, help="token rows a CTA (a power of 2)")
    ap.add_argument("--k", type=int, default=1536)
    ap.add_argument("--launches", type=int, default=200)
    args = ap.parse_args(argv)
    kern = _kernel()
    dev = torch.device("cuda")
    col_blocks = args.k // 2 // 256  # 256-column blocks in a K half
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    print(f"{torch.cuda.get_device_name()}: {args.rows} rows x {args.k // 2} bf16 columns a CTA "
          f"({args.rows * args.k} bytes)")
    print("| CTAs | pattern | L2 | us (median launch) |")
    print("|---:|---|---|---:|")
    for ctas in args.ctas:
        tiles = max(1, ctas // 64)  # 64 heads in pairs: CTAs / 64 token tiles
        src = torch.randn(max(ctas, tiles) * args.rows, args.k, device=dev).to(torch.bfloat16)
        out = torch.empty(ctas, device=dev)
        for mode, name in ((0, "shared"), (1, "distinct"), (2, "none")):
            def launch():
                kern[(ctas,)](src, out, src.stride(0), args.rows, col_blocks, tiles, mode, num_warps=8)
            launch()
            torch.cuda.synchronize()
            # cold: one launch after an L2 flush, by events; warm: a CUDA graph of GRAPH
            # launches back to back (host overhead out), its time / GRAPH
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(GRAPH):
                    launch()
            for cold in (False, True):
                times = []
                for _ in range(args.launches):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    if cold:
                        flush.zero_()
                        a.record()
                        launch()
                    else:
                        a.record()
                        graph.replay()
                    b.record()
                    b.synchronize()
                    times.append(a.elapsed_time(b) * 1e3 / (1 if cold else GRAPH))
                print(f"| {ctas} | {name} | {'cold' if cold else 'warm'} | {statistics.median(times):.2f} |")


if __name__ == "__main__":
    main()
