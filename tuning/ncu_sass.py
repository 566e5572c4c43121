"""Stall reasons from Nsight Compute's source page (`sass.csv` of tuning/profile.sh):
`python -m tuning.ncu_sass DIR [DIR ...] [--top N]`. For each profile: the warp-state
samples by stall reason over the whole kernel and over its K loop (the instructions executed
as often as the first WGMMA: once per K block, or, where the loop is unrolled, once per
tile, with the tile's other per-tile code), then the N instructions with the most samples.
The K loop's `not_selected` share is the measure of the epilogue warps taking the
MMA warps' issue slots (fifteenth session: 5.7% in the probe, 21.6% with the epilogue)."""
from __future__ import annotations

import argparse
import collections
import csv
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"


def read(path: Path) -> list[dict]:
    """The source page's instruction rows (the first line names the kernel, the second the columns)."""
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    header = lines[1]
    return [dict(zip(header, row)) for row in lines[2:] if len(row) == len(header)]


def _int(row: dict, key: str) -> int:
    value = row.get(key, "") or "0"
    return int(value.replace(",", "")) if value.replace(",", "").isdigit() else 0


def stall_mix(rows: list[dict]) -> collections.Counter:
    """Samples by stall reason (the issued and not-issued samples together)."""
    mix: collections.Counter = collections.Counter()
    for row in rows:
        for key in row:
            if key.startswith("stall_") and "Not Issued" not in key:
                mix[key[len("stall_"):]] += _int(row, key)
    return mix


def k_loop(rows: list[dict]) -> list[dict]:
    """The instructions executed exactly as often as the first WGMMA (QGMMA / HGMMA)."""
    first = next((r for r in rows if "GMMA" in r["Source"]), None)
    if first is None:
        return []
    count = _int(first, "Instructions Executed")
    return [r for r in rows if _int(r, "Instructions Executed") == count]


def shares(mix: collections.Counter, n: int = 8) -> str:
    total = sum(mix.values()) or 1
    return ", ".join(f"{name} {100 * v / total:.1f}%" for name, v in mix.most_common(n))


def report(directory: Path, top: int) -> str:
    rows = read(directory / "sass.csv")
    loop = k_loop(rows)
    lines = [f"{directory}: {sum(_int(r, SAMPLES) for r in rows)} samples, {len(rows)} instructions",
             f"  all:    {shares(stall_mix(rows))}",
             f"  K loop: {sum(_int(r, SAMPLES) for r in loop)} samples, {len(loop)} instructions; "
             f"{shares(stall_mix(loop))}"]
    for row in sorted(rows, key=lambda r: -_int(r, SAMPLES))[:top]:
        lines.append(f"  {_int(row, SAMPLES):7d} x{_int(row, 'Instructions Executed'):<9d} "
                     f"{row['Source'].strip()[:72]}  [{_reasons(row)}]")
    return "\n".join(lines)


def _reasons(row: dict, n: int = 3) -> str:
    mix = stall_mix([row])
    return " ".join(f"{name} {v}" for name, v in mix.most_common(n) if v)


def listing(directory: Path) -> str:
    """Every instruction in program order: index, executions, samples, top reasons, SASS."""
    rows = read(directory / "sass.csv")
    return "\n".join(f"{i:5d} x{_int(r, 'Instructions Executed'):<8d} {_int(r, SAMPLES):6d}  "
                     f"{r['Source'].strip()[:80]:80s} [{_reasons(r)}]" for i, r in enumerate(rows))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--listing", type=Path, help="write the first DIR's whole instruction listing here")
    args = ap.parse_args(argv)
    print("\n\n".join(report(d, args.top) for d in args.dirs))
    if args.listing:
        args.listing.write_text(listing(args.dirs[0]) + "\n")


if __name__ == "__main__":
    main()
