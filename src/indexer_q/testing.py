"""Random realistic inputs and output comparisons, shared by the demo and the tests."""
from __future__ import annotations

import torch

# DeepSeek-V4 shapes: (K = q_lora_rank, N = 64 heads * 128)
V4_PRO = {"K": 1536, "N": 8192}
V4_FLASH = {"K": 1024, "N": 8192}


def rope_cos_sin_table(p: int, *, theta: float = 10000.0, rope_dim: int = 64, device="cpu"):
    """float32 [P, 64]: row p = [cos(p*f_0..f_31), sin(p*f_0..f_31)], f_i = theta^(-2i/64)."""
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim))
    ang = torch.arange(p, dtype=torch.float64)[:, None] * freqs[None, :]
    return torch.cat((ang.cos(), ang.sin()), dim=1).to(torch.float32).contiguous().to(device)


def make_inputs(t: int, n: int, k: int, *, p: int = 4096, seed: int = 0, device="cpu",
                positions_dtype=torch.int64):
    """Random inputs of the op: dict with qr, weight, weight_scale, positions, cos_sin.

    qr ~ randn (bf16); weight = e4m3(randn * 32) (saturated); weight_scale = 2^randint(-8, -4)
    per 128x128 block (float32); positions uniform in [0, P); cos_sin from RoPE
    frequencies (theta 10000, 32 frequencies)."""
    g = torch.Generator().manual_seed(seed)
    qr = torch.randn(t, k, generator=g).to(torch.bfloat16)
    weight = torch.clamp(torch.randn(n, k, generator=g) * 32, -448, 448).to(torch.float8_e4m3fn)
    exps = torch.randint(-8, -3, (n // 128, k // 128), generator=g)
    weight_scale = torch.pow(2.0, exps.to(torch.float64)).to(torch.float32)
    positions = torch.randint(0, p, (t,), generator=g).to(positions_dtype)
    cos_sin = rope_cos_sin_table(p)
    out = dict(qr=qr, weight=weight, weight_scale=weight_scale, positions=positions, cos_sin=cos_sin)
    return {name: x.to(device) for name, x in out.items()}


def fp4_signed_codes(q_fp4: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 64] packed E2M1 -> int32 [..., 128] signed code index in -7..7."""
    b = q_fp4.to(torch.int32)
    codes = torch.stack((b & 0xF, (b >> 4) & 0xF), dim=-1).flatten(-2)
    mag = codes & 7
    return torch.where((codes & 8) != 0, -mag, mag)


def scale_bytes(q_scale: torch.Tensor) -> torch.Tensor:
    """int32 [T, H] -> [T, H, 4] UE8M0 bytes (little-endian)."""
    s = q_scale.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(s >> (8 * i)) & 0xFF for i in range(4)], dim=-1)


def e4m3_ordinal(x: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> int32 ordered like the values (so differences count steps)."""
    b = x.view(torch.uint8).to(torch.int32)
    mag = b & 0x7F
    return torch.where((b & 0x80) != 0, -mag, mag)


def bf16_ordinal(x: torch.Tensor) -> torch.Tensor:
    """bfloat16 -> int32 ordered like the values (so differences count ulps; +0 and -0 are
    both 0)."""
    b = x.view(torch.int16).to(torch.int32) & 0xFFFF
    mag = b & 0x7FFF
    return torch.where((b & 0x8000) != 0, -mag, mag)


def compare_outputs(out_format: str, got, ref) -> dict:
    """Agreement of a kernel's (q, q_scale) with the reference's, on the kernel output's
    device (the reference's moved there): {"codes_equal": fraction, "scales_equal":
    fraction or None, "max_step": int}."""
    q, s = got
    rq, rs = ref
    rq = rq.to(q.device)
    rs = None if rs is None else rs.to(q.device)
    if out_format == "mxfp4":
        a, b = fp4_signed_codes(q), fp4_signed_codes(rq)
        scales_equal = (scale_bytes(s) == scale_bytes(rs)).double().mean().item()
    elif out_format == "bf16":  # "codes": bf16 values, steps in ulps
        a, b = bf16_ordinal(q), bf16_ordinal(rq)
        scales_equal = None
    else:
        a, b = e4m3_ordinal(q), e4m3_ordinal(rq)
        scales_equal = None if s is None else (s == rs).double().mean().item()
    if a.numel() == 0:
        return {"codes_equal": 1.0, "scales_equal": scales_equal, "max_step": 0}
    return {
        "codes_equal": (a == b).double().mean().item(),
        "scales_equal": scales_equal,
        "max_step": int((a - b).abs().max().item()),
    }
