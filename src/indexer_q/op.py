"""`torch.ops.indexer_q.fused_indexer_q`: the fused op as a torch custom op, so it runs
under torch.compile (fake implementation below) and CUDA graphs (it only launches).

Importing this module registers the op (indexer_q.api does). `fused_indexer_q` goes
through it while torch.compile traces; eager calls launch directly (see api.py). The op
validates the call when it runs, as an eager call does before its launch.
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
    arch: str,
    weight_sf_atoms: torch.Tensor | None = None,
    qr_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, q_scale); for out_format="fp8-unscaled" and "bf16" q_scale is an empty
    placeholder that the api turns into None. `tactic` is a Tactic as JSON, or "" for the default choice;
    `arch` is IndexerQWeights.arch (the arch the weights were prepared for);
    `weight_sf_atoms` is the sm_100a kernel's weight scale layout (IndexerQWeights.extras);
    `qr_scale`: qr is quantized already (see indexer_q.fused_indexer_q).
    The FP8 weight travels as its uint8 bytes: torch's own op checks (opcheck's schema
    test) compare inputs with allclose, which has no float8 kernel."""
    from . import dispatch
    from .checks import check_call
    from .validate import check_dtype
    from .weights import IndexerQWeights

    check_dtype("weight_bytes", weight_bytes, torch.uint8)
    weight = weight_bytes.view(torch.float8_e4m3fn)
    weights = IndexerQWeights(weight=weight, weight_scale=weight_scale, n=weight.shape[0],
                              k=weight.shape[1], heads=weight.shape[0] // 128, arch=arch or None,
                              extras={} if weight_sf_atoms is None else {"sf_atoms": weight_sf_atoms})
    # Every check of an eager call, when the op runs (the api cannot read pointers or
    # the device while torch.compile traces).
    if check_call(qr, weights, positions, cos_sin, hadamard, fp4_rounding, out_format, qr_scale) == 0:
        q, q_scale = empty_outputs(0, weights.heads, out_format, qr.device)
        return q, (q_scale if q_scale is not None else torch.empty(0, dtype=torch.float32, device=qr.device))
    q, q_scale = dispatch.run_fused(qr, weights, positions, cos_sin, hadamard=hadamard,
                                    fp4_rounding=fp4_rounding, out_format=out_format,
                                    tactic=json.loads(tactic) if tactic else None,
                                    verified_only=False,  # check_call checked availability
                                    qr_scale=qr_scale)
    if q_scale is None:
        q_scale = torch.empty(0, dtype=torch.float32, device=q.device)
    return q, q_scale


@fused_indexer_q_op.register_fake
def _(qr, weight_bytes, weight_scale, positions, cos_sin, hadamard, fp4_rounding, out_format, tactic, arch,
      weight_sf_atoms=None, qr_scale=None):
    from .validate import check_options

    check_options(hadamard, fp4_rounding, out_format)  # what tracing can check: options, shapes
    q, q_scale = empty_outputs(qr.shape[0], weight_bytes.shape[0] // 128, out_format, qr.device)
    if q_scale is None:
        q_scale = qr.new_empty(0, dtype=torch.float32)
    return q, q_scale
