"""Re-stamp tuned tables after a kernel edit that does not change the generated code:
`python -m tuning.restamp --baseline REV tuning/tables/NVIDIA_H200_*.json`.

A table records the fingerprint of the kernel sources it was tuned with, and is ignored
once they change (table.kernel_fingerprint). An edit that only moves code (a refactor, a
comment) leaves the timings valid. This proves it on the CPU instead of re-tuning on the
GPU: every distinct tactic of the tables (at its N and K, under each of NUMERICS) is
compiled for the tables' arch from REV's kernel sources (a git worktree) and from this
tree's, in two subprocesses with cache directories of their own. Only if every PTX and
every module's IR are byte-identical (CuTe DSL's clean IR, which also holds the host
side's launch: grid, cluster, block, shared-memory size, PDL; the PTX does not) is each
table's kernel_fingerprint set to this tree's (then `tune --merge` rebuilds the packaged
table). Otherwise nothing is written and the tactics whose code changed are listed:
re-tune those tables on the GPU.

`--retune-up-to M`: the entries whose bucket (m_max) is M or less are left out of the
comparison, for a change whose code reaches only those buckets' tactics, right before
`retune_bench.sh` with M_MAX = M re-tunes them (the tuner keeps only the entries above M_MAX,
and refuses tables of another fingerprint). Never commit a table so restamped without that
re-tune.

`--timed-numerics-only`: only the numerics the tuner times (NUMERICS[0]: MXFP4 with the
Hadamard) must compile to the same code; changes under the others are listed, not refused.
A table's timings are of that numerics alone, so they stay valid; use it for a change that
touches only other formats' code, with a GPU A/B of those formats and their byte tests.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the tuner's numerics first, then the other code paths a table's tactic also serves
NUMERICS = (dict(hadamard=True, fp4_rounding="floor-ties", out_format="mxfp4", positions_dtype="int64"),
            dict(hadamard=False, fp4_rounding="rne", out_format="mxfp4", positions_dtype="int32"),
            dict(hadamard=True, fp4_rounding="floor-ties", out_format="fp8", positions_dtype="int64"),
            dict(hadamard=False, fp4_rounding="floor-ties", out_format="bf16", positions_dtype="int64"))


def table_jobs(paths: list[Path], retune_up_to: int = 0) -> tuple[str, list[dict]]:
    """(arch, the distinct compile jobs {tactic, n, k, sms}) of the tables' entries whose
    bucket is above M = retune_up_to."""
    arches, jobs = set(), {}
    for path in paths:
        table = json.loads(Path(path).read_text())
        meta = table["metadata"]
        arches.add(meta.get("arch", "sm_90a"))
        for entry in table["entries"]:
            if entry["m_max"] <= retune_up_to:
                continue
            job = {"tactic": entry["tactic"], "n": entry["n"], "k": entry["k"], "sms": meta["sms"]}
            jobs[json.dumps(job, sort_keys=True)] = job
    if len(arches) != 1:
        raise SystemExit(f"restamp: tables of several arches {sorted(arches)}: one arch a run")
    return arches.pop(), list(jobs.values())


def dump_digests(arch: str, jobs: list[dict]) -> list[list[str]]:
    """In this process's source tree: for each job, sha256 of its PTX and clean IR under
    each of NUMERICS. Run as the worker, with CUTE_DSL_KEEP=ir and CUTE_DSL_DUMP_DIR set."""
    from indexer_q import jit
    from indexer_q.tactics import Tactic

    ir_dir = Path(os.environ["CUTE_DSL_DUMP_DIR"])
    out = []
    for job in jobs:
        per_numerics = []
        for numerics in NUMERICS:
            h = hashlib.sha256()
            config = Tactic.from_dict(job["tactic"]).to_config(arch, **numerics)
            for old in ir_dir.glob("*"):
                old.unlink()
            with tempfile.TemporaryDirectory() as keep:
                jit.compile_fused(config, job["n"], job["k"], sms=job["sms"], keep_dir=keep)
                files = sorted(Path(keep).glob("*.ptx")) + sorted(ir_dir.glob("*.mlir"))
                if len(files) != 2:
                    raise RuntimeError(f"restamp: {[f.name for f in files]} for {job}, {numerics}")
                for f in files:
                    h.update(f.read_bytes())
            per_numerics.append(h.hexdigest())
        out.append(per_numerics)
    return out


def digests_in(trees: list[tuple[Path, str]], arch: str, jobs: list[dict], tmp: Path) -> list[list[str]]:
    """dump_digests on each (tree, its kernel fingerprint), the trees at once: one
    subprocess a tree on its own sources (src/ and the kernels/ it links), each checked to
    have compiled kernels of that fingerprint."""
    spec = tmp / "jobs.json"
    spec.write_text(json.dumps({"arch": arch, "jobs": jobs}))
    running = []
    for i, (tree, _) in enumerate(trees):
        (tmp / f"ir{i}").mkdir()
        env = dict(os.environ, PYTHONPATH=f"{tree / 'src'}{os.pathsep}{tree}", INDEXER_Q_CACHE_DIR=str(tmp / f"c{i}"),
                   CUTE_DSL_ARCH=arch, CUTE_DSL_KEEP="ir", CUTE_DSL_DUMP_DIR=str(tmp / f"ir{i}"))
        # this file as a script (REV may predate it); indexer_q from `tree` (PYTHONPATH first)
        running.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--dump", str(spec),
                                         str(tmp / f"out{i}.json")], cwd=tree, env=env))
    if any([p.wait() for p in running]):
        raise RuntimeError("restamp: a compile worker failed")
    out = []
    for i, (tree, fingerprint) in enumerate(trees):
        got = json.loads((tmp / f"out{i}.json").read_text())
        if got["fingerprint"] != fingerprint:
            raise RuntimeError(f"restamp: compiled kernels {got['fingerprint']}, not {tree}'s {fingerprint}")
        out.append(got["digests"])
    return out


def compare(old: list[list[str]], new: list[list[str]], timed_only: bool) -> tuple[list[int], list[int]]:
    """(the jobs whose change refuses the restamp, the NUMERICS indices past the tuner's
    whose code changed in some job); digests [job][numerics] as dump_digests gives them."""
    refused = [j for j, (a, b) in enumerate(zip(old, new)) if (a[0] != b[0] if timed_only else a != b)]
    untimed = [i for i in range(1, len(NUMERICS)) if any(a[i] != b[i] for a, b in zip(old, new))]
    return refused, untimed


def fingerprint_in(tree: Path, arch: str) -> str:
    env = dict(os.environ, PYTHONPATH=f"{tree / 'src'}{os.pathsep}{tree}")
    code = f"from indexer_q.table import kernel_fingerprint; print(kernel_fingerprint({arch!r}))"
    return subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tables", nargs="*", type=Path)
    ap.add_argument("--baseline", help="the git revision whose kernels the tables were tuned with")
    ap.add_argument("--timed-numerics-only", action="store_true",
                    help="refuse only changes under the numerics the tuner times (module doc)")
    ap.add_argument("--retune-up-to", type=int, default=0, metavar="M",
                    help="leave out the entries whose bucket is M or less (re-tuned next with M_MAX = M; "
                         "module doc)")
    ap.add_argument("--dump", nargs=2, metavar=("JOBS", "OUT"), help=argparse.SUPPRESS)  # worker mode
    args = ap.parse_args(argv)
    if args.dump:
        from indexer_q.table import kernel_fingerprint

        spec = json.loads(Path(args.dump[0]).read_text())
        Path(args.dump[1]).write_text(json.dumps({"fingerprint": kernel_fingerprint(spec["arch"]),
                                                  "digests": dump_digests(spec["arch"], spec["jobs"])}))
        return 0
    if not args.baseline or not args.tables:
        ap.error("give --baseline REV and the tables")
    arch, jobs = table_jobs(args.tables, args.retune_up_to)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.baseline], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            old_fp = fingerprint_in(base, arch)
            stale = [p for p in args.tables if json.loads(p.read_text())["metadata"]["kernel_fingerprint"] != old_fp]
            if stale:
                print(f"restamp: not tuned with {args.baseline}'s kernels ({old_fp}): {', '.join(map(str, stale))}")
                return 1
            new_fp = fingerprint_in(ROOT, arch)
            print(f"restamp: compiling {len(jobs)} tactics x {len(NUMERICS)} numerics in {args.baseline} and in "
                  "this tree", flush=True)
            old, new = digests_in([(base, old_fp), (ROOT, new_fp)], arch, jobs, Path(tmp))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)
    refused, untimed = compare(old, new, args.timed_numerics_only)
    if refused:
        where = " under the tuner's numerics" if args.timed_numerics_only else ""
        print(f"restamp: the code of {len(refused)} of {len(jobs)} tactics changed{where}; re-tune. First: "
              f"{jobs[refused[0]]}")
        return 1
    if untimed:
        print(f"restamp: {len(jobs)} tactics keep their code under the tuner's numerics; it changed under "
              f"{', '.join(str(NUMERICS[i]) for i in untimed)}")
    from indexer_q.table import write_table

    for path in args.tables:
        doc = json.loads(path.read_text())
        write_table(path, doc["metadata"] | {"kernel_fingerprint": new_fp}, doc["entries"])
    what = " under the tuner's numerics" if untimed else ""
    unchecked = f" (the entries up to M = {args.retune_up_to} not checked: re-tune them)" if args.retune_up_to else ""
    print(f"restamp: {len(jobs)} tactics compile to the same PTX and IR{what}; {len(args.tables)} tables "
          f"{old_fp} -> {new_fp}{unchecked}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
