"""Kernel side of the public API: arch + tactic -> compiled kernel -> launch.

api.py validates and calls the three functions below; nothing here validates again
(it runs on every call, so it only allocates outputs and launches).
"""
from __future__ import annotations

import dataclasses
import os
import tempfile

import torch


class KernelUnavailableError(NotImplementedError):
    """The fused kernel for this arch / format is not built yet."""


from .tactics import ARCHES_WITH_KERNELS as FUSED_KERNELS  # arches with a fused kernel (tactics.KERNEL_CLASSES)
# Output formats whose kernel output has been verified on hardware; the public op refuses
# the others (tests reach them through run_fused): it never hands out unverified bytes.
# sm_90a: mxfp4 by the SPEC's criteria; the FP8 formats byte-identical to the cuBLAS chain
# a Hopper engine runs (the SPEC's float64 criterion is out of reach for any Hopper FP8
# GEMM, see tests/test_kernel_sm90.py::test_fused_fp8_equals_the_hopper_chain).
VERIFIED_FORMATS = {"sm_90a": ("mxfp4", "fp8", "fp8-unscaled", "bf16")}
# Arches whose kernels take qr already quantized (qr_scale given): the sm_90a kernels read
# step 1's e4m3 bytes and float32 scales as the separate quantizer writes them; sm_100a's
# read its scale-factor atom layout, which only its own quantizer writes.
QUANTIZED_INPUT_ARCHES = ("sm_90a",)


# Per-call fast path: (arch, tactic, numerics, N, K) -> compiled kernel, so a call after
# the first does no dataclass building or compile-cache hashing.
_FUSED: dict = {}


def choose_tactic(arch: str, device, m: int, n: int, k: int, tactic=None, quantized_input: bool = False):
    """An explicit tactic (Tactic or dict), else the tuned table's, else the heuristic.
    Explicit tactics that cannot run at this N raise InvalidInputError (a table's such
    entries are dropped when the table is read, see table._usable_table; the kernel's own
    limits are checked when it is built, see jit.compile_fused). `quantized_input`: qr comes
    quantized, so an explicit tactic must not quantize it (fused_act_quant); the table's
    entries tuned for it are used, else the bf16 qr's choice's twin that reads it
    (tactics.for_quantized_input)."""
    from . import table
    from .tactics import Tactic, for_quantized_input, heuristic
    from .validate import MAX_INDEX, fail

    # the two-kernel tactic's bf16 y [M, N] is the widest tensor any kernel walks, and the
    # kernels index with 32-bit offsets (validate.check_index_range allows the op's own)
    y_too_large = m * (n // 2) > MAX_INDEX
    if tactic is not None:
        tactic = tactic if isinstance(tactic, Tactic) else Tactic.from_dict(dict(tactic))
        problems = tactic.problems(n)
        if tactic.separate_epilogue and y_too_large:
            problems.append(f"separate_epilogue at M = {m}, N = {n}: its bf16 output needs offsets past 32 bits "
                            f"(at most {MAX_INDEX // (n // 2)} tokens)")
        if quantized_input and tactic.fused_act_quant:
            problems.append("fused_act_quant quantizes a bf16 qr, and qr_scale says qr is quantized already")
        if problems:
            fail("tactic", f"a tactic that can run at N = {n}", "; ".join(problems))
        return tactic
    sms = _sm_count(device) if getattr(device, "type", None) == "cuda" else None
    chosen = quantized_input and table.lookup(m, n, k, device, quantized_input=True)
    chosen = chosen or table.lookup(m, n, k, device) or heuristic(arch, m, n, k, sms=sms)
    if quantized_input and chosen.fused_act_quant:  # an entry tuned for it is its own twin
        chosen = for_quantized_input(arch, chosen, m, n, k, sms=sms)
    if chosen.separate_epilogue and y_too_large:  # the same tactic fused: the same bytes
        chosen = dataclasses.replace(chosen, separate_epilogue=False)
    return chosen


_ACT_QUANT: dict = {}  # device -> compiled activation quantizer


def run_act_quant(qr, out=None):
    """SPEC step 1 on the GPU; returns (a_fp8 [T, K], scale float32 [T, K/128]), written
    into `out` when given (tests poison it to catch a GEMM that reads it too early)."""
    from . import jit

    t, k = qr.shape
    if out is None:
        out = (torch.empty(t, k, dtype=torch.float8_e4m3fn, device=qr.device),
               torch.empty(t, k // 128, dtype=torch.float32, device=qr.device))
    a_fp8, scale = out
    kernel = _ACT_QUANT.get(qr.device)
    if kernel is None:
        kernel = _ACT_QUANT.setdefault(qr.device, jit.compile_act_quant(_arch_of(qr.device)))
    kernel(qr.view(torch.int32), a_fp8.view(torch.int32), scale)
    return a_fp8, scale


def _arch_of(device):
    from .arch import detect_arch

    return detect_arch(device)


def check_available(arch, out_format, quantized_input: bool = False) -> None:
    """Raise KernelUnavailableError unless a fused kernel for `arch` exists and its
    `out_format` output has been verified on hardware (and, for a quantized qr, the arch's
    kernels take one)."""
    if arch not in FUSED_KERNELS:
        raise KernelUnavailableError(
            f"fused_indexer_q: no fused kernel is built for {arch} yet "
            f"(built: {', '.join(FUSED_KERNELS)}); indexer_q.reference.fused_indexer_q runs anywhere"
        )
    if out_format not in VERIFIED_FORMATS.get(arch, ()):
        raise KernelUnavailableError(
            f"fused_indexer_q: out_format={out_format!r} is not verified on {arch} yet "
            f"(verified: {', '.join(VERIFIED_FORMATS.get(arch, ())) or 'none'}); "
            "indexer_q.reference.fused_indexer_q computes it")
    if quantized_input:
        check_quantized_input(arch)


def check_quantized_input(arch) -> None:
    """Raise KernelUnavailableError unless `arch`'s kernels take a quantized qr."""
    if arch not in QUANTIZED_INPUT_ARCHES:
        raise KernelUnavailableError(
            f"fused_indexer_q: a quantized qr (qr_scale given) is taken on {', '.join(QUANTIZED_INPUT_ARCHES)} "
            f"only, not {arch}; pass the bf16 qr")


def tactic_json(tactic) -> str:
    """A tactic as the string the torch op carries ("" = choose per call)."""
    import json

    from .tactics import Tactic

    if tactic is None:
        return ""
    if not isinstance(tactic, Tactic):
        tactic = Tactic.from_dict(dict(tactic))
    return json.dumps(tactic.as_dict(), sort_keys=True)


def run_fused(qr, weights, positions, cos_sin, *, hadamard, fp4_rounding, out_format, tactic=None,
              out=None, verified_only=True, act_out=None, qr_scale=None):
    """Launch on already-validated inputs; returns (q, q_scale) as api.fused_indexer_q documents.
    `qr_scale`: qr is SPEC step 1's e4m3 output and these its float32 scales (no quantizer runs);
    `out`: preallocated (q, q_scale) of the right dtype/shape (tests poison them);
    `act_out`: the same for the quantized activation and its scales (tests poison them:
    with PDL the GEMM may start before the quantizer has written them);
    `verified_only=False` lets tests run formats not yet verified on hardware."""
    from . import jit

    arch = weights.arch
    t, k = qr.shape
    n, heads = weights.n, weights.heads
    quantized_input = qr_scale is not None
    if verified_only:
        check_available(arch, out_format, quantized_input)
    elif quantized_input:
        check_quantized_input(arch)
    tactic = choose_tactic(arch, qr.device, t, n, k, tactic, quantized_input)
    sms = _sm_count(qr.device)  # the persistent grid's size: part of the compile key
    key = (arch, tactic, hadamard, fp4_rounding, out_format, positions.dtype, n, k, sms)
    kernels = _FUSED.get(key)
    if kernels is None:  # first call of this combination: build the compile keys
        numerics = dict(hadamard=hadamard, fp4_rounding=fp4_rounding, out_format=out_format,
                        positions_dtype="int64" if positions.dtype == torch.int64 else "int32")
        kernels = (jit.compile_fused(tactic.to_config(arch, **numerics), n, k, sms=sms),
                   jit.compile_row_epilogue(tactic.epilogue_config(arch, **numerics), n)
                   if tactic.separate_epilogue else None)
        kernels = _FUSED.setdefault(key, kernels)
    kernel, row_epilogue = kernels
    if quantized_input:  # the caller's step 1 output: the GEMM's own launch only
        operands = _operands(arch, qr, qr_scale, weights)
    elif tactic.fused_act_quant:  # the kernel quantizes qr itself: one launch
        operands = (qr, weights.weight, weights.weight_scale)
    elif arch == "sm_100a":  # the quantizer writes the GEMM's scale-factor layout itself
        operands = _operands(arch, *run_act_quant_sf(qr, act_out), weights)
    else:
        a_fp8, a_scale = run_act_quant(qr, act_out)
        operands = _operands(arch, a_fp8, a_scale, weights)
    dev = qr.device
    if out is None:
        from .reference import empty_outputs

        out = empty_outputs(t, heads, out_format, dev)
    q, q_scale = out
    q_words = q.view(torch.uint8).view(t, -1).view(torch.int32)
    if q_scale is not None:
        scale_words = q_scale.view(torch.int32)
    else:
        scale_words = torch.empty(1, 1, dtype=torch.int32, device=dev)
    if row_epilogue is None:
        kernel(*operands, positions, cos_sin, q_words, scale_words)
    else:  # the two-kernel tactic: the GEMM's bf16 output, then steps 3-6 over it
        y_words = torch.empty(t, n // 2, dtype=torch.int32, device=dev)
        kernel(*operands, positions, cos_sin, y_words, scale_words)
        row_epilogue(y_words, positions, cos_sin, q_words, scale_words)
    return q, q_scale


def _operands(arch, a_fp8, a_scale, weights) -> tuple:
    """The GEMM operands in the layout each arch's kernel reads. sm_100a: `a_scale` is
    already the activation's UE8M0 bytes in tcgen05's atom layout (run_act_quant_sf), the
    weight's were laid out by prepare_weights: no work here (not run on hardware yet)."""
    if arch == "sm_100a":
        return a_fp8, a_scale, weights.weight, weights.extras["sf_atoms"]
    return a_fp8, a_scale, weights.weight, weights.weight_scale


_SM_COUNT: dict = {}  # device -> SM count


def _sm_count(device) -> int:
    n = _SM_COUNT.get(device)
    if n is None:
        n = _SM_COUNT.setdefault(device, int(torch.cuda.get_device_properties(device).multi_processor_count))
    return n


_ACT_QUANT_SF: dict = {}  # device -> compiled sm_100a activation quantizer


def compile_act_quant_sf(arch: str = "sm_100a", *, keep_dir=None):
    """The sm_100a activation quantizer (kernels/act_quant_sm100.py): e4m3 bytes and the
    scale factors in the fused kernel's atom layout; M and K symbolic. `arch` other than
    sm_100a only for tests (its arithmetic and layout are arch-neutral)."""
    from . import jit

    def build():
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

        from indexer_q.kernels.act_quant_sm100 import ActQuantFp8Sf

        m, kw, kq = cute.sym_int(), cute.sym_int(), cute.sym_int()
        args = [
            make_fake_compact_tensor(cutlass.Int32, (m, kw), stride_order=(1, 0), assumed_align=16),
            make_fake_compact_tensor(cutlass.Int32, (m, kq), stride_order=(1, 0), assumed_align=16),
            make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=16),
            make_fake_stream(use_tvm_ffi_env_stream=True),
        ]
        return jit._compile("act_quant_fp8_sf", arch, ActQuantFp8Sf(arch), args, keep_dir)

    if arch != "sm_100a":  # a test build: the disk key's kernel fingerprint is sm_100a's sources
        return build()
    return jit._cached(("act_quant_fp8_sf", arch), keep_dir, build)


def run_act_quant_sf(qr, out=None, arch=None):
    """SPEC step 1 for the sm_100a kernel, one launch: (a_fp8 [T, K], its UE8M0 scale
    factors as uint8 in the atom layout, rows padded to 128: what _operands hands the
    GEMM). `out`: preallocated (a_fp8, int32 words [act_quant_sm100.sf_words(T, K)])."""
    from indexer_q.kernels.act_quant_sm100 import sf_words

    t, k = qr.shape
    if out is None:
        out = (torch.empty(t, k, dtype=torch.float8_e4m3fn, device=qr.device),
               torch.empty(sf_words(t, k), dtype=torch.int32, device=qr.device))
    a_fp8, sf = out
    kernel = _ACT_QUANT_SF.get((qr.device, arch))
    if kernel is None:
        kernel = _ACT_QUANT_SF.setdefault((qr.device, arch), compile_act_quant_sf(arch or "sm_100a"))
    kernel(qr.view(torch.int32), a_fp8.view(torch.int32), sf.view(torch.int32))
    return a_fp8, sf.view(torch.uint8)


def _compile_samples():
    from indexer_q.kernels.gemm_base import GemmConfig

    return (("native_tile_m64", GemmConfig(tile_m=64, hadamard=True)),
            ("native_tile_m128", GemmConfig(tile_m=128, hadamard=True)),
            ("swap_ab_tile_m16_fused_quant", GemmConfig(kind="swap_ab", tile_m=16, hadamard=True,
                                                        fused_act_quant=True)),
            ("swap_ab_tile_m64_split_k2", GemmConfig(kind="swap_ab", tile_m=64, split_k=2, hadamard=True)),
            ("swap_ab_tile_m128", GemmConfig(kind="swap_ab", tile_m=128, hadamard=True)))


def compile_for_arch(arch: str, out_dir=None) -> list[dict]:
    """Compile every kernel for `arch` (no GPU needed); one dict per kernel:
    {"kernel", "arch", "seconds", "ptx", "checks": {name: bool}}."""
    from . import jit

    records = []
    out_dir = str(out_dir) if out_dir else tempfile.mkdtemp(prefix=f"indexer_q_{arch}_")

    def record(name, ck, checks):
        ptx = ck.artifacts.get("ptx")
        records.append({"kernel": name, "arch": arch, "seconds": round(ck.seconds, 2),
                        "ptx": ptx, "checks": checks})

    ck = jit.compile_act_quant(arch, keep_dir=_sub(out_dir, "act_quant"))
    record("act_quant_fp8", ck, {"cvt.rn.satfinite.e4m3x2": _ptx_has(ck, "cvt.rn.satfinite.e4m3x2.f32")})
    if arch == "sm_100a":  # the quantizer the fused kernel runs after (scale-factor layout)
        ck = compile_act_quant_sf(arch, keep_dir=_sub(out_dir, "act_quant_sf"))
        record("act_quant_fp8_sf", ck, {"cvt.rn.satfinite.e4m3x2": _ptx_has(ck, "cvt.rn.satfinite.e4m3x2.f32")})
    if arch in FUSED_KERNELS:
        from .tactics import kernel_class

        for name, cfg in _compile_samples():
            cfg = dataclasses.replace(cfg, arch=arch)
            cls = kernel_class(arch, cfg.kind)
            if cls is None or not cls.can_implement(cfg, 8192, 1536):
                continue
            ck = jit.compile_fused(cfg, 8192, 1536, keep_dir=_sub(out_dir, f"fused_{name}"))
            check, needle = cls.ptx_signature
            record(f"fused_{name}", ck, {check: _ptx_has(ck, needle.format(tile=cfg.tile_m))})
        # the two-kernel tactic's second launch: arch-neutral code, the Hadamard's butterfly
        from indexer_q.kernels.gemm_base import GemmConfig

        ck = jit.compile_row_epilogue(GemmConfig(arch=arch, hadamard=True), 8192,
                                      keep_dir=_sub(out_dir, "row_epilogue"))
        record("row_epilogue", ck, {"shfl.sync.bfly": _ptx_has(ck, "shfl.sync.bfly")})
    return records


def _sub(out_dir, name):
    return os.path.join(out_dir, name) if out_dir else None


def _ptx_has(ck, needle: str):
    path = ck.artifacts.get("ptx")
    if not path:
        return None
    with open(path) as f:
        return needle in f.read()
