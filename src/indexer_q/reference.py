"""SPEC.md in torch, one function per step; runs on CPU and CUDA tensors.

This is the numeric contract the kernels are tested against. Step 2 (the GEMM) is
computed in float64 and rounded to bf16 once; every other step is an exact function
of its inputs and the kernels must match it bit for bit.

Refinements of SPEC.md that kernel and reference share (see README, "Contract"):

* ``ceil_log2_exact`` clamps its result to at most 128, so a block whose amax is NaN or
  Inf gets scale byte 0xFF (UE8M0 NaN) and float scale 2^128 = inf.
* RoPE: a position outside [0, P) is not an error; that token is not rotated, i.e. it
  is computed through the same formula with c = 1, s = 0.
* Hadamard: the exact fp32 operation order is fixed (see ``hadamard_128``).
"""
from __future__ import annotations

import math
import struct

import torch

from . import validate as V
from .scales import ceil_log2_exact, exp2_int, scale_to_ue8m0, ue8m0_to_scale  # noqa: F401  (re-exported)

E4M3_MAX = 448.0
E2M1_MAX = 6.0
AMAX_FLOOR = 1e-4
# E2M1 code k+1 starts above FP4_THRESHOLDS[k]; all ties are at these values.
FP4_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# Ties that round *up* under "rne" (to the even code): 0.75 -> 2, 1.75 -> 4, 3.5 -> 6.
FP4_RNE_TIES_UP = (0.75, 1.75, 3.5)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ----------------------------------------------------------------------------------
# exact helpers (ceil_log2_exact, exp2_int, scale_to_ue8m0, ue8m0_to_scale: scales.py)
# ----------------------------------------------------------------------------------
def _block_scale_exponent(x_f32: torch.Tensor, qmax: float) -> torch.Tensor:
    """e = ceil_log2(fp32(max(amax, 1e-4) / qmax)) over the last dim (keepdim)."""
    amax = x_f32.abs().amax(dim=-1, keepdim=True)
    amax = torch.clamp(amax, min=AMAX_FLOOR)          # NaN propagates
    s = amax / qmax                                   # one fp32 division, RNE
    return ceil_log2_exact(s)


def _scale_down(x_f32: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """x * 2^-e, exact (computed in float64, then to float32)."""
    return (x_f32.to(torch.float64) * exp2_int(-e)).to(torch.float32)


def cast_e4m3_sat(y: torch.Tensor) -> torch.Tensor:
    """float -> float8_e4m3fn, round to nearest even, saturated to +-448 (torch's own cast
    does not saturate). -0 stays -0; NaN stays NaN."""
    return torch.clamp(y.to(torch.float32), -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def round_f64_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """float64 -> bf16 with a single round-to-nearest-even (torch's own double->bf16 cast
    goes through float32 and can round twice). Done by rounding to float32 with
    round-to-odd, which makes the following RNE to bf16 exact."""
    x = x.to(torch.float64)
    t = x.to(torch.float32)                           # RNE
    over = t.to(torch.float64).abs() > x.abs()
    t = torch.where(over, torch.nextafter(t, torch.zeros_like(t)), t)   # now truncated
    inexact = t.to(torch.float64) != x
    bits = t.view(torch.int32)
    bits = torch.where(inexact & torch.isfinite(t), bits | 1, bits)     # sticky bit
    return bits.view(torch.float32).to(torch.bfloat16)


# ----------------------------------------------------------------------------------
# step 1: activation FP8 quantization, 1x128, UE8M0
# ----------------------------------------------------------------------------------
def quantize_act_fp8_e(qr: torch.Tensor):
    """Step 1, returning the exponents: (a_fp8 [T, K], e int32 [T, K/128])."""
    V.check_dtype("qr", qr, torch.bfloat16)
    V.check_rank("qr", qr, 2, "[T, K]")
    V.check_divisible("qr", qr, 1, V.BLOCK, "K (dim 1)")
    t, k = qr.shape
    x = qr.to(torch.float32).reshape(t, k // V.BLOCK, V.BLOCK)
    e = _block_scale_exponent(x, E4M3_MAX)
    a = cast_e4m3_sat(_scale_down(x, e)).reshape(t, k)
    return a, e.reshape(t, k // V.BLOCK)


def quantize_act_fp8(qr: torch.Tensor):
    """Step 1: (a_fp8 float8_e4m3fn [T, K], scale float32 [T, K/128] = 2^e)."""
    a, e = quantize_act_fp8_e(qr)
    return a, exp2_int(e).to(torch.float32)


def act_scale_ue8m0(qr: torch.Tensor) -> torch.Tensor:
    """Step 1's scale bytes e + 127, uint8 [T, K/128]."""
    _, e = quantize_act_fp8_e(qr)
    return (e + 127).to(torch.uint8)


def pack_ue8m0_mn_major(sf: torch.Tensor) -> torch.Tensor:
    """DeepGEMM's "MN-major TMA-aligned packed UE8M0" layout of a [MN, SF_K] scale.

    `sf`: uint8 UE8M0 bytes, or float32 powers of two (converted with scale_to_ue8m0).
    Four consecutive K-blocks go into one int32, little-endian (byte i of word j is
    K-block 4j + i; missing blocks at the end are 0). The result has shape
    [MN, ceil(SF_K / 4)], dtype int32, strides (1, MN_pad) with MN_pad = MN rounded up
    to a multiple of 4 (16 bytes), i.e. MN-major; the padding rows are 0."""
    if sf.dtype != torch.uint8:
        sf = scale_to_ue8m0(sf)
    V.check_rank("sf", sf, 2, "[MN, SF_K]")
    mn, sfk = sf.shape
    words = (sfk + 3) // 4
    mn_pad = (mn + 3) // 4 * 4
    padded = torch.zeros(mn, words * 4, dtype=torch.int64, device=sf.device)
    padded[:, :sfk] = sf.to(torch.int64)
    b = padded.reshape(mn, words, 4)
    packed = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    storage = torch.zeros(words, mn_pad, dtype=torch.int32, device=sf.device)
    storage[:, :mn] = packed.t()
    return storage.t()[:mn]            # shape [MN, words], strides (1, MN_pad)


# ----------------------------------------------------------------------------------
# step 2: block-scaled GEMM (float64, rounded to bf16 once)
# ----------------------------------------------------------------------------------
def block_scaled_gemm(a_fp8: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor,
                      weight_scale: torch.Tensor) -> torch.Tensor:
    """Step 2: q[t, n] = bf16(sum_b a_scale[t, b] * weight_scale[n/128, b] * (a_b . w_b)).

    Each 128-wide block's dot products are exact in float64 (e4m3 x e4m3 products need
    at most 43 bits); the blocks are summed in float64 in order b = 0, 1, ...; the sum
    is rounded to bf16 once. Returns bf16 [T, N]."""
    t, k = a_fp8.shape
    n = weight.shape[0]
    kb = k // V.BLOCK
    a = a_fp8.to(torch.float64).reshape(t, kb, V.BLOCK)
    w = weight.to(torch.float64).reshape(n, kb, V.BLOCK)
    sa = a_scale.to(torch.float64)                                        # [T, KB]
    sw = weight_scale.to(torch.float64).repeat_interleave(V.BLOCK, dim=0)  # [N, KB]
    acc = torch.zeros(t, n, dtype=torch.float64, device=a_fp8.device)
    for b in range(kb):
        acc = acc + (a[:, b, :] @ w[:, b, :].t()) * (sa[:, b:b + 1] * sw[:, b].unsqueeze(0))
    return round_f64_to_bf16(acc)


# ----------------------------------------------------------------------------------
# step 3: RoPE (GPT-J pairs on dims 64..127)
# ----------------------------------------------------------------------------------
def rope_cos_sin(positions: torch.Tensor, cos_sin: torch.Tensor):
    """(c, s) float32 [T, 32] for each token; c = 1, s = 0 where the position is outside
    [0, P) (that token is not rotated)."""
    p = cos_sin.shape[0]
    pos = positions.to(torch.int64)
    valid = (pos >= 0) & (pos < p)
    rows = cos_sin[torch.where(valid, pos, torch.zeros_like(pos))]
    v = valid.unsqueeze(1)
    c = torch.where(v, rows[:, :32], torch.ones_like(rows[:, :32]))
    s = torch.where(v, rows[:, 32:], torch.zeros_like(rows[:, 32:]))
    return c, s


def apply_rope(q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Step 3 on bf16 q [T, H, 128]: for i in 0..31, x = q[64+2i], y = q[65+2i] (fp32),
    q[64+2i] = bf16(x*c - y*s), q[65+2i] = bf16(x*s + y*c), every product rounded to fp32
    on its own (no FMA). Dims 0..63 unchanged. Out-of-range positions: c = 1, s = 0."""
    V.check_dtype("q", q, torch.bfloat16)
    V.check_rank("q", q, 3, "[T, H, 128]")
    V.check_dim("q", q, 2, V.HEAD_DIM, "head dim")
    c, s = rope_cos_sin(positions, cos_sin)
    c = c.unsqueeze(1)
    s = s.unsqueeze(1)                                   # [T, 1, 32]
    x = q[..., 64::2].to(torch.float32)
    y = q[..., 65::2].to(torch.float32)
    xc = x * c
    ys = y * s
    xs = x * s
    yc = y * c
    out = q.clone()
    out[..., 64::2] = (xc - ys).to(torch.bfloat16)
    out[..., 65::2] = (xs + yc).to(torch.bfloat16)
    return out


# ----------------------------------------------------------------------------------
# step 4: Hadamard-128
# ----------------------------------------------------------------------------------
# fp32(128 ** -0.5), rounded to nearest
HADAMARD_SCALE_F32 = struct.unpack("<f", struct.pack("<f", 128 ** -0.5))[0]


def hadamard_128(q: torch.Tensor) -> torch.Tensor:
    """Step 4 on bf16 q [..., 128], in this exact fp32 order (kernels do the same):

    1. x = fp32(q);
    2. fast Walsh-Hadamard transform, butterfly stages over index bit 0, then bit 1, ...,
       bit 6; the stage for bit b maps each pair (i, i | 1<<b) with bit b of i clear to
       (x[i] + x[i|1<<b], x[i] - x[i|1<<b]), each a single fp32 add;
    3. multiply by fp32(128 ** -0.5) (one rounded fp32 multiply);
    4. round to bf16.

    This is the Sylvester-ordered H[i][j] = (-1)^popcount(i & j), scaled to be orthonormal."""
    V.check_dtype("q", q, torch.bfloat16)
    V.check_dim("q", q, -1, V.HEAD_DIM, "head dim")
    lead = q.shape[:-1]
    x = q.to(torch.float32).reshape(-1, V.HEAD_DIM)
    for bit in range(7):
        h = 1 << bit
        xv = x.reshape(-1, V.HEAD_DIM // (2 * h), 2, h)
        lo = xv[:, :, 0, :]
        hi = xv[:, :, 1, :]
        x = torch.stack((lo + hi, lo - hi), dim=2).reshape(-1, V.HEAD_DIM)
    x = x * torch.tensor(HADAMARD_SCALE_F32, dtype=torch.float32, device=x.device)
    return x.to(torch.bfloat16).reshape(*lead, V.HEAD_DIM)


# ----------------------------------------------------------------------------------
# step 5: MXFP4
# ----------------------------------------------------------------------------------
def e2m1_codes(y_abs: torch.Tensor, rounding: str) -> torch.Tensor:
    """Magnitude codes 0..7 of float |y| (already scaled) under "floor-ties" or "rne"."""
    V.check_choice("fp4_rounding", rounding, V.FP4_ROUNDINGS)
    a = torch.clamp(y_abs, max=E2M1_MAX)
    code = torch.zeros(a.shape, dtype=torch.int32, device=a.device)
    for t in FP4_THRESHOLDS:
        if rounding == "rne" and t in FP4_RNE_TIES_UP:
            code += (a >= t).to(torch.int32)
        else:
            code += (a > t).to(torch.int32)
    return code


def pack_scale_bytes_le(e_bytes: torch.Tensor) -> torch.Tensor:
    """[..., 4] bytes (int) -> int32 [...], byte b at bits 8b..8b+7 (little-endian)."""
    b = e_bytes.to(torch.int64)
    v = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def quantize_mxfp4(q: torch.Tensor, rounding: str = "floor-ties"):
    """Step 5 on bf16 q [T, H, 128] -> (q_fp4 uint8 [T, H, 64], q_scale int32 [T, H]).

    Per 32-block: amax = max(max|q|, 1e-4), e = ceil_log2(fp32(amax / 6)), y = q * 2^-e,
    code by comparison (see e2m1_codes), sign bit 8 only when y < 0 and code != 0,
    byte j = code(2j) | code(2j+1) << 4; q_scale holds bytes e + 127, byte b for
    elements 32b..32b+31, little-endian."""
    V.check_dtype("q", q, torch.bfloat16)
    V.check_rank("q", q, 3, "[T, H, 128]")
    V.check_dim("q", q, 2, V.HEAD_DIM, "head dim")
    t, h, _ = q.shape
    x = q.to(torch.float32).reshape(t, h, 4, 32)
    e = _block_scale_exponent(x, E2M1_MAX)                 # [T, H, 4, 1]
    y = _scale_down(x, e)
    code = e2m1_codes(y.abs(), rounding)
    code = torch.where((y < 0) & (code != 0), code | 8, code).reshape(t, h, 64, 2)
    q_fp4 = (code[..., 0] | (code[..., 1] << 4)).to(torch.uint8)
    q_scale = pack_scale_bytes_le((e + 127).reshape(t, h, 4))
    return q_fp4, q_scale


def dequantize_fp4(q_fp4: torch.Tensor, q_scale: torch.Tensor) -> torch.Tensor:
    """(uint8 [T, H, 64], int32 [T, H]) -> float32 [T, H, 128]."""
    t, h, _ = q_fp4.shape
    b = q_fp4.to(torch.int32)
    codes = torch.stack((b & 0xF, (b >> 4) & 0xF), dim=-1).reshape(t, h, 128)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=q_fp4.device)
    mag = table[(codes & 7).long()]
    val = torch.where((codes & 8) != 0, -mag, mag)
    s = q_scale.to(torch.int64) & 0xFFFFFFFF
    e_bytes = torch.stack([(s >> (8 * i)) & 0xFF for i in range(4)], dim=-1)   # [T, H, 4]
    scale = ue8m0_to_scale(e_bytes).repeat_interleave(32, dim=-1)            # [T, H, 128]
    return val * scale


# ----------------------------------------------------------------------------------
# step 6: FP8 output formats
# ----------------------------------------------------------------------------------
def quantize_fp8_per_head(q: torch.Tensor):
    """out_format="fp8": per head (128 dims) amax = max(max|q|, 1e-4),
    e = ceil_log2(fp32(amax / 448)), q_fp8 = e4m3(q * 2^-e) (RNE, saturated).
    Returns (q_fp8 float8_e4m3fn [T, H, 128], q_scale float32 [T, H] = 2^e)."""
    V.check_dtype("q", q, torch.bfloat16)
    V.check_dim("q", q, -1, V.HEAD_DIM, "head dim")
    x = q.to(torch.float32)
    e = _block_scale_exponent(x, E4M3_MAX)
    q_fp8 = cast_e4m3_sat(_scale_down(x, e))
    return q_fp8, exp2_int(e.squeeze(-1)).to(torch.float32)


def quantize_fp8_unscaled(q: torch.Tensor) -> torch.Tensor:
    """out_format="fp8-unscaled": e4m3(q), RNE, saturated to +-448; no scale."""
    V.check_dtype("q", q, torch.bfloat16)
    return cast_e4m3_sat(q.to(torch.float32))


def empty_outputs(t: int, heads: int, out_format: str, device):
    """The (q, q_scale) of a call with T tokens (used for T == 0)."""
    if out_format == "bf16":
        return torch.empty(t, heads, V.HEAD_DIM, dtype=torch.bfloat16, device=device), None
    if out_format == "mxfp4":
        return (torch.empty(t, heads, 64, dtype=torch.uint8, device=device),
                torch.empty(t, heads, dtype=torch.int32, device=device))
    q = torch.empty(t, heads, V.HEAD_DIM, dtype=torch.float8_e4m3fn, device=device)
    if out_format == "fp8":
        return q, torch.empty(t, heads, dtype=torch.float32, device=device)
    return q, None


# ----------------------------------------------------------------------------------
# the whole op
# ----------------------------------------------------------------------------------
def fused_indexer_q(qr, weight, weight_scale, positions, cos_sin, *, hadamard=False,
                    fp4_rounding="floor-ties", out_format="mxfp4", validate=True, qr_scale=None):
    """The whole SPEC.md op composed of the step functions, on any device.
    validate=False skips the input checks (they read values back to the host, which a
    CUDA graph capture does not allow); the benchmark's torch peer uses it. qr_scale: qr
    is step 1's output already (float8_e4m3fn [T, K], qr_scale float32 [T, K/128]).

    Returns (q_fp4 uint8 [T, H, 64], q_scale int32 [T, H]) for "mxfp4",
    (q_fp8 [T, H, 128], q_scale float32 [T, H]) for "fp8",
    (q_fp8 [T, H, 128], None) for "fp8-unscaled",
    (q bf16 [T, H, 128], None) for "bf16" (steps 3-4's result, unquantized)."""
    if validate:
        V.check_problem(qr, weight, weight_scale, positions, cos_sin, hadamard=hadamard,
                        fp4_rounding=fp4_rounding, out_format=out_format, qr_scale=qr_scale)
    if qr.shape[0] == 0:
        return empty_outputs(0, weight.shape[0] // V.HEAD_DIM, out_format, qr.device)
    q = bf16_pipeline(qr, weight, weight_scale, positions, cos_sin, hadamard=hadamard, qr_scale=qr_scale)
    return output_format(q, out_format, fp4_rounding)


def output_format(q: torch.Tensor, out_format: str, fp4_rounding: str = "floor-ties"):
    """Steps 5-6: the bf16 q [T, H, 128] (after RoPE and the optional Hadamard) in
    `out_format`, as (q, q_scale) the way fused_indexer_q returns it."""
    if out_format == "mxfp4":
        return quantize_mxfp4(q, fp4_rounding)
    if out_format == "fp8":
        return quantize_fp8_per_head(q)
    if out_format == "bf16":
        return q, None
    return quantize_fp8_unscaled(q), None


def bf16_pipeline(qr, weight, weight_scale, positions, cos_sin, *, hadamard=False, qr_scale=None):
    """Steps 1-4 (2-4 where qr_scale says qr is step 1's output): the bf16 q [T, H, 128]
    that step 5/6 quantizes."""
    a, sa = quantize_act_fp8(qr) if qr_scale is None else (qr, qr_scale)
    q = block_scaled_gemm(a, sa, weight, weight_scale)
    q = q.reshape(q.shape[0], -1, V.HEAD_DIM)
    q = apply_rope(q, positions, cos_sin)
    return hadamard_128(q) if hadamard else q


def float64_pipeline(qr, weight, weight_scale, positions, cos_sin, *, hadamard=False):
    """What the op approximates, all in float64 with no quantization of qr or q:
    qr @ dequantized(weight)^T, RoPE, optional orthonormal Hadamard. float64 [T, H, 128]."""
    t, k = qr.shape
    n = weight.shape[0]
    w = weight.to(torch.float64) * weight_scale.to(torch.float64).repeat_interleave(
        V.BLOCK, 0).repeat_interleave(V.BLOCK, 1)
    q = (qr.to(torch.float64) @ w.t()).reshape(t, n // V.HEAD_DIM, V.HEAD_DIM)
    c, s = rope_cos_sin(positions, cos_sin)
    c = c.to(torch.float64).unsqueeze(1)
    s = s.to(torch.float64).unsqueeze(1)
    x, y = q[..., 64::2].clone(), q[..., 65::2].clone()
    q[..., 64::2] = x * c - y * s
    q[..., 65::2] = x * s + y * c
    if hadamard:
        idx = torch.arange(V.HEAD_DIM, device=q.device)
        pc = torch.zeros(V.HEAD_DIM, V.HEAD_DIM, dtype=torch.int64, device=q.device)
        anded = idx[:, None] & idx[None, :]
        for bit in range(7):
            pc += (anded >> bit) & 1
        hm = (1 - 2 * (pc % 2)).to(torch.float64) / math.sqrt(V.HEAD_DIM)
        q = q @ hm
    return q


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact|| / ||exact|| in float64."""
    d = approx.to(torch.float64) - exact.to(torch.float64)
    return float(d.norm() / exact.to(torch.float64).norm())
