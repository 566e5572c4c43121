"""`torch.ops.indexer_q.fused_indexer_q`: the fused op as a torch custom op, so it runs
under torch.compile (fake implementation below) and CUDA graphs (it only launches).

Importing this module registers the op (indexer_q.api does). `fused_indexer_q` goes
through it while torch.compile traces; eager calls launch directly (see api.py). With
checked=False the op validates the call itself when it runs.
"""
from __future__ import annotations

import json

import torch

from .reference import empty_outputs


@torch.library.custom_op("indexer_q::fused_indexer_q", mutates_args=(), device_types="cuda")
def fused_indexer_q_op(
    qr: torch.Tensor,
    weight_bytes: torch.Tensor,
    weight_scale: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    hadamard: bool,
    fp4_rounding: str,
    out_format: str,
    tactic: str,
    checked: bool,
    weight_sf_atoms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, q_scale); for out_format="fp8-unscaled" q_scale is an empty placeholder that
    the api turns into None. `tactic` is a Tactic as JSON, or "" for the default choice;
    `checked` says the api already validated the call (False inside compiled graphs);
    `weight_sf_atoms` is the sm_100a kernel's weight scale layout (IndexerQWeights.extras).
    The FP8 weight travels as its uint8 bytes: torch's own op checks (opcheck's schema
    test) compare inputs with allclose, which has no float8 kernel."""
    from . import dispatch
    from .arch import detect_arch
    from .weights import IndexerQWeights

    weight = weight_bytes.view(torch.float8_e4m3fn)
    weights = IndexerQWeights(weight=weight, weight_scale=weight_scale, n=weight.shape[0],
                              k=weight.shape[1], heads=weight.shape[0] // 128,
                              arch=detect_arch(weight.device),
                              extras={} if weight_sf_atoms is None else {"sf_atoms": weight_sf_atoms})
    if not checked:
        from .api import check_call

        if check_call(qr, weights, positions, cos_sin, hadamard, fp4_rounding, out_format) == 0:
            q, q_scale = empty_outputs(0, weights.heads, out_format, qr.device)
            return q, (q_scale if q_scale is not None else torch.empty(0, device=qr.device))
    q, q_scale = dispatch.run_fused(qr, weights, positions, cos_sin, hadamard=hadamard,
                                    fp4_rounding=fp4_rounding, out_format=out_format,
                                    tactic=json.loads(tactic) if tactic else None,
                                    verified_only=False)  # the api checked availability
    if q_scale is None:
        q_scale = torch.empty(0, dtype=torch.float32, device=q.device)
    return q, q_scale


@fused_indexer_q_op.register_fake
def _(qr, weight_bytes, weight_scale, positions, cos_sin, hadamard, fp4_rounding, out_format, tactic, checked,
      weight_sf_atoms=None):
    q, q_scale = empty_outputs(qr.shape[0], weight_bytes.shape[0] // 128, out_format, qr.device)
    if q_scale is None:
        q_scale = qr.new_empty(0, dtype=torch.float32)
    return q, q_scale
