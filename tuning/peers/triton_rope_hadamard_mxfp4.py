"""The strongest unfused peer's last stage: one Triton kernel for RoPE + Hadamard +
MXFP4 on the bf16 GEMM output (what tokenspeed runs after its GEMM).

Made to run at memory speed:
- q is read as 32-bit words, each one (even, odd) pair of bf16, so RoPE pairs and the
  MXFP4 nibble pairs come out of one contiguous load with no shuffling;
- the Hadamard runs on the tensor cores: every value it sees is exactly a bf16 (step 3
  rounds to bf16, dims 0..63 are the GEMM's bf16), the matrix entries are +-1, so
  bf16 dots with fp32 accumulation give SPEC step 4's sum. The matrix's rows are
  permuted to match the operands as loaded ([dims 0..63 | RoPE x | RoPE y]), three dots
  of one head's tokens against it, no butterfly shuffles;
- a program takes 64 tokens of one head (a loop over heads that loads the matrix once,
  and 32-bit stores of the packed codes, were slower on the H200).

Steps 3 and 5 are bit for bit the reference's (no FMA contraction, exact divisions).
Step 4's fp32 sum is the tensor core's, not the reference's butterfly order: the SPEC
fixes only "accumulated in fp32", and the two differ in the last fp32 bit of some sums,
which moves a bf16 result (and rarely a code) only at a rounding boundary.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

HADAMARD_SCALE = tl.constexpr(128.0 ** -0.5)  # a global a jitted function may read
BLOCK_T = 64  # tokens a program (the tensor core's M)


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
def _even(w):  # low bf16 of each word, as fp32
    return (w << 16).to(tl.float32, bitcast=True)


@triton.jit
def _odd(w):  # high bf16 of each word, as fp32
    return (w & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _codes(y, RNE: tl.constexpr):
    """E2M1 code (sign in bit 3) of y = q * 2^-e, SPEC step 5."""
    a = tl.minimum(tl.abs(y), 6.0)
    code = (a > 0.25).to(tl.int32) + (a > 1.25).to(tl.int32) + (a > 2.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    if RNE:
        code += (a >= 0.75).to(tl.int32) + (a >= 1.75).to(tl.int32) + (a >= 3.5).to(tl.int32)
    else:
        code += (a > 0.75).to(tl.int32) + (a > 1.75).to(tl.int32) + (a > 3.5).to(tl.int32)
    return tl.where((y < 0) & (code != 0), code | 8, code)


@triton.jit
def _mxfp4_store(ev, od, out_ptr, scale_ptr, rows, row_ok, N, head, BLOCK_T: tl.constexpr, RNE: tl.constexpr):
    """MXFP4 of one head given its even and odd elements [BLOCK_T, 64] (pair j = elements
    2j, 2j + 1): stores the 64 packed bytes and the scale word of each row."""
    amax = tl.maximum(tl.max(tl.reshape(tl.abs(ev), (BLOCK_T, 4, 16)), axis=2),
                      tl.max(tl.reshape(tl.abs(od), (BLOCK_T, 4, 16)), axis=2))
    e = _ceil_log2(tl.math.div_rn(tl.maximum(amax, 1e-4), 6.0))  # [BLOCK_T, 4]
    inv = tl.reshape(tl.broadcast_to(((127 - e) << 23).to(tl.float32, bitcast=True)[:, :, None],
                                     (BLOCK_T, 4, 16)), (BLOCK_T, 64))
    packed = (_codes(ev * inv, RNE) | (_codes(od * inv, RNE) << 4)).to(tl.uint8)
    j = tl.arange(0, 64)
    tl.store(out_ptr + rows[:, None] * (N // 2) + head * 64 + j[None, :], packed, mask=row_ok[:, None])
    shifts = tl.arange(0, 4) * 8
    word = tl.sum(((e + 127) & 0xFF) << shifts[None, :], axis=1)
    tl.store(scale_ptr + rows * (N // 128) + head, word, mask=row_ok)


@triton.jit
def _dot(a, b, acc, DOT: tl.constexpr):
    if DOT == tl.float32:  # Triton's CPU interpreter multiplies bf16 wrongly
        return tl.dot(a, b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def rope_hadamard_mxfp4_kernel(
    q_ptr, pos_ptr, cs_ptr, hs_ptr, out_ptr, scale_ptr, T, N, P,
    HADAMARD: tl.constexpr, RNE: tl.constexpr, BLOCK_T: tl.constexpr, DOT: tl.constexpr,
):
    head = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    w_ptr = q_ptr.to(tl.pointer_type(tl.int32), bitcast=True)  # bf16 pairs as words
    pos = tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    pos_ok = (pos >= 0) & (pos < P)  # outside [0, P): RoPE is the identity
    cs_row = cs_ptr + tl.where(pos_ok, pos, 0)[:, None] * 64
    if HADAMARD:
        # Operands, all exactly bf16: dims 0..63 as loaded, then the rotated pairs.
        k64 = tl.arange(0, 64)
        p = tl.arange(0, 32)
        x_lo = tl.load(q_ptr + rows[:, None] * N + head * 128 + k64[None, :], mask=row_ok[:, None], other=0.0)
        w = tl.load(w_ptr + rows[:, None] * (N // 2) + head * 64 + 32 + p[None, :], mask=row_ok[:, None], other=0)
        use = row_ok[:, None] & pos_ok[:, None]
        c = tl.load(cs_row + p[None, :], mask=use, other=1.0)
        s = tl.load(cs_row + 32 + p[None, :], mask=use, other=0.0)
        x = (w << 16).to(tl.float32, bitcast=True)  # dim 64 + 2p
        y = (w & -65536).to(tl.float32, bitcast=True)  # dim 65 + 2p
        nx = _round_bf16(x * c - y * s)
        ny = _round_bf16(x * s + y * c)
        # The matrix's rows in the operands' order: 0..63, RoPE x (64 + 2p), RoPE y (65 + 2p).
        n = tl.arange(0, 128)
        acc = _dot(x_lo.to(DOT), tl.load(hs_ptr + k64[:, None] * 128 + n[None, :]),
                   tl.zeros((BLOCK_T, 128), tl.float32), DOT)
        acc = _dot(nx.to(DOT), tl.load(hs_ptr + (64 + p[:, None]) * 128 + n[None, :]), acc, DOT)
        acc = _dot(ny.to(DOT), tl.load(hs_ptr + (96 + p[:, None]) * 128 + n[None, :]), acc, DOT)
        ev, od = tl.split(tl.reshape(_round_bf16(acc * HADAMARD_SCALE), (BLOCK_T, 64, 2)))
    else:
        j = tl.arange(0, 64)  # word j = dims (2j, 2j + 1); words 32.. are RoPE pair j - 32
        rope = j[None, :] >= 32
        w = tl.load(w_ptr + rows[:, None] * (N // 2) + head * 64 + j[None, :], mask=row_ok[:, None], other=0)
        use = row_ok[:, None] & pos_ok[:, None] & rope
        c = tl.load(cs_row + (j[None, :] - 32), mask=use, other=1.0)
        s = tl.load(cs_row + j[None, :], mask=use, other=0.0)  # column 32 + (j - 32)
        c = tl.where(use, c, 1.0)
        s = tl.where(use, s, 0.0)
        x = (w << 16).to(tl.float32, bitcast=True)
        y = (w & -65536).to(tl.float32, bitcast=True)
        ev = tl.where(rope, _round_bf16(x * c - y * s), x)
        od = tl.where(rope, _round_bf16(x * s + y * c), y)
    _mxfp4_store(ev, od, out_ptr, scale_ptr, rows, row_ok, N, head, BLOCK_T, RNE)


_HADAMARD_CACHE: dict = {}


def permuted_hadamard(device) -> torch.Tensor:
    """bf16 [128, 128] Sylvester Hadamard (+-1), rows in the order the kernel feeds them:
    dims 0..63, then 64, 66, .., 126 (RoPE x), then 65, 67, .., 127 (RoPE y)."""
    key = str(device)
    if key not in _HADAMARD_CACHE:
        i = torch.arange(128)
        bits = i[:, None] & i[None, :]
        parity = torch.zeros_like(bits)
        for b in range(7):
            parity ^= (bits >> b) & 1
        h = 1.0 - 2.0 * parity.to(torch.float32)
        rows = torch.cat([torch.arange(64), torch.arange(64, 128, 2), torch.arange(65, 128, 2)])
        _HADAMARD_CACHE[key] = h[rows].contiguous().to(device=device, dtype=torch.bfloat16)
    return _HADAMARD_CACHE[key]


def rope_hadamard_mxfp4(q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, *,
                        hadamard: bool, fp4_rounding: str = "floor-ties"):
    """q: bf16 [T, N] (the GEMM output) -> (q_fp4 uint8 [T, H, 64], q_scale int32 [T, H])."""
    t, n = q.shape
    heads = n // 128
    out = torch.empty(t, heads, 64, dtype=torch.uint8, device=q.device)
    scale = torch.empty(t, heads, dtype=torch.int32, device=q.device)
    # Timed on the H200 (64 tokens a program; 1, 2 or 8 heads; 32-bit or byte stores):
    # 8 warps are fastest for the few programs of decode, 4 from a few thousand tokens.
    rope_hadamard_mxfp4_kernel[(heads, triton.cdiv(t, BLOCK_T))](
        q, positions, cos_sin, permuted_hadamard(q.device), out, scale, t, n, cos_sin.shape[0],
        HADAMARD=hadamard, RNE=fp4_rounding == "rne", BLOCK_T=BLOCK_T,
        DOT=tl.float32 if q.device.type == "cpu" else tl.bfloat16,
        num_warps=8 if t <= 1024 else 4,
        enable_fp_fusion=False,  # the SPEC rounds every product on its own
    )
    return out, scale
