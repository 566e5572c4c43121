"""IndexerQWeights: the checkpoint's wq_b and its block scales, converted once at load time.

Per-arch kernel layouts (e.g. the Blackwell kernel's replicated 128x4 scale-factor
layout) go into ``extras`` through a builder registered in ``LAYOUT_BUILDERS`` for that
arch, so a new arch adds one function here and nothing else changes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch

# arch -> fn(weight fp8 [N, K], weight_scale fp32 [N/128, K/128]) -> dict of extra tensors
LAYOUT_BUILDERS: Dict[str, Callable[[torch.Tensor, torch.Tensor], dict]] = {}


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
