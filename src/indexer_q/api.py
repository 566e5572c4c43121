"""The public API: prepare_weights, fused_indexer_q, quantize_act_fp8."""
from __future__ import annotations

from typing import Optional

import torch

from . import validate as V
from . import op  # noqa: F401  (registers torch.ops.indexer_q.fused_indexer_q for torch.compile)
from .arch import check_arch, detect_arch
from .constants import SCALED_FORMATS
from .checks import check_call  # noqa: F401  (also indexer_q.api.check_call, as before)
from .weights import IndexerQWeights, build_extras


def prepare_weights(weight, weight_scale, *, arch: Optional[str] = None) -> IndexerQWeights:
    """Validate the checkpoint's wq_b and its block scales once, at load time.

    weight: float8_e4m3fn [N, K], contiguous, N % 128 == 0, K % 128 == 0.
    weight_scale: float32 or float8_e8m0fnu [N/128, K/128], every entry a positive power
    of two (checked on the host: this synchronizes once).
    arch: the kernel arch the weights are for; default: detected from weight's device
    (None for CPU weights, which only the reference can use)."""
    n, k = V.check_weight(weight)
    V.check_weight_scale(weight_scale, n, k)
    V.check_same_device("weight_scale", weight_scale, "weight", weight)
    if arch is not None:
        arch = check_arch(arch)
    elif weight.device.type == "cuda":
        arch = detect_arch(weight.device)
    scale = weight_scale.to(torch.float32).contiguous()
    return IndexerQWeights(weight=weight, weight_scale=scale, n=n, k=k, heads=n // V.HEAD_DIM,
                           arch=arch, extras=build_extras(arch, weight, scale))


def fused_indexer_q(qr, weights: IndexerQWeights, positions, cos_sin, *, hadamard: bool = False,
                    fp4_rounding: str = "floor-ties", out_format: str = "mxfp4", tactic=None, qr_scale=None):
    """The fused op of SPEC.md on a CUDA GPU: FP8 activation quantization, block-scaled
    GEMM, RoPE, optional Hadamard, MXFP4 (or FP8) quantization, in one kernel.

    qr: bf16 [T, K]; or, with qr_scale, the activation already quantized by SPEC step 1:
    float8_e4m3fn [T, K] and qr_scale float32 [T, K/128], as quantize_act_fp8 returns them
    (an engine whose attention quantizes the same qr for its own wq_b GEMM can pass that
    copy; sm_90a only). The outputs are then those of the bf16 qr that quantizes to it.

    Returns (q_fp4 uint8 [T, H, 64], q_scale int32 [T, H]) for out_format="mxfp4",
    (q_fp8 float8_e4m3fn [T, H, 128], q_scale float32 [T, H]) for "fp8",
    (q_fp8, None) for "fp8-unscaled", (q bf16 [T, H, 128], None) for "bf16" (the kernel's
    bf16 GEMM result after RoPE and the optional Hadamard, unquantized). Raises
    InvalidInputError for bad inputs (including CPU tensors: the reference is
    indexer_q.reference.fused_indexer_q) and
    indexer_q.dispatch.KernelUnavailableError when no kernel is built for this
    arch/format; it never falls back to the reference."""
    from . import dispatch

    if tactic is not None and not _tactic_field(tactic, "epilogue", True):
        V.fail("tactic", "a tactic that writes the outputs (epilogue=False is a profiling probe: "
                         "tuning.bench runs it through indexer_q.dispatch.run_fused)", tactic)
    if torch.compiler.is_compiling():
        # Traced: through the custom op, whose fake impl gives torch.compile the output
        # shapes. Pointers and the device cannot be read while tracing, so the op checks
        # the call when it runs.
        q, q_scale = torch.ops.indexer_q.fused_indexer_q(
            qr, weights.weight.view(torch.uint8), weights.weight_scale, positions, cos_sin, hadamard,
            fp4_rounding, out_format, dispatch.tactic_json(tactic), weights.arch or "",
            weights.extras.get("sf_atoms"), qr_scale)
        return q, (q_scale if out_format in SCALED_FORMATS else None)
    # Eager (and CUDA graph capture): checked here, then launched directly. The custom
    # op's dispatch would add host time per call, and its first call imports torch's
    # compiler stack (seconds), which an eager caller never needs.
    t = check_call(qr, weights, positions, cos_sin, hadamard, fp4_rounding, out_format, qr_scale)
    if t == 0:
        from .reference import empty_outputs

        return empty_outputs(0, weights.heads, out_format, qr.device)
    return dispatch.run_fused(qr, weights, positions, cos_sin, hadamard=hadamard, fp4_rounding=fp4_rounding,
                              out_format=out_format, tactic=tactic, verified_only=False, qr_scale=qr_scale)


def _tactic_field(tactic, name, default):
    return tactic.get(name, default) if isinstance(tactic, dict) else getattr(tactic, name, default)


def quantize_act_fp8(qr):
    """SPEC step 1: (a_fp8 float8_e4m3fn [T, K], scale float32 [T, K/128] = 2^e).

    On CUDA it runs the CuTe DSL kernel (indexer_q.dispatch.run_act_quant); on the CPU it
    runs the reference step (step 1 alone is cheap and exact, so this is allowed here,
    unlike for fused_indexer_q)."""
    t, k = V.check_qr(qr)
    if qr.device.type != "cuda":
        from .reference import quantize_act_fp8 as ref

        return ref(qr)
    detect_arch(qr.device)
    V.check_aligned("qr", qr)
    if t == 0:
        return (torch.empty(0, k, dtype=torch.float8_e4m3fn, device=qr.device),
                torch.empty(0, k // V.BLOCK, dtype=torch.float32, device=qr.device))
    from . import dispatch

    return dispatch.run_act_quant(qr)
