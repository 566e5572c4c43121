"""Whether forced tactics write the bytes of a base tactic, on the GPU, before a new tactic
goes to the tests and the tuner: `python -m tuning.same_bytes M:N:K [...] --base FIELDS
--tactic FIELDS [FIELDS ...]` (FIELDS as `indexer-q bench --tactic`). Prints one line a
case and tactic, and exits 1 on any difference (mxfp4 and fp8, Hadamard on, RNE codes;
each tactic runs twice, into outputs poisoned with 0x00 and 0xA5, and must agree with itself
too, so bytes it never writes show)."""
from __future__ import annotations

import argparse
import sys

import torch

import indexer_q
from indexer_q import dispatch
from indexer_q.reference import empty_outputs
from indexer_q.tactics import Tactic
from indexer_q.testing import make_inputs
from tuning.bench import parse_fields


def run(x, weights, tactic, out_format):
    """The tactic's (q bytes, scales), or None where its two poisoned runs disagree."""
    outs = []
    for byte in (0x00, 0xA5):
        q, s = empty_outputs(x["qr"].shape[0], weights.heads, out_format, "cuda")
        q.view(torch.uint8).fill_(byte)
        s.view(torch.uint8).fill_(byte)
        dispatch.run_fused(x["qr"], weights, x["positions"], x["cos_sin"], hadamard=True, fp4_rounding="rne",
                           out_format=out_format, tactic=tactic, out=(q, s), verified_only=False)
        outs.append((q.view(torch.uint8), s.view(torch.uint8)))
    torch.cuda.synchronize()
    (q0, s0), (q1, s1) = outs
    return (q0, s0) if torch.equal(q0, q1) and torch.equal(s0, s1) else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("cases", nargs="+", help="M:N:K")
    ap.add_argument("--base", default="tile_m=128,pdl=False")
    ap.add_argument("--tactic", nargs="+", required=True)
    args = ap.parse_args(argv)
    base = Tactic(**parse_fields(args.base))
    bad = 0
    for case in args.cases:
        m, n, k = (int(v) for v in case.split(":"))
        x = make_inputs(m, n, k, seed=m + n + k, device="cuda")
        weights = indexer_q.prepare_weights(x["weight"], x["weight_scale"])
        for out_format in ("mxfp4", "fp8"):
            want = run(x, weights, base, out_format)
            assert want is not None, f"the base tactic leaves bytes unwritten at {case} {out_format}"
            for spec in args.tactic:
                got = run(x, weights, Tactic(**parse_fields(spec)), out_format)
                if got is None:
                    verdict = "UNWRITTEN BYTES"
                else:
                    same = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
                    equal = (got[0] == want[0]).double().mean().item()
                    verdict = "same" if same else f"DIFFERENT ({equal:.7f} of the bytes)"
                print(f"M={m} N={n} K={k} {out_format} {spec}: {verdict}", flush=True)
                bad += verdict != "same"
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
