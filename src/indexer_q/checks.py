"""check_call: the checks of a fused_indexer_q call, shared by the eager path (api.py)
and the torch custom op (op.py); a module of its own so that neither imports the other
(api imports op to register it)."""
from __future__ import annotations

from . import validate as V
from .arch import detect_arch


def check_call(qr, weights, positions, cos_sin, hadamard, fp4_rounding, out_format, qr_scale=None) -> int:
    """Every check of a fused_indexer_q call, before any launch; returns T."""
    from . import dispatch
    from .env import check_mode

    prob = V.check_kernel_inputs(qr, weights, positions, cos_sin, hadamard=hadamard,
                                 fp4_rounding=fp4_rounding, out_format=out_format,
                                 device_arch_fn=detect_arch, qr_scale=qr_scale)
    dispatch.check_available(weights.arch, out_format, quantized_input=qr_scale is not None)
    if check_mode():
        V.check_positions_in_range(positions, prob.p)
    return prob.t
