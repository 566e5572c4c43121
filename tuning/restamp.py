"""Re-stamp tuned tables after a kernel edit that does not change the generated code:
`python -m tuning.restamp --baseline REV tuning/tables/NVIDIA_H200_*.json`.

A table records the fingerprint of the kernel sources it was tuned with, and is ignored
once they change (table.kernel_fingerprint). An edit that only moves code (a refactor, a
comment) leaves the timings valid. This proves it on the CPU instead of re-tuning on the
GPU: every distinct tactic of the tables (at its N and K, with the tuner's numerics) is
compiled for the tables' arch from REV's kernel sources (a git worktree) and from this
tree's, each in a subprocess with a cache directory of its own; only if every PTX is
byte-identical is each table's kernel_fingerprint set to this tree's (then `tune --merge`
rebuilds the packaged table). Otherwise nothing is written and the tactics whose code
changed are listed: re-tune those tables on the GPU.
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
NUMERICS = dict(hadamard=True, fp4_rounding="floor-ties", out_format="mxfp4", positions_dtype="int64")


def table_jobs(paths: list[Path]) -> tuple[str, list[dict]]:
    """(arch, the distinct compile jobs {tactic, n, k, sms}) of the tables."""
    arches, jobs = set(), {}
    for path in paths:
        table = json.loads(path.read_text())
        meta = table["metadata"]
        arch = meta.get("arch", "sm_90a")
        arches.add(arch)
        for entry in table["entries"]:
            job = {"tactic": entry["tactic"], "n": entry["n"], "k": entry["k"], "sms": meta["sms"]}
            jobs[json.dumps(job, sort_keys=True)] = job
    if len(arches) != 1:
        raise SystemExit(f"restamp: tables of several arches {sorted(arches)}: one arch a run")
    return arches.pop(), list(jobs.values())


def dump_ptx_digests(arch: str, jobs: list[dict]) -> list[str]:
    """In this process's source tree: sha256 of each job's PTX."""
    from indexer_q import jit
    from indexer_q.tactics import Tactic

    out = []
    for job in jobs:
        config = Tactic.from_dict(job["tactic"]).to_config(arch, **NUMERICS)
        with tempfile.TemporaryDirectory() as keep:
            jit.compile_fused(config, job["n"], job["k"], sms=job["sms"], keep_dir=keep)
            ptx = [p for p in Path(keep).glob("*.ptx")]
            if len(ptx) != 1:
                raise RuntimeError(f"restamp: {len(ptx)} PTX files for {job}")
            out.append(hashlib.sha256(ptx[0].read_bytes()).hexdigest())
    return out


def digests_in(tree: Path, arch: str, jobs: list[dict], cache: Path, fingerprint: str) -> list[str]:
    """dump_ptx_digests run on `tree`'s sources (src/ and the kernels/ it links), which
    must have `fingerprint`."""
    with tempfile.TemporaryDirectory() as tmp:
        job_file, out_file = Path(tmp) / "jobs.json", Path(tmp) / "digests.json"
        job_file.write_text(json.dumps({"arch": arch, "jobs": jobs}))
        env = dict(os.environ, PYTHONPATH=f"{tree / 'src'}{os.pathsep}{tree}", INDEXER_Q_CACHE_DIR=str(cache),
                   CUTE_DSL_ARCH=arch)
        # this file as a script (REV may predate it); indexer_q from `tree` (PYTHONPATH first)
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--dump", str(job_file), str(out_file)],
                       cwd=tree, env=env, check=True)
        out = json.loads(out_file.read_text())
        if out["fingerprint"] != fingerprint:
            raise RuntimeError(f"restamp: compiled kernels {out['fingerprint']}, not {tree}'s {fingerprint}")
        return out["digests"]


def fingerprint_in(tree: Path, arch: str) -> str:
    env = dict(os.environ, PYTHONPATH=f"{tree / 'src'}{os.pathsep}{tree}")
    code = f"from indexer_q.table import kernel_fingerprint; print(kernel_fingerprint({arch!r}))"
    return subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tables", nargs="*", type=Path)
    ap.add_argument("--baseline", help="the git revision whose kernels the tables were tuned with")
    ap.add_argument("--dump", nargs=2, metavar=("JOBS", "OUT"), help=argparse.SUPPRESS)  # worker mode
    args = ap.parse_args(argv)
    if args.dump:
        spec = json.loads(Path(args.dump[0]).read_text())
        from indexer_q.table import kernel_fingerprint

        Path(args.dump[1]).write_text(json.dumps({"fingerprint": kernel_fingerprint(spec["arch"]),
                                                  "digests": dump_ptx_digests(spec["arch"], spec["jobs"])}))
        return 0
    if not args.baseline or not args.tables:
        ap.error("give --baseline REV and the tables")
    arch, jobs = table_jobs(args.tables)
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
            print(f"restamp: compiling {len(jobs)} tactics twice ({args.baseline} and this tree)", flush=True)
            new_fp = fingerprint_in(ROOT, arch)
            old = digests_in(base, arch, jobs, Path(tmp) / "cache_old", old_fp)
            new = digests_in(ROOT, arch, jobs, Path(tmp) / "cache_new", new_fp)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)
    changed = [job for job, a, b in zip(jobs, old, new) if a != b]
    if changed:
        print(f"restamp: the code of {len(changed)} of {len(jobs)} tactics changed; re-tune. First: {changed[0]}")
        return 1
    for path in args.tables:
        table = json.loads(path.read_text())
        table["metadata"]["kernel_fingerprint"] = new_fp
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(table, indent=1))  # as table.save_table writes it
        os.replace(tmp, path)
    print(f"restamp: {len(jobs)} tactics compile to the same PTX; {len(args.tables)} tables {old_fp} -> {new_fp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
