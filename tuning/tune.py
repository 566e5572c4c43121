"""`indexer-q tune`: profile every valid tactic per M bucket and write a tactic table.

For each M (powers of two from 1 to 16384, 1.5x points from 24 to 384, then the midpoints
between neighbours whose winners differ), every candidate from `indexer_q.valid_tactics` is
first checked against the reference (the SPEC's agreement, at the floor the H200 reaches with
the Hadamard), then timed like the benchmark (CUDA graphs, cold L2, median, the candidates' replays
interleaved). The fastest correct one
wins, unless the heuristic's choice is within the noise (3%) of it. The table maps each M to the winner
of the smallest profiled M at or above it.

Tables: one per (model, TP) in tuning/tables/ (the tuner's raw output, with every
candidate's timings); `--merge` makes the one per GPU that the package ships,
src/indexer_q/tables/<GPU>.json (the default --out; commit it with the sources it was
merged from); `--install` puts a table into this user's data directory
($XDG_DATA_HOME/indexer_q/tables/<GPU>.json, default ~/.local/share/...), which calls use
before the packaged one, merged with the installed entries of other (N, K).

`--quantized-input` tunes for qr passed already quantized (fused_indexer_q's qr_scale): the
candidates are the twins without the fused quantizer, the buckets those of the swapped-A/B
range (above it no candidate quantizes qr, so the bf16 qr's entries hold), and the table's
entries carry "qr": "fp8" beside the bf16 qr's.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import sys
from pathlib import Path

import torch

import indexer_q
from indexer_q import reference as ref
from indexer_q import table
from indexer_q.tactics import SWAP_AB_MAX_M, Tactic, heuristic, valid_tactics
from indexer_q.testing import fp4_signed_codes, make_inputs

MODELS = {"v4-pro": 1536, "v4-flash": 1024}  # K; N = 8192 / TP
# Powers of two from 1 to 16384, and 1.5x points in the decode range (24-384), where token
# tiles switch (a 48-row batch runs on three 16-token tiles, a 64-row one on two of 32); each
# M takes the winner of the smallest profiled M at or above it.
BUCKETS = sorted([2**i for i in range(15)] + [3 * 2**i for i in range(3, 8)])
TABLES = Path(__file__).resolve().parent / "tables"  # per (model, TP)
PACKAGED = Path(__file__).resolve().parent.parent / "src" / "indexer_q" / "tables"  # per GPU, in the wheel
MIN_CODES_EQUAL = 0.997  # tests/test_kernel_sm90.py: what Hopper reaches with the Hadamard on
MIN_SCALES_EQUAL = 0.999  # the tests' floor for scale bytes


class Checker:
    """Agreement of a tactic's codes with the reference at CHECK_M tokens (0 when its scale
    bytes agree less than MIN_SCALES_EQUAL); the inputs and the reference's answer are made
    once per table."""

    def __init__(self, n, k, quantized_input=False):
        self.x = make_inputs(CHECK_M, n, k, p=4096, seed=CHECK_M, device="cuda")
        self.w = indexer_q.prepare_weights(self.x["weight"], self.x["weight_scale"])
        self.quantized = indexer_q.quantize_act_fp8(self.x["qr"]) if quantized_input else None
        x = self.x
        rq, rs = ref.fused_indexer_q(x["qr"], x["weight"], x["weight_scale"], x["positions"], x["cos_sin"],
                                     hadamard=True)
        self.ref_codes, self.ref_scales = fp4_signed_codes(rq), rs.view(torch.uint8)

    def __call__(self, tactic) -> float:
        x = self.x
        q, s = indexer_q.fused_indexer_q(*_qr(x, self.quantized), self.w, x["positions"], x["cos_sin"],
                                         hadamard=True, tactic=tactic, **_qr_scale(self.quantized))
        if (s.view(torch.uint8) == self.ref_scales).double().mean().item() < MIN_SCALES_EQUAL:
            return 0.0
        return (fp4_signed_codes(q) == self.ref_codes).double().mean().item()


def _qr(x, quantized) -> tuple:
    return (x["qr"],) if quantized is None else (quantized[0],)


def _qr_scale(quantized) -> dict:
    return {} if quantized is None else {"qr_scale": quantized[1]}


def time_tactics(tactics, sets, weights, quantized=None) -> dict:
    """Microseconds per call of each tactic, their graph replays interleaved as in the
    benchmark: timed one after another, a tactic's place in line moved its time by up to
    8% on the H200 (clocks and power settle over a sweep), more than the 3% the choice
    below calls noise. `quantized`: each set's qr quantized (the op is then given those)."""
    from tuning.bench import time_graphs

    def call(tactic):
        return lambda i: indexer_q.fused_indexer_q(
            *_qr(sets[i], quantized and quantized[i]), weights[i], sets[i]["positions"], sets[i]["cos_sin"],
            hadamard=True, tactic=tactic, **_qr_scale(quantized and quantized[i]))

    return time_graphs({t: call(t) for t in tactics}, len(sets), replays=7)


def precompile(tactics, n, k, arch) -> None:
    """Compile every candidate at once in worker processes (each fills the disk cache the
    tuner then loads from): one after another, compiling was a minute of each table. A
    failure is reported; the tuner then compiles that tactic itself and drops it if it
    fails there too."""
    from indexer_q import jit

    probe = dict(hadamard=True, fp4_rounding="floor-ties", out_format="mxfp4", positions_dtype="int64")
    for error in jit.precompile([(t.to_config(arch, **probe), n, k) for t in tactics]):
        print(f"precompile: {error}", file=sys.stderr)


MAX_REFINE = 4  # extra M points where winners change
NOISE = 0.03  # timing differences below this are noise (two runs agree to ~1-2%)


def choose(timings: dict, default) -> object:
    """Fastest tactic, unless the heuristic's is within NOISE of it: a tactic has to beat
    the default by more than run-to-run noise to be written into the table (with a 1%
    margin the tables picked 2x1 clusters that won by 1.4% in the tuner and lost by 10%
    in the benchmark)."""
    best = min(timings, key=timings.get)
    if default in timings and timings[default] <= timings[best] * (1 + NOISE):
        return default
    return best


def tactic_of_key(key: str, defaults: dict | None = None):
    """A tactic from a table's timing key: Tactic.spec() over the Tactic defaults the table
    recorded (`defaults`, its metadata's `tactic_defaults`: a spec leaves out the fields at
    their defaults, so a later change of a default must not move old timings onto another
    tactic), or, in tables before the twenty-fifth session, the tactic's whole dict as Python
    writes it. A recorded default of a field the Tactic no longer has is dropped (the knob
    at its default, off: what the kernels do now); a key setting such a field is refused
    (an unknown field of the spec)."""
    if key.startswith("{"):
        return Tactic.from_dict(ast.literal_eval(key))
    names = {f.name for f in dataclasses.fields(Tactic)}
    values = {name: v for name, v in (defaults or {}).items() if name in names}
    return Tactic.from_dict(values | Tactic.spec_fields(key))


def _rekeyed(by_tactic: dict, defaults: dict | None = None) -> dict:
    """Timing or check keys of any format (specs over `defaults`) as today's Tactic.spec()."""
    return {tactic_of_key(key, defaults).spec(): value for key, value in by_tactic.items()}


def rechoose(path, arch="sm_90a") -> Path:
    """Re-derive a table's entries from the timings it recorded, with the current `choose`
    and heuristic (no GPU)."""
    doc = json.loads(Path(path).read_text())
    timings = doc["metadata"]["timings_us"]
    sms = doc["metadata"].get("sms")  # the heuristic of the tuned GPU
    defaults = doc["metadata"].get("tactic_defaults")
    entries = []
    for e in doc["entries"]:
        measured = {tactic_of_key(t, defaults): us for t, us in timings[str(e["m_max"])].items()}
        default = heuristic(arch, e["m_max"], e["n"], e["k"], sms=sms,
                            quantized_input=table.entry_qr(e) == table.QR_FP8)
        entries.append(e | {"tactic": choose(measured, default)})
    table.write_table(Path(path), doc["metadata"], entries)
    return Path(path)


def _clear_change(ra, rb) -> bool:
    """The winners at two neighbouring M differ, and each loses by more than NOISE at the
    other's M (otherwise the change is noise and a midpoint would not be informative)."""
    (wa, ta), (wb, tb) = ra, rb
    if wa == wb or wb not in ta or wa not in tb:
        return False
    return ta[wb] > ta[wa] * (1 + NOISE) and tb[wa] > tb[wb] * (1 + NOISE)


CHECK_M = 1000  # rows per correctness check: partial tiles for both tile sizes


def profile(m, n, k, arch, log, checked: dict, checker, sms=None, quantized_input=False) -> tuple:
    """Time every valid tactic at M; each is checked against the reference (once per
    table, at CHECK_M tokens, before its first timing) and dropped if it disagrees."""
    from tuning.bench import cold_input_sets, n_cold_sets

    sets = cold_input_sets(m, n, k, n_cold_sets(m, n, k))
    weights = [indexer_q.prepare_weights(x["weight"], x["weight_scale"]) for x in sets]
    quantized = [indexer_q.quantize_act_fp8(x["qr"]) for x in sets] if quantized_input else None
    passed = []
    for tactic in valid_tactics(arch, m, n, k, sms, quantized_input):
        if tactic not in checked:
            try:
                checked[tactic] = checker(tactic)
            except Exception as exc:  # noqa: BLE001  (a tactic that fails to compile or run)
                log(f"  {tactic}: FAILED, {type(exc).__name__}: {exc}")
                checked[tactic] = 0.0
        if checked[tactic] < MIN_CODES_EQUAL:
            log(f"  {tactic}: REJECTED, {checked[tactic]:.5f} codes equal")
            continue
        passed.append(tactic)
    timings = time_tactics(passed, sets, weights, quantized)
    winner = choose(timings, heuristic(arch, m, n, k, sms=sms, quantized_input=quantized_input))
    return winner, timings


def _retuned(m, m_min: int | None, m_max: int | None) -> bool:
    """A partial re-tune's buckets: M above m_min (if given) and up to m_max (if given)."""
    return (m_min is None or int(m) > m_min) and (m_max is None or int(m) <= m_max)


def _kept_outside(path, m_min: int | None, m_max: int | None, meta: dict, n: int, k: int
                  ) -> tuple[list[dict], dict, dict]:
    """--m-min / --m-max: an earlier table's entries outside the re-tuned buckets (M <= m_min,
    M > m_max), with their timings and checks, to be kept beside a re-tune of those between.
    Refused unless that table is this (N, K)'s alone, with its timings, and was made for this
    setup (the same GPU, DSL and kernel fingerprint: its timings must still hold)."""
    for flag, bound in (("--m-min", m_min), ("--m-max", m_max)):
        if bound is not None and bound not in BUCKETS:
            raise SystemExit(f"{flag} {bound}: not a bucket (one of {BUCKETS}); the entries between it and the "
                             "next bucket would be neither re-tuned nor kept")
    if m_min is not None and m_max is not None and m_min >= m_max:
        raise SystemExit(f"--m-min {m_min} must be below --m-max {m_max}")
    span = f"M in ({m_min if m_min is not None else 0}, {m_max if m_max is not None else 'inf'}]"
    if not Path(path).exists():
        raise SystemExit(f"a partial re-tune keeps the entries outside {span} of {path}, which does not exist")
    doc = json.loads(Path(path).read_text())
    shapes = {(e["n"], e["k"]) for e in doc["entries"]}
    if shapes != {(n, k)} or "timings_us" not in doc["metadata"]:
        raise SystemExit(f"a partial re-tune needs {path} to be the tuner's own table of N = {n}, K = {k} (with "
                         f"its timings), not {sorted(shapes)}")
    old = doc["metadata"]
    stale = table.mismatches(old, meta)
    if stale:
        raise SystemExit(f"a partial re-tune keeps {path}'s entries outside {span}, but it was made for another "
                         f"setup ({' and '.join(stale)}): tune it whole")
    entries = [e for e in doc["entries"] if not _retuned(e["m_max"], m_min, m_max)]
    defaults = old.get("tactic_defaults")
    timings = {m: _rekeyed(t, defaults) for m, t in old["timings_us"].items() if not _retuned(m, m_min, m_max)}
    return entries, timings, _rekeyed(old.get("codes_equal", {}), defaults)


def tune(model: str, tp: int, out=None, buckets=BUCKETS, arch="sm_90a", log=print, m_max=None,
         m_min=None, quantized_input=False) -> Path:
    """Tune every bucket, or (m_min, m_max) only those above m_min and up to m_max, keeping
    the entries outside from the table at `out` (or the default path). `quantized_input`:
    for qr passed quantized, the swapped-A/B range's buckets (see the module's doc)."""
    k = MODELS[model]
    n = 8192 // tp
    results = {}
    checked: dict = {}
    gpu_meta = table.metadata()
    stem = table.table_file_name(gpu_meta["gpu"]).removesuffix(".json")
    qr_tag = "_fp8qr" if quantized_input else ""
    path = Path(out) if out else TABLES / f"{stem}_{model}_tp{tp}{qr_tag}.json"
    if quantized_input:
        buckets = [m for m in buckets if m <= SWAP_AB_MAX_M]
    kept, kept_timings, kept_checks = [], {}, {}
    if m_max is not None or m_min is not None:
        kept, kept_timings, kept_checks = _kept_outside(path, m_min, m_max, gpu_meta, n, k)
        buckets = [m for m in buckets if _retuned(m, m_min, m_max)]
    sms = gpu_meta["sms"]  # this GPU's: the heuristic and the candidates depend on it
    precompile(sorted({t for m in buckets for t in valid_tactics(arch, m, n, k, sms, quantized_input)}, key=repr),
               n, k, arch)
    checker = Checker(n, k, quantized_input)
    refined = 0
    todo = list(buckets)
    done = 0
    while todo:
        m = todo.pop(0)
        done += 1
        sys.stderr.write(f"\r[tune {model} tp{tp}] M={m:<6} ({done} profiled, {len(todo)} queued)   ")
        results[m] = profile(m, n, k, arch, log, checked, checker, sms, quantized_input)
        ms = sorted(results)
        for a, b in zip(ms, ms[1:]):  # refine where the winner changes by more than noise
            mid = (a + b) // 2
            if (refined < MAX_REFINE and _clear_change(results[a], results[b]) and mid not in results
                    and mid not in todo and a < mid < b):
                todo.append(mid)
                refined += 1
    sys.stderr.write("\n")
    qr = {"qr": table.QR_FP8} if quantized_input else {}
    entries = [{"n": n, "k": k, "m_max": m, **qr, "tactic": results[m][0]} for m in sorted(results)] + kept
    timings = {str(m): {t.spec(): round(us, 3) for t, us in tt.items()} for m, (_, tt) in results.items()}
    meta = gpu_meta | qr | {"model": model, "tp": tp, "checked_at_m": CHECK_M,
                       "tactic_defaults": Tactic().as_dict(),  # what the timing keys' specs leave out
                       "codes_equal": kept_checks | {t.spec(): round(a, 6) for t, a in checked.items()},
                       "timings_us": dict(sorted((timings | kept_timings).items(), key=lambda kv: int(kv[0])))}
    if m_max is not None:
        meta["retuned_up_to_m"] = m_max
    if m_min is not None:
        meta["retuned_above_m"] = m_min
    table.write_table(path, meta, entries)
    log(f"wrote {path}")
    return path


def merge(paths, out=None) -> Path:
    """One table for a GPU from per-(model, TP) tables: their entries (distinct (N, K) and qr form),
    under metadata they all share (the per-run details stay in the sources). `out`
    defaults to the package's table for that GPU, src/indexer_q/tables/<GPU>.json."""
    tables = [json.loads(Path(p).read_text()) for p in paths]
    keys = table.SHARED_FIELDS
    meta = {key: tables[0]["metadata"][key] for key in keys}
    for p, t in zip(paths, tables):
        differ = [key for key in keys if t["metadata"].get(key) != meta[key]]
        if differ:
            raise SystemExit(f"{p}: metadata {differ} differs from {paths[0]}'s")
    seen = set()
    entries = []
    for p, t in zip(paths, tables):
        shapes = {table.entry_shape(e) for e in t["entries"]}
        if shapes & seen:
            raise SystemExit(f"{p}: (N, K, qr) {sorted(shapes & seen)} already in another table")
        seen |= shapes
        entries += t["entries"]
    out = Path(out) if out else PACKAGED / table.table_file_name(meta["gpu"])
    table.write_table(out, meta | {"merged_from": [Path(p).name for p in paths]}, entries)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="indexer-q tune", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(MODELS))
    ap.add_argument("--tp", type=int, choices=[1, 2, 4, 8], default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--m-max", type=int, default=None,
                    help="re-tune only the buckets up to this M, keeping the entries above from the "
                         "table at --out (default: this model and TP's in tuning/tables/), which must "
                         "have been made for this setup (e.g. after adding small-M candidates)")
    ap.add_argument("--m-min", type=int, default=None,
                    help="re-tune only the buckets above this M (with --m-max: between the two), keeping "
                         "the entries up to it from the table at --out, as --m-max does")
    ap.add_argument("--rechoose", nargs="+", metavar="TABLE",
                    help="re-derive these tables' entries from their recorded timings (no GPU)")
    ap.add_argument("--quantized-input", action="store_true",
                    help="tune for qr passed quantized (fused_indexer_q's qr_scale), M up to the swapped-A/B "
                         "range; default --out: tuning/tables/<GPU>_<model>_tp<TP>_fp8qr.json")
    ap.add_argument("--merge", nargs="+", metavar="TABLE",
                    help="merge these per-(model, TP) tables into one per GPU instead of tuning "
                         "(no GPU needed); --out defaults to the packaged table, "
                         "src/indexer_q/tables/<GPU>.json")
    ap.add_argument("--install", nargs="*", metavar="TABLE", default=None,
                    help="also install the table written (or, given paths, install those without "
                         "tuning) as this user's table for this GPU: $XDG_DATA_HOME/indexer_q/tables/"
                         "<GPU>.json (default ~/.local/share/indexer_q/tables/), merged with the "
                         "installed entries of other (N, K); needs the GPU it was tuned on")
    args = ap.parse_args(argv)
    if args.rechoose:
        for p in args.rechoose:
            print(f"rewrote {rechoose(p)}")
        return 0
    if args.install:  # paths given: install those
        for p in args.install:
            print(f"installed {p} as {table.install_table(p)}")
        return 0
    if args.merge:
        path = merge(args.merge, args.out)
        print(f"wrote {path}")
    else:
        if not args.model:
            ap.error("--model is required (or --merge, --rechoose, --install TABLE)")
        if not torch.cuda.is_available():
            print("indexer-q tune needs a CUDA GPU", file=sys.stderr)
            return 2
        path = tune(args.model, args.tp, args.out, m_max=args.m_max, m_min=args.m_min,
                    quantized_input=args.quantized_input)
    if args.install is not None:
        print(f"installed {path} as {table.install_table(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
