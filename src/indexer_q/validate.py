"""The one validation layer of indexer_q.

The reference (`indexer_q.reference.fused_indexer_q`) and the kernel path
(`indexer_q.fused_indexer_q`) check their inputs with the same functions, so a call
that the reference accepts is one the kernel accepts (apart from the kernel-only
checks at the bottom: CUDA device, one device, arch, 16-byte alignment).

Every failure raises :class:`InvalidInputError` (a ``ValueError``) whose message
names the argument, what was expected and what was got::

    qr: expected dtype torch.bfloat16, got torch.float16

All checks run on the host and never synchronize with the GPU, except
:func:`check_power_of_two_scales`, which reads the scale values and is meant for
load time (``prepare_weights``) and the reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .constants import BLOCK, FP4_ROUNDINGS, HEAD_DIM, OUT_FORMATS, Q_BYTES_PER_HEAD, ROPE_WIDTH  # noqa: F401

ALIGN_BYTES = 16     # data-pointer alignment the kernels need (TMA / vector loads)


class InvalidInputError(ValueError):
    """An input of an indexer_q function is not what the contract allows."""


def fail(name: str, expected: str, got) -> None:
    raise InvalidInputError(f"{name}: expected {expected}, got {got}")


# ----------------------------------------------------------------------------------
# small composable checks
# ----------------------------------------------------------------------------------
def check_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        fail(name, "a torch.Tensor", type(x).__name__)


def check_dtype(name: str, x: torch.Tensor, *dtypes: torch.dtype) -> None:
    check_tensor(name, x)
    if x.dtype not in dtypes:
        want = " or ".join(f"dtype {d}" for d in dtypes)
        fail(name, want, f"dtype {x.dtype}")


def check_rank(name: str, x: torch.Tensor, rank: int, what: str = "") -> None:
    if x.dim() != rank:
        fail(name, f"a {rank}-D tensor{(' ' + what) if what else ''}",
             f"{x.dim()}-D tensor of shape {list(x.shape)}")


def check_dim(name: str, x: torch.Tensor, dim: int, size: int, why: str = "") -> None:
    if x.shape[dim] != size:
        fail(name, f"size {size} in dim {dim}{(' (' + why + ')') if why else ''}",
             f"shape {list(x.shape)}")


def check_divisible(name: str, x: torch.Tensor, dim: int, by: int = BLOCK, what: str = "") -> None:
    if x.shape[dim] % by != 0:
        label = what or f"dim {dim}"
        fail(name, f"{label} divisible by {by}", f"shape {list(x.shape)} ({label} = {x.shape[dim]})")


def check_min_size(name: str, x: torch.Tensor, dim: int, minimum: int, what: str = "") -> None:
    if x.shape[dim] < minimum:
        label = what or f"dim {dim}"
        fail(name, f"{label} >= {minimum}", f"shape {list(x.shape)}")


def check_contiguous(name: str, x: torch.Tensor) -> None:
    if not x.is_contiguous():
        fail(name, "a contiguous tensor", f"strides {list(x.stride())} for shape {list(x.shape)}")


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        fail(name, "one of " + ", ".join(repr(c) for c in choices), repr(value))


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        fail(name, "a bool", repr(value))


def check_same_device(name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if x.device != ref.device:
        fail(name, f"a tensor on {ref_name}'s device {ref.device}", f"device {x.device}")


# The smallest scale a UE8M0 byte holds (byte 0). fp32 goes lower (subnormals down to
# 2^-149), and the Blackwell kernel's scale-factor bytes would turn every such scale into
# 2^-127 (up to 2^22 too large), so they are refused for every arch (SPEC step 1).
MIN_UE8M0_SCALE = 2.0 ** -127


def check_power_of_two_scales(name: str, scale: torch.Tensor) -> None:
    """Every entry a finite, positive power of two that UE8M0 can hold, i.e. in
    [2^-127, 2^127] (reads the values: load time only)."""
    s = scale.detach().to(torch.float32)
    mant, _ = torch.frexp(s)
    bad = ~(torch.isfinite(s) & (s > 0) & (mant == 0.5))
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        fail(name, "every scale a positive finite power of two (UE8M0)",
             f"{float(s[idx])} at index {list(idx)}")
    tiny = s < MIN_UE8M0_SCALE
    if bool(tiny.any()):
        idx = tuple(int(i) for i in tiny.nonzero()[0])
        fail(name, "every scale at least 2^-127 (the smallest UE8M0 scale; fp32 subnormals have no UE8M0 byte)",
             f"{float(s[idx])} (2^{int(torch.frexp(s[idx])[1]) - 1}) at index {list(idx)}")


# ----------------------------------------------------------------------------------
# argument-level checks (shared by the reference and the kernel path)
# ----------------------------------------------------------------------------------
def check_qr(qr, name: str = "qr") -> tuple[int, int]:
    """bf16 [T, K], K % 128 == 0, contiguous. Returns (T, K)."""
    check_dtype(name, qr, torch.bfloat16)
    check_rank(name, qr, 2, "[T, K]")
    check_divisible(name, qr, 1, BLOCK, "K (dim 1)")
    check_min_size(name, qr, 1, BLOCK, "K (dim 1)")
    check_contiguous(name, qr)
    return qr.shape[0], qr.shape[1]


def check_quantized_qr(qr, qr_scale) -> tuple[int, int]:
    """qr already quantized by SPEC step 1 (what quantize_act_fp8 returns): float8_e4m3fn
    [T, K], K % 128 == 0, and qr_scale float32 [T, K/128] (the 2^e of each 128-wide block),
    both contiguous and on one device. The scale values are not read (no synchronization):
    the GEMM applies them as given. Returns (T, K)."""
    check_dtype("qr", qr, torch.float8_e4m3fn)
    check_rank("qr", qr, 2, "[T, K]")
    check_divisible("qr", qr, 1, BLOCK, "K (dim 1)")
    check_min_size("qr", qr, 1, BLOCK, "K (dim 1)")
    check_contiguous("qr", qr)
    t, k = qr.shape
    check_dtype("qr_scale", qr_scale, torch.float32)
    if list(qr_scale.shape) != [t, k // BLOCK]:
        fail("qr_scale", f"shape [{t}, {k // BLOCK}] (= [T, K/128] for qr [{t}, {k}])", f"shape {list(qr_scale.shape)}")
    check_contiguous("qr_scale", qr_scale)
    check_same_device("qr_scale", qr_scale, "qr", qr)
    return t, k


def check_qr_input(qr, qr_scale) -> tuple[int, int]:
    """The activation: bf16 qr, or with qr_scale the quantized qr (check_quantized_qr)."""
    if qr_scale is None:
        if isinstance(qr, torch.Tensor) and qr.dtype == torch.float8_e4m3fn:
            fail("qr_scale", "its float32 [T, K/128] block scales with a float8_e4m3fn qr (quantize_act_fp8's "
                             "two outputs)", "None")
        return check_qr(qr)
    return check_quantized_qr(qr, qr_scale)


def check_weight(weight, name: str = "weight") -> tuple[int, int]:
    """float8_e4m3fn [N, K], N and K multiples of 128, contiguous (K-major). Returns (N, K)."""
    check_dtype(name, weight, torch.float8_e4m3fn)
    check_rank(name, weight, 2, "[N, K]")
    check_divisible(name, weight, 0, BLOCK, "N (dim 0)")
    check_divisible(name, weight, 1, BLOCK, "K (dim 1)")
    check_min_size(name, weight, 0, BLOCK, "N (dim 0)")
    check_min_size(name, weight, 1, BLOCK, "K (dim 1)")
    check_contiguous(name, weight)
    return weight.shape[0], weight.shape[1]


def check_weight_scale(weight_scale, n: int, k: int, name: str = "weight_scale",
                       dtypes=(torch.float32, torch.float8_e8m0fnu), values: bool = True) -> None:
    """float32 or float8_e8m0fnu [N/128, K/128]; with values=True also powers of two."""
    check_dtype(name, weight_scale, *dtypes)
    check_rank(name, weight_scale, 2, "[N/128, K/128]")
    want = [n // BLOCK, k // BLOCK]
    if list(weight_scale.shape) != want:
        fail(name, f"shape {want} (= [N/128, K/128] for weight [{n}, {k}])",
             f"shape {list(weight_scale.shape)}")
    check_contiguous(name, weight_scale)
    if values:
        check_power_of_two_scales(name, weight_scale)


# The kernels index their tensors with 32-bit offsets (M and P are run-time values).
MAX_INDEX = 2**31 - 1


def check_index_range(t: int, n: int, k: int, p: int, out_format: str) -> None:
    """Sizes whose element offsets a 32-bit index still reaches: T rows of the widest
    tensor a kernel walks (q as 32-bit words, qr as words, positions), and P rows of
    cos_sin."""
    q_words = n // HEAD_DIM * Q_BYTES_PER_HEAD[out_format] // 4
    widest = max(q_words, k // 2, 1)
    if t * widest > MAX_INDEX:
        fail("qr", f"at most {MAX_INDEX // widest} tokens per call for N = {n}, K = {k}, "
                   f"out_format={out_format!r} (32-bit offsets); split the call", f"T = {t}")
    if p * ROPE_WIDTH > MAX_INDEX:
        fail("cos_sin", f"at most {MAX_INDEX // ROPE_WIDTH} rows (32-bit offsets)", f"P = {p}")


def check_positions(positions, t: int, name: str = "positions") -> None:
    check_dtype(name, positions, torch.int32, torch.int64)
    check_rank(name, positions, 1, "[T]")
    if positions.shape[0] != t:
        fail(name, f"shape [{t}] (T = qr.shape[0])", f"shape {list(positions.shape)}")
    check_contiguous(name, positions)


def check_positions_in_range(positions, p: int, name: str = "positions") -> None:
    """Opt-in (INDEXER_Q_CHECK=1): every position in [0, P). Reads the values, so it
    synchronizes with the GPU; by default an out-of-range position is not an error (that
    token is not rotated) and nothing is read on the host."""
    if positions.numel() == 0:
        return
    lo, hi = int(positions.min()), int(positions.max())
    if lo < 0 or hi >= p:
        bad = lo if lo < 0 else hi
        fail(name, f"values in [0, {p}) (the rows of cos_sin; INDEXER_Q_CHECK=1 is set)",
             f"a position of {bad}")


def check_cos_sin(cos_sin, name: str = "cos_sin") -> int:
    """float32 [P, 64], P >= 1, contiguous. Returns P."""
    check_dtype(name, cos_sin, torch.float32)
    check_rank(name, cos_sin, 2, "[P, 64]")
    if cos_sin.shape[1] != ROPE_WIDTH:
        fail(name, "shape [P, 64] (32 cos then 32 sin per position)", f"shape {list(cos_sin.shape)}")
    check_min_size(name, cos_sin, 0, 1, "P (dim 0)")
    check_contiguous(name, cos_sin)
    return cos_sin.shape[0]


def check_options(hadamard, fp4_rounding, out_format) -> None:
    check_bool("hadamard", hadamard)
    check_choice("fp4_rounding", fp4_rounding, FP4_ROUNDINGS)
    check_choice("out_format", out_format, OUT_FORMATS)


@dataclass(frozen=True)
class Problem:
    t: int
    k: int
    n: int
    heads: int
    p: int


def check_problem(qr, weight, weight_scale, positions, cos_sin, *, hadamard, fp4_rounding,
                  out_format, scale_dtypes=(torch.float32, torch.float8_e8m0fnu),
                  scale_values: bool = True, weight_name: str = "weight",
                  scale_name: str = "weight_scale", qr_scale=None) -> Problem:
    """Everything the contract says about one call, on any device (qr_scale: see check_qr_input)."""
    check_options(hadamard, fp4_rounding, out_format)
    t, k = check_qr_input(qr, qr_scale)
    n, wk = check_weight(weight, weight_name)
    if wk != k:
        fail("qr", f"K = {wk} ({weight_name}.shape[1])", f"shape {list(qr.shape)} (K = {k})")
    check_weight_scale(weight_scale, n, k, scale_name, dtypes=scale_dtypes, values=scale_values)
    check_positions(positions, t)
    p = check_cos_sin(cos_sin)
    check_same_device(weight_name, weight, "qr", qr)
    check_same_device(scale_name, weight_scale, "qr", qr)
    check_same_device("positions", positions, "qr", qr)
    check_same_device("cos_sin", cos_sin, "qr", qr)
    return Problem(t=t, k=k, n=n, heads=n // HEAD_DIM, p=p)


# ----------------------------------------------------------------------------------
# kernel-path checks (added on top of the shared ones by indexer_q.api)
# ----------------------------------------------------------------------------------
def check_cuda(name: str, x: torch.Tensor, what: str = "the fused kernel") -> None:
    if x.device.type != "cuda":
        fail(name, f"a CUDA tensor ({what} needs CUDA; "
                   "indexer_q.reference runs on the CPU)", f"device {x.device}")


def check_aligned(name: str, x: torch.Tensor, align: int = ALIGN_BYTES) -> None:
    if x.numel() > 0 and x.data_ptr() % align != 0:
        fail(name, f"a data pointer aligned to {align} bytes",
             f"address 0x{x.data_ptr():x} (offset {x.data_ptr() % align} mod {align})")


def check_arch_matches(name: str, weights_arch, device_arch: str, device) -> None:
    if weights_arch != device_arch:
        fail(name, f"weights prepared for {device_arch} (the arch of {device}); "
                   "call prepare_weights on that device",
             f"weights.arch = {weights_arch!r}")


def check_kernel_inputs(qr, weights, positions, cos_sin, *, hadamard, fp4_rounding,
                        out_format, device_arch_fn, qr_scale=None) -> Problem:
    """Shared checks plus what a kernel launch needs. `weights` is an IndexerQWeights;
    `device_arch_fn(device) -> str` gives the arch of qr's device (indexer_q.arch.detect_arch)."""
    from .weights import IndexerQWeights

    if not isinstance(weights, IndexerQWeights):
        fail("weights", "an IndexerQWeights from indexer_q.prepare_weights(weight, weight_scale)",
             type(weights).__name__)
    prob = check_problem(qr, weights.weight, weights.weight_scale, positions, cos_sin,
                         hadamard=hadamard, fp4_rounding=fp4_rounding, out_format=out_format,
                         scale_dtypes=(torch.float32,), scale_values=False,
                         weight_name="weights.weight", scale_name="weights.weight_scale", qr_scale=qr_scale)
    check_cuda("qr", qr)
    check_arch_matches("weights", weights.arch, device_arch_fn(qr.device), qr.device)
    for name, x in (("qr", qr), ("qr_scale", qr_scale), ("weights.weight", weights.weight),
                    ("weights.weight_scale", weights.weight_scale),
                    ("positions", positions), ("cos_sin", cos_sin)):
        if x is not None:
            check_aligned(name, x)
    if (weights.n, weights.k, weights.heads) != (prob.n, prob.k, prob.n // HEAD_DIM):
        fail("weights", f"n, k, heads = {prob.n}, {prob.k}, {prob.n // HEAD_DIM} (from weights.weight)",
             f"{weights.n}, {weights.k}, {weights.heads}")
    check_index_range(prob.t, prob.n, prob.k, prob.p, out_format)
    return prob
