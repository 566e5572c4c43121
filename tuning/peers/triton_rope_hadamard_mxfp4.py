"""The strongest unfused peer's last stage: one Triton kernel for RoPE + Hadamard +
MXFP4 on the bf16 GEMM output (what tokenspeed runs after its GEMM).

It computes SPEC steps 3-5 bit for bit like indexer_q.reference (same fp32 butterfly
order, no FMA contraction, exact divisions), so the benchmark compares equal work.
Each program takes BLOCK_T tokens of one head: a [BLOCK_T, 128] tile in registers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

HADAMARD_SCALE = tl.constexpr(128.0 ** -0.5)  # a global a jitted function may read


@triton.jit
def _butterfly(x, BLOCK_T: tl.constexpr, H: tl.constexpr):
    # pairs (i, i + H) with bit H of i clear -> (a + b, a - b)
    x = tl.reshape(x, (BLOCK_T, 64 // H, 2, H))
    x = tl.permute(x, (0, 1, 3, 2))
    a, b = tl.split(x)
    x = tl.join(a + b, a - b)
    x = tl.permute(x, (0, 1, 3, 2))
    return tl.reshape(x, (BLOCK_T, 128))


@triton.jit
def _round_bf16(x):
    # fp32 -> bf16 (round to nearest even) -> fp32 in integer ops: exact on every backend
    # (Triton's interpreter, which the CPU tests use, does not round casts to bf16).
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _ceil_log2(x):
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return tl.minimum(e, 128)


@triton.jit
def rope_hadamard_mxfp4_kernel(
    q_ptr, pos_ptr, cs_ptr, out_ptr, scale_ptr, T, N, P,
    HADAMARD: tl.constexpr, RNE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    pid_t = tl.program_id(0)
    head = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    cols = tl.arange(0, 128)
    x = tl.load(q_ptr + rows[:, None] * N + head * 128 + cols[None, :], mask=row_ok[:, None], other=0.0)
    x = x.to(tl.float32)

    # RoPE on the last 64 dims, interleaved pairs; identity for positions outside [0, P)
    pos = tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    pos_ok = (pos >= 0) & (pos < P)
    safe = tl.where(pos_ok, pos, 0)
    pair = tl.arange(0, 32)
    c = tl.load(cs_ptr + safe[:, None] * 64 + pair[None, :], mask=row_ok[:, None], other=1.0)
    s = tl.load(cs_ptr + safe[:, None] * 64 + 32 + pair[None, :], mask=row_ok[:, None], other=0.0)
    c = tl.where(pos_ok[:, None], c, 1.0)
    s = tl.where(pos_ok[:, None], s, 0.0)
    halves = tl.reshape(x, (BLOCK_T, 2, 64))
    halves = tl.permute(halves, (0, 2, 1))
    first, rope = tl.split(halves)  # [T, 64] each
    xy = tl.reshape(rope, (BLOCK_T, 32, 2))
    rx, ry = tl.split(xy)
    nx = _round_bf16(rx * c - ry * s)
    ny = _round_bf16(rx * s + ry * c)
    rope = tl.reshape(tl.join(nx, ny), (BLOCK_T, 64))
    x = tl.reshape(tl.permute(tl.join(first, rope), (0, 2, 1)), (BLOCK_T, 128))

    if HADAMARD:
        x = _butterfly(x, BLOCK_T, 1)
        x = _butterfly(x, BLOCK_T, 2)
        x = _butterfly(x, BLOCK_T, 4)
        x = _butterfly(x, BLOCK_T, 8)
        x = _butterfly(x, BLOCK_T, 16)
        x = _butterfly(x, BLOCK_T, 32)
        x = _butterfly(x, BLOCK_T, 64)
        x = _round_bf16(x * HADAMARD_SCALE)

    # MXFP4: 4 blocks of 32 per head
    xb = tl.reshape(x, (BLOCK_T, 4, 32))
    amax = tl.maximum(tl.max(tl.abs(xb), axis=2), 1e-4)
    e = _ceil_log2(tl.math.div_rn(amax, 6.0))
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    y = xb * inv[:, :, None]
    a = tl.minimum(tl.abs(y), 6.0)
    code = (a > 0.25).to(tl.int32) + (a > 1.25).to(tl.int32) + (a > 2.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    if RNE:
        code += (a >= 0.75).to(tl.int32) + (a >= 1.75).to(tl.int32) + (a >= 3.5).to(tl.int32)
    else:
        code += (a > 0.75).to(tl.int32) + (a > 1.75).to(tl.int32) + (a > 3.5).to(tl.int32)
    code = tl.where((y < 0) & (code != 0), code | 8, code)
    code = tl.reshape(code, (BLOCK_T, 64, 2))
    lo, hi = tl.split(code)
    packed = (lo | (hi << 4)).to(tl.uint8)
    bcols = tl.arange(0, 64)
    tl.store(out_ptr + rows[:, None] * (N // 2) + head * 64 + bcols[None, :], packed, mask=row_ok[:, None])
    shifts = tl.arange(0, 4) * 8
    word = tl.sum(((e + 127) & 0xFF) << shifts[None, :], axis=1)
    tl.store(scale_ptr + rows * (N // 128) + head, word, mask=row_ok)


def rope_hadamard_mxfp4(q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, *,
                        hadamard: bool, fp4_rounding: str = "floor-ties", block_t: int = 16):
    """q: bf16 [T, N] (the GEMM output) -> (q_fp4 uint8 [T, H, 64], q_scale int32 [T, H])."""
    t, n = q.shape
    out = torch.empty(t, n // 128, 64, dtype=torch.uint8, device=q.device)
    scale = torch.empty(t, n // 128, dtype=torch.int32, device=q.device)
    grid = (triton.cdiv(t, block_t), n // 128)
    rope_hadamard_mxfp4_kernel[grid](
        q, positions, cos_sin, out, scale, t, n, cos_sin.shape[0],
        HADAMARD=hadamard, RNE=fp4_rounding == "rne", BLOCK_T=block_t,
        enable_fp_fusion=False,  # the SPEC rounds every product on its own
    )
    return out, scale
