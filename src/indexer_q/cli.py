"""indexer-q (and python -m indexer_q): info | demo | compile | bench | tune.

Heavy modules (torch, CuTe DSL) are imported inside the commands, never at import."""
from __future__ import annotations

import argparse
import json

from .constants import FP4_ROUNDINGS, OUT_FORMATS, SUPPORTED_ARCHES

ARCH_CHOICES = SUPPORTED_ARCHES
DEMO_MS = (1, 128, 4096)


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


# ----------------------------------------------------------------------------------
def cmd_info(args) -> int:
    from . import __version__
    from .arch import ENV_ARCH, UnsupportedArchError, arch_override, detect_arch
    from .env import cache_dir

    import torch

    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
        cap = torch.cuda.get_device_capability(0)
        gpu = f"{gpu} (sm_{cap[0]}{cap[1]})"
        try:
            arch = detect_arch(torch.device("cuda", 0))
        except UnsupportedArchError as e:
            arch = f"unsupported: {e}"
    else:
        gpu = "no GPU"
        try:
            ov = arch_override()
        except UnsupportedArchError as e:
            ov = f"invalid: {e}"
        arch = f"none ({ENV_ARCH}={ov})" if ov else "none"
    rows = [
        ("GPU", gpu),
        ("arch", arch),
        ("indexer_q", __version__),
        ("torch", torch.__version__),
        ("nvidia-cutlass-dsl", _version("nvidia-cutlass-dsl")),
        ("apache-tvm-ffi", _version("apache-tvm-ffi")),
        ("cache dir", str(cache_dir())),
    ] + _table_rows(torch.cuda.is_available())
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def _table_rows(have_gpu: bool) -> list:
    """The tactic table calls on GPU 0 use, where it comes from and what was skipped; without
    a GPU (tables are per GPU), the tables that are set and those installed or shipped."""
    from . import table as T
    from .env import user_table_dir

    if have_gpu:
        d = T.describe_tables(0)
        if d["path"] is None:
            why = "no usable table for this GPU" if d["skipped"] else "no table for this GPU"
            rows = [("tactic table", f"{T.SOURCE_NONE}: {why}")]
        else:
            rows = [("tactic table", f"{d['path']} ({d['source']}): matches this GPU and these kernels")]
        rows += [("  skipped", f"{path} ({source}) {why}") for path, source, why in d["skipped"]]
        return rows
    here = T.software_metadata()
    rows = [("tactic table", f"{T.SOURCE_NONE}: no GPU (a table is chosen for a GPU by its name)")]
    for path, source in T.candidates(None):
        rows.append((f"  {source}", f"{path}{'' if path.is_file() else ' (missing)'}"))

    def listing(paths):
        out = []
        for path in paths:
            try:
                meta = json.loads(path.read_text())["metadata"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                out.append(f"{path.name}: cannot be read ({exc})")
                continue
            stale = T.mismatches(meta, here)
            fits = f"does not match: {' and '.join(stale)}" if stale else "matches these kernels"
            out.append(f"{path.name} ({meta.get('gpu')}, {meta.get('sms')} SMs): {fits}")
        return out

    for label, folder, paths in (("user tables", user_table_dir(), sorted(user_table_dir().glob("*.json"))),
                                 ("packaged tables", T.PACKAGE_TABLES, T.packaged_tables())):
        rows.append((label, f"{folder}{'' if paths else ': none'}"))
        rows += [("", f"  {line}") for line in listing(paths)]
    return rows


# ----------------------------------------------------------------------------------
def _print_compile(arch: str, out_dir) -> bool:
    """Compile every kernel for `arch`, print one line each; False if a PTX check failed."""
    from . import dispatch

    results = dispatch.compile_for_arch(arch, out_dir)
    if not results:
        print(f"compile {arch}: no kernels are built yet, nothing was compiled")
        return True
    ok = True
    for r in results:
        checks = r.get("checks") or {}
        ok = ok and all(checks.values())
        checks_s = " ".join(f"{k}={'ok' if v else 'FAIL'}" for k, v in checks.items()) or "-"
        print(f"compile {r.get('arch', arch)}: {r.get('kernel', '?')}  "
              f"{float(r.get('seconds', 0.0)):.1f} s  ptx={r.get('ptx') or '-'}  checks: {checks_s}")
    if arch not in dispatch.FUSED_KERNELS:
        print(f"compile {arch}: the fused indexer-Q kernel for {arch} is not built yet")
    return ok


def cmd_compile(args) -> int:
    return 0 if _print_compile(args.arch, args.out) else 1


# ----------------------------------------------------------------------------------
def _demo_cpu(args) -> int:
    from . import reference as R
    from .testing import V4_PRO, make_inputs

    print("no GPU found: running the torch reference on the CPU and compiling for both arches")
    t, n, k = 64, V4_PRO["N"], V4_PRO["K"]
    inp = make_inputs(t, n, k, seed=args.seed)
    for hadamard in (False, True):
        out = R.fused_indexer_q(**inp, hadamard=hadamard, fp4_rounding=args.fp4_rounding,
                                out_format="mxfp4")
        exact = R.float64_pipeline(**inp, hadamard=hadamard)
        err = R.relative_error(R.dequantize_fp4(*out), exact)
        print(f"reference  DeepSeek-V4-Pro M={t} N={n} K={k} hadamard={hadamard!s:<5} "
              f"fp4_rounding={args.fp4_rounding}: MXFP4 dequantized relative error "
              f"vs float64 = {err:.4f} (expected about 0.11)")
    if args.out_format != "mxfp4":
        out = R.fused_indexer_q(**inp, out_format=args.out_format)
        print(f"reference  out_format={args.out_format}: q {tuple(out[0].shape)} {out[0].dtype}")
    for arch in ARCH_CHOICES:
        _print_compile(arch, None)
    return 0


def _demo_gpu(args) -> int:
    import torch

    from . import reference as R
    from .api import fused_indexer_q, prepare_weights
    from .arch import detect_arch
    from .dispatch import KernelUnavailableError
    from .testing import V4_PRO, compare_outputs, make_inputs

    dev = torch.device("cuda")
    arch = detect_arch(dev)
    n, k = V4_PRO["N"], V4_PRO["K"]
    print(f"{torch.cuda.get_device_name(dev)} ({arch}); DeepSeek-V4-Pro N={n} K={k}, "
          f"out_format={args.out_format}, hadamard={args.hadamard}, fp4_rounding={args.fp4_rounding}")
    header = f"{'M':>6} {'codes equal':>12} {'scales equal':>13} {'max step':>9} {'median us':>10}"
    print(header)
    for m in args.m:
        inp = make_inputs(m, n, k, seed=args.seed + m, device=dev)
        w = prepare_weights(inp["weight"], inp["weight_scale"])
        kw = dict(hadamard=args.hadamard, fp4_rounding=args.fp4_rounding, out_format=args.out_format)
        try:
            got = fused_indexer_q(inp["qr"], w, inp["positions"], inp["cos_sin"], **kw)
        except KernelUnavailableError as e:
            print(f"{m:>6} kernel unavailable: {e}")
            continue
        torch.cuda.synchronize()
        ref = R.fused_indexer_q(**inp, **kw)
        cmp = compare_outputs(args.out_format, got, ref)
        times = []
        for i in range(args.warmup + args.iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fused_indexer_q(inp["qr"], w, inp["positions"], inp["cos_sin"], **kw)
            e.record()
            if i >= args.warmup:
                times.append((s, e))
        torch.cuda.synchronize()
        us = sorted(s.elapsed_time(e) * 1e3 for s, e in times)[len(times) // 2]
        se = "-" if cmp["scales_equal"] is None else f"{cmp['scales_equal']:.6f}"
        print(f"{m:>6} {cmp['codes_equal']:>12.6f} {se:>13} {cmp['max_step']:>9} {us:>10.1f}")
    return 0


def cmd_demo(args) -> int:
    import torch

    if torch.cuda.is_available():
        return _demo_gpu(args)
    return _demo_cpu(args)


# ----------------------------------------------------------------------------------
def cmd_tuning(args) -> int:
    """bench / tune live in the repository's tuning/ (they use the package, not the
    reverse); run them from a checkout."""
    import importlib

    try:
        module = importlib.import_module(f"tuning.{args.command}")
    except ImportError:
        print(f"indexer-q {args.command}: run it from a checkout of the repository "
              f"(python -m tuning.{args.command}); it is not part of the installed package")
        return 2
    return int(module.main(args.rest) or 0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="indexer-q", description=(
        "DeepSeek-V4 indexer-Q projection: FP8 block-scaled GEMM + RoPE + Hadamard + "
        "MXFP4/FP8 quantization fused in one CuTe DSL kernel."))
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("info", help="GPU, arch, versions, cache dir, tactic table")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("demo", help="run the op on DeepSeek-V4-Pro shapes and check it "
                                    "against the reference (CPU: reference + compile only)")
    s.add_argument("--out-format", choices=OUT_FORMATS, default="mxfp4")
    s.add_argument("--fp4-rounding", choices=FP4_ROUNDINGS, default="floor-ties")
    s.add_argument("--hadamard", action="store_true", help="rotate each head (GPU run)")
    s.add_argument("--m", type=int, nargs="+", default=list(DEMO_MS), help="token counts (GPU run)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--warmup", type=int, default=5)
    s.add_argument("--iters", type=int, default=20)
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser("compile", help="compile the kernels for one arch (no GPU needed)")
    s.add_argument("--arch", choices=ARCH_CHOICES, required=True)
    s.add_argument("--out", default=None, help="directory for the artifacts (PTX, ...)")
    s.set_defaults(func=cmd_compile)

    for name, text in (("bench", "the fused op beside its peers (tuning/bench.py; --help there)"),
                       ("tune", "offline autotuner writing a tactic table (tuning/tune.py); --install puts it in "
                                "$XDG_DATA_HOME/indexer_q/tables for this GPU")):
        s = sub.add_parser(name, help=text, add_help=False)  # its own parser takes the rest
        s.set_defaults(func=cmd_tuning)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command in ("bench", "tune"):
        args.rest = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
