"""An independent implementation of SPEC.md in numpy only (no torch, no indexer_q).

Everything is done by hand: bf16 rounding by uint32 bit manipulation, float64 -> bf16
by rint on the bf16 quantum, e4m3 encoding/decoding and RNE with saturation, ceil(log2)
through frexp, E2M1 codes by comparison, the GEMM in float64, the same FWHT order as the
contract fixes for step 4. Inputs and outputs are raw bits so nothing relies on torch's
casts:

    run(qr_bits uint16 [T,K], w_bits uint8 [N,K], w_scale float32 [N/128,K/128],
        positions int [T], cos_sin float32 [P,64], hadamard, fp4_rounding, out_format)
    -> ("mxfp4": (uint8 [T,H,64], int32 [T,H]); "fp8": (uint8 bits [T,H,128], float32 [T,H]);
        "fp8-unscaled": (uint8 bits [T,H,128], None))
"""
from __future__ import annotations

import numpy as np

F32 = np.float32


# ---------------------------------------------------------------- bf16
def bf16_bits_to_f32(bits):
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x):
    """RNE float32 -> bf16 bits (NaN kept quiet)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    lsb = (u >> 16) & 1
    r = ((u + 0x7FFF + lsb) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), r)


def round_f32_to_bf16(x):
    return bf16_bits_to_f32(f32_to_bf16_bits(x))


def round_f64_to_bf16(x):
    """float64 -> bf16 value (as float32), one RNE rounding on the bf16 quantum."""
    x = np.asarray(x, dtype=np.float64)
    _, e = np.frexp(x)                       # |x| in [2^(e-1), 2^e)
    qexp = np.maximum(e - 1 - 7, -133)       # bf16: 8 significant bits, min subnormal 2^-133
    quantum = np.ldexp(1.0, qexp)
    r = np.rint(x / quantum) * quantum
    bf16_max = np.float64((2 - 2 ** -7) * 2.0 ** 127)
    r = np.where(np.abs(r) > bf16_max, np.copysign(np.inf, x), r)
    return r.astype(np.float32)


# ---------------------------------------------------------------- e4m3
def e4m3_decode(bits):
    b = np.asarray(bits).astype(np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = b & 7
    val = np.where(exp == 0, man * 2.0 ** -9, (1 + man / 8.0) * np.ldexp(1.0, exp - 7))
    val = np.where((b & 0x7F) == 0x7F, np.nan, val)
    return sign * val


def e4m3_round(y):
    """Values of e4m3 RNE-saturated rounding of float y (float64 out, sign of zero kept)."""
    y = np.clip(np.asarray(y, dtype=np.float64), -448.0, 448.0)
    _, e = np.frexp(y)
    qexp = np.maximum(e - 1, -6) - 3
    quantum = np.ldexp(1.0, qexp)
    return np.rint(y / quantum) * quantum


def e4m3_encode(v):
    """Exact e4m3 values (float64, possibly -0) -> bits."""
    v = np.asarray(v, dtype=np.float64)
    sign = np.signbit(v).astype(np.int64) << 7
    a = np.abs(v)
    _, e = np.frexp(a)
    normal = a >= 2.0 ** -6
    exp_field = np.where(normal, e - 1 + 7, 0)
    man = np.where(normal, (a / np.ldexp(1.0, e - 1) - 1) * 8, a / 2.0 ** -9)
    bits = sign | (exp_field.astype(np.int64) << 3) | np.rint(man).astype(np.int64)
    bits = np.where(np.isnan(v), 0x7F, bits)
    return bits.astype(np.uint8)


# ---------------------------------------------------------------- scales
def ceil_log2(s):
    """ceil(log2(s)) for positive float32 s via frexp (NaN/Inf -> 128)."""
    s = np.asarray(s, dtype=np.float64)
    finite = np.isfinite(s)
    m, e = np.frexp(np.where(finite, s, 1.0))
    out = np.where(m == 0.5, e - 1, e)
    return np.where(finite, out, 128).astype(np.int64)


def block_exponent(x32, qmax):
    amax = np.max(np.abs(x32), axis=-1, keepdims=True).astype(np.float32)
    amax = np.where(np.isnan(amax), amax, np.maximum(amax, F32(1e-4)))
    s = (amax / F32(qmax)).astype(np.float32)
    return ceil_log2(s)


# ---------------------------------------------------------------- the steps
def step1(qr_bits):
    x = bf16_bits_to_f32(qr_bits).astype(np.float64)
    t, k = x.shape
    xb = x.reshape(t, k // 128, 128)
    e = block_exponent(xb.astype(np.float32), 448.0)
    a = e4m3_round(xb * np.ldexp(1.0, -e))
    return a.reshape(t, k), e[..., 0]


def step2(a, e_a, w_bits, w_scale):
    w = e4m3_decode(w_bits)
    n, k = w.shape
    t = a.shape[0]
    kb = k // 128
    acc = np.zeros((t, n), dtype=np.float64)
    for b in range(kb):
        part = a[:, b * 128:(b + 1) * 128] @ w[:, b * 128:(b + 1) * 128].T
        sw = np.repeat(w_scale[:, b].astype(np.float64), 128)
        acc = acc + part * (np.ldexp(1.0, e_a[:, b])[:, None] * sw[None, :])
    return round_f64_to_bf16(acc).reshape(t, n // 128, 128)


def step3(q, positions, cos_sin):
    p = cos_sin.shape[0]
    q = q.copy()
    pos = np.asarray(positions, dtype=np.int64)
    for t in range(q.shape[0]):
        if 0 <= pos[t] < p:
            c = cos_sin[pos[t], :32].astype(np.float32)
            s = cos_sin[pos[t], 32:].astype(np.float32)
        else:
            c = np.ones(32, dtype=np.float32)
            s = np.zeros(32, dtype=np.float32)
        x = q[t, :, 64::2].astype(np.float32)
        y = q[t, :, 65::2].astype(np.float32)
        nx = (x * c).astype(F32) - (y * s).astype(F32)
        ny = (x * s).astype(F32) + (y * c).astype(F32)
        q[t, :, 64::2] = round_f32_to_bf16(nx.astype(F32))
        q[t, :, 65::2] = round_f32_to_bf16(ny.astype(F32))
    return q


def step4(q):
    x = q.astype(np.float32).copy()
    for bit in range(7):
        h = 1 << bit
        new = x.copy()
        for i in range(128):
            if not i & h:
                a, b = x[..., i], x[..., i | h]
                new[..., i] = (a + b).astype(F32)
                new[..., i | h] = (a - b).astype(F32)
        x = new
    x = (x * F32(128 ** -0.5)).astype(F32)
    return round_f32_to_bf16(x)


def step5(q, rounding):
    t, h, _ = q.shape
    x = q.astype(np.float32).reshape(t, h, 4, 32)
    e = block_exponent(x, 6.0)
    y = x.astype(np.float64) * np.ldexp(1.0, -e)
    a = np.minimum(np.abs(y), 6.0)
    grid = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    # nearest grid point by comparison of distances; ties resolved per rounding mode
    d = np.abs(a[..., None] - grid)
    best = d.min(axis=-1, keepdims=True)
    cands = d == best
    if rounding == "floor-ties":
        code = np.argmax(cands, axis=-1)                       # lowest of tied codes
    else:
        even = cands & (np.arange(8) % 2 == 0)
        code = np.where(cands.sum(-1) > 1, np.argmax(even, axis=-1), np.argmax(cands, axis=-1))
    code = np.where(np.isnan(a), 0, code).astype(np.int64)
    code = np.where((y < 0) & (code != 0), code | 8, code).reshape(t, h, 64, 2)
    packed = (code[..., 0] | (code[..., 1] << 4)).astype(np.uint8)
    sbytes = (e.reshape(t, h, 4) + 127).astype(np.uint8)
    scale = np.ascontiguousarray(sbytes).view("<i4").reshape(t, h)
    return packed, scale.astype(np.int32)


def step6_fp8(q):
    x = q.astype(np.float32)
    e = block_exponent(x, 448.0)
    v = e4m3_round(x.astype(np.float64) * np.ldexp(1.0, -e))
    return e4m3_encode(v), np.ldexp(1.0, e[..., 0]).astype(np.float32)


def step6_fp8_unscaled(q):
    return e4m3_encode(e4m3_round(q.astype(np.float64)))


def run(qr_bits, w_bits, w_scale, positions, cos_sin, *, hadamard=False,
        fp4_rounding="floor-ties", out_format="mxfp4"):
    a, e_a = step1(qr_bits)
    q = step2(a, e_a, w_bits, np.asarray(w_scale, dtype=np.float32))
    q = step3(q, positions, np.asarray(cos_sin, dtype=np.float32))
    if hadamard:
        q = step4(q)
    if out_format == "mxfp4":
        return step5(q, fp4_rounding)
    if out_format == "fp8":
        return step6_fp8(q)
    return step6_fp8_unscaled(q), None
