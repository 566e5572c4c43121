"""Power-of-two scales, their exponents and UE8M0 bytes, exactly from the float bits.

Torch only, below validate.py and reference.py: weights.py needs `scale_to_ue8m0` and
must not import the reference (reference -> validate -> weights). `indexer_q.reference`
re-exports these names.
"""
from __future__ import annotations

import torch


def ceil_log2_exact(x: torch.Tensor) -> torch.Tensor:
    """ceil(log2(x)) for positive normal float32 x, exactly, from the float's bits:
    exponent field - 127, plus one if the mantissa is non-zero. int32.

    The result is clamped to at most 128: NaN and Inf give 128, i.e. UE8M0 byte 0xFF."""
    bits = x.to(torch.float32).contiguous().view(torch.int32)
    exp_field = (bits >> 23) & 0xFF
    mant_nonzero = (bits & 0x7FFFFF) != 0
    e = exp_field - 127 + mant_nonzero.to(torch.int32)
    return torch.clamp(e, max=128).to(torch.int32)


def exp2_int(e: torch.Tensor) -> torch.Tensor:
    """2^e as float64, exactly, for integer e in [-1022, 1023] (built from the bits)."""
    bits = (e.to(torch.int64) + 1023) << 52
    return bits.view(torch.float64)


def scale_to_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """float32 power-of-two scales 2^e -> UE8M0 bytes e + 127 (uint8); inf -> 0xFF.

    Only for e >= -127: a subnormal scale (2^-128 .. 2^-149) has exponent field 0 and
    would come out as byte 0 (2^-127). validate.check_power_of_two_scales refuses those
    (prepare_weights, the reference); the activation's scales are 2^-22 or more."""
    bits = scale.to(torch.float32).contiguous().view(torch.int32)
    return ((bits >> 23) & 0xFF).to(torch.uint8)


def ue8m0_to_scale(ue8m0: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> float32 2^(byte - 127) (byte 0xFF -> inf here, not NaN)."""
    return exp2_int(ue8m0.to(torch.int32) - 127).to(torch.float32)
