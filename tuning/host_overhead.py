"""Host time per call of the fused op, eager (no CUDA graph), two launch paths side by
side: the api's direct launch (the default for eager calls) and the torch custom op
(what torch.compile runs). `python -m tuning.host_overhead [M]`; needs a GPU.

Each path is called back to back without synchronizing, at a small M so the GPU keeps
up; host microseconds per call = wall time / calls once the queue is in steady state."""
import sys
import time

import torch

import indexer_q
from indexer_q import dispatch
from indexer_q.testing import make_inputs


def per_call_us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / calls * 1e6


def main(argv):
    m = int(argv[0]) if argv else 1
    x = make_inputs(m, 8192, 1536, p=4096, seed=0, device="cuda")
    w = indexer_q.prepare_weights(x["weight"], x["weight_scale"])
    args = (x["qr"], w, x["positions"], x["cos_sin"])

    def direct():
        return indexer_q.fused_indexer_q(*args, hadamard=True)

    def through_op():
        return torch.ops.indexer_q.fused_indexer_q(
            x["qr"], w.weight.view(torch.uint8), w.weight_scale, x["positions"], x["cos_sin"], True,
            "floor-ties", "mxfp4", dispatch.tactic_json(None), w.arch, None)

    def launch_only():  # the kernels alone, inputs already checked
        return dispatch.run_fused(*args, hadamard=True, fp4_rounding="floor-ties", out_format="mxfp4",
                                  verified_only=False)

    for name, fn in (("api (direct launch)", direct), ("torch custom op", through_op),
                     ("dispatch.run_fused only", launch_only)):
        print(f"{name:26s} {per_call_us(fn):7.1f} us/call (M = {m})")


if __name__ == "__main__":
    main(sys.argv[1:])
