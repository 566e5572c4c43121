"""IndexerQWeights: the checkpoint's wq_b and its block scales, converted once at load time.

Per-arch kernel layouts (e.g. the Blackwell kernel's replicated 128x4 scale-factor
layout) go into ``extras`` through a builder registered in ``LAYOUT_BUILDERS`` for that
arch, so a new arch adds one function here and nothing else changes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch

from .scales import scale_to_ue8m0

# arch -> fn(weight fp8 [N, K], weight_scale fp32 [N/128, K/128]) -> dict of extra tensors
LAYOUT_BUILDERS: Dict[str, Callable[[torch.Tensor, torch.Tensor], dict]] = {}


def sf_atom_layout(scale_128: torch.Tensor, rows: int) -> torch.Tensor:
    """UE8M0 bytes of 128-wide K-block scales, replicated per 32 K into tcgen05's 128x4
    scale-factor atom layout, flat uint8: [rows/128][K/128][row % 32][(row // 32) % 4][4].

    `scale_128`: float32 powers of two [R, K/128] with R = rows (one scale a row) or
    R = rows / 128 (one per 128-row block, the weight's). Rows are padded to 128 (zeros)."""
    e = scale_to_ue8m0(scale_128)
    if e.shape[0] * 128 == rows:  # one scale per 128 rows: repeat it down its block
        e = e.repeat_interleave(128, dim=0)
    pad = (-e.shape[0]) % 128
    if pad:
        e = torch.cat([e, e.new_zeros(pad, e.shape[1])])
    r, kb = e.shape
    # [r/128, 4 (m1), 32 (m0), kb] -> [r/128, kb, m0, m1] and 4 copies along the atom's K
    atoms = e.view(r // 128, 4, 32, kb).permute(0, 3, 2, 1)
    return atoms.unsqueeze(-1).expand(-1, -1, -1, -1, 4).contiguous().view(-1)


def _sm100_layouts(weight: torch.Tensor, weight_scale: torch.Tensor) -> dict:
    return {"sf_atoms": sf_atom_layout(weight_scale, weight.shape[0])}


LAYOUT_BUILDERS["sm_100a"] = _sm100_layouts


def build_extras(arch: Optional[str], weight: torch.Tensor, weight_scale: torch.Tensor) -> dict:
    builder = LAYOUT_BUILDERS.get(arch) if arch is not None else None
    return dict(builder(weight, weight_scale)) if builder is not None else {}


@dataclass(frozen=True, eq=False)
class IndexerQWeights:
    """What the kernels read. Build it with ``indexer_q.prepare_weights``.

    weight:        float8_e4m3fn [N, K], contiguous (K-major), as in the checkpoint
    weight_scale:  float32 [N/128, K/128], contiguous, powers of two
    n, k, heads:   N, K and H = N // 128
    arch:          "sm_90a" / "sm_100a" for CUDA weights, None for CPU weights
    extras:        per-arch layouts derived from the above (empty for now)
    """

    weight: torch.Tensor
    weight_scale: torch.Tensor
    n: int
    k: int
    heads: int
    arch: Optional[str]
    extras: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.weight.device
