"""A against B from tuning/ab_bench.sh's bench runs: `python -m tuning.ab_summary A1.json B1.json ...`.

Files are named by side and round (A1, B1, A2, ...). For every (shape, M, timed contender)
the table gives each run's microseconds, the mean of A and of B, and B - A (negative: B is
faster). The contenders are the bench's `*_us` columns: `fused_us` (the table's or the
heuristic's tactic; the markdown of each run says which), every forced `fused[...]_us`,
the act-quant and the peers.
"""
from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path


def load(paths) -> dict:
    """{(shape, M, column): {run tag: us}} from bench JSON files named <A|B><round>.json."""
    out: dict = {}
    for path in paths:
        tag = Path(path).stem
        if not re.fullmatch(r"[AB]\d+", tag):
            raise ValueError(f"{path}: expected a file named A<round>.json or B<round>.json")
        for row in json.loads(Path(path).read_text())["rows"]:
            for col, value in row.items():
                if col.endswith("_us") and isinstance(value, (int, float)) and col != "floor_us":
                    out.setdefault((row["shape"], row["M"], col), {})[tag] = float(value)
    return out


def table(data: dict) -> str:
    tags = sorted({t for runs in data.values() for t in runs}, key=lambda t: (int(t[1:]), t[0]))
    lines = ["| shape | M | contender | " + " | ".join(tags) + " | mean A | mean B | B - A |",
             "|---|---:|---|" + "---:|" * (len(tags) + 3)]
    for (shape, m, col), runs in sorted(data.items()):
        a = [v for t, v in runs.items() if t[0] == "A"]
        b = [v for t, v in runs.items() if t[0] == "B"]
        cells = [f"{runs[t]:.2f}" if t in runs else "-" for t in tags]
        mean_a = statistics.fmean(a) if a else float("nan")
        mean_b = statistics.fmean(b) if b else float("nan")
        name = col[:-3].replace("fused[", "[") if col.startswith("fused[") else col[:-3]
        lines.append(f"| {shape} | {m} | {name} | " + " | ".join(cells)
                     + f" | {mean_a:.2f} | {mean_b:.2f} | {mean_b - mean_a:+.2f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    print(table(load(argv if argv is not None else sys.argv[1:])))


if __name__ == "__main__":
    main()
