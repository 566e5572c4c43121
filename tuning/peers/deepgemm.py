"""DeepGEMM (deepseek-ai/DeepGEMM; on the GPU machine SGLang's tvm-ffi build, importable as
`deep_gemm`) as a benchmark peer of `indexer-q bench`. A peer only: the package (src/,
kernels/) never imports it, and this module imports it only when `load()` is called, so
`tuning.bench` and the CPU tests run where it is not installed.

Its SM90 FP8 GEMM with the SPEC's scales is
  deep_gemm.fp8_gemm_nt((a_fp8, a_scale), (w_fp8, w_scale), out_bf16, compiled_dims="nk")
with a_fp8 float8_e4m3fn [M, K], w_fp8 float8_e4m3fn [N, K] (both K-major), w_scale float32
[N/128, K/128] (128x128 blocks, contiguous), out_bf16 a preallocated bf16 [M, N] and a_scale
float32 [M, K/128] (1x128 blocks) stored MN-major with M padded to a multiple of 4 (16
bytes, TMA's alignment): strides (1, align4(M)). Given a scale in any other layout it makes
that copy itself on every call (its own transpose kernel); `mn_major_scale` builds it here.
The default recipe on SM90 is (1, 128, 128), the SPEC's. "nk": N and K are compiled into
the kernel, M is a runtime argument; a kernel is JIT-compiled (nvcc) on its first call for
each configuration its heuristic picks, so the first call must stay out of any timing.

It takes any M, 1, 2, 3 included (DeepGEMM's own tests run M = 1): TMA fills the rows past
M with zeros and clips the stores, and the scale's padding columns are only ever read for
those rows. So, unlike cuBLAS here, it runs on the real M, never on padded inputs.
"""
from __future__ import annotations

import torch

SF_MN_ALIGN = 4  # 16 bytes of float32: TMA's stride alignment, DeepGEMM's get_tma_aligned_size

_loaded: dict = {}


def align_mn(m: int) -> int:
    """M rounded up to the scale layout's multiple (4)."""
    return -(-m // SF_MN_ALIGN) * SF_MN_ALIGN


def mn_major_scale(sa: torch.Tensor) -> torch.Tensor:
    """The activation scale float32 [M, K/128] (any strides) as DeepGEMM's SM90 GEMM reads
    it: same shape and values, strides (1, align4(M)), i.e. a [K/128, align4(M)] buffer
    viewed transposed. Two torch ops: an empty buffer and one copy into its first M columns;
    the padding columns stay uninitialized, as in DeepGEMM's own relayout (only rows past M,
    whose outputs are never stored, read them)."""
    m, kb = sa.shape
    buf = torch.empty(kb, align_mn(m), dtype=sa.dtype, device=sa.device)
    view = buf.t()[:m]
    view.copy_(sa)
    return view


def load():
    """The `deep_gemm` module, imported once per process. Raises ImportError with the reason
    when it cannot be imported (not installed, or a build that does not load against this
    torch: it then fails with `dim == 2 or dim == 3`); the reason is remembered, so later
    calls fail the same way without trying again (a failed import may try to build)."""
    if "module" not in _loaded:
        try:
            import deep_gemm
        except Exception as exc:  # ImportError, OSError from the library, or its own asserts
            _loaded["module"] = None
            _loaded["error"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        else:
            _loaded["module"] = deep_gemm
    if _loaded["module"] is None:
        raise ImportError(_loaded["error"])
    return _loaded["module"]


def version() -> str:
    """deep_gemm's version string, or "none (<why>)" where it does not import."""
    try:
        return str(getattr(load(), "__version__", "unknown"))
    except ImportError as exc:
        return f"none ({str(exc)[:80]})"


def gemm_args(x, a, sa) -> dict:
    """Operands of `run_gemm` for the problem `x` whose activations are already quantized
    (a, sa = indexer_q.quantize_act_fp8(x["qr"])): the scale laid out and the bf16 output
    allocated once, outside any timing."""
    m, n = a.shape[0], x["weight"].shape[0]
    return dict(a=a, sa=mn_major_scale(sa), w=x["weight"], sw=x["weight_scale"],
                out=torch.empty(m, n, dtype=torch.bfloat16, device=a.device))


def run_gemm(c: dict) -> torch.Tensor:
    """DeepGEMM's GEMM alone on `gemm_args` operands; returns the bf16 [M, N] output."""
    load().fp8_gemm_nt((c["a"], c["sa"]), (c["w"], c["sw"]), c["out"], compiled_dims="nk")
    return c["out"]


def gemm(a, sa, w, sw) -> torch.Tensor:
    """a [M, K] e4m3 with its scale [M, K/128] (our quantizer's layout) times w [N, K] with
    sw [N/128, K/128]: bf16 [M, N]. The per-call work of a chain that feeds DeepGEMM from our
    quantizer: the scale's relayout, the output's allocation (as torch._scaled_mm allocates
    in the cuBLAS chain) and the GEMM."""
    out = torch.empty(a.shape[0], w.shape[0], dtype=torch.bfloat16, device=a.device)
    load().fp8_gemm_nt((a, mn_major_scale(sa)), (w, sw), out, compiled_dims="nk")
    return out


def chain(x, *, hadamard, fp4_rounding="floor-ties"):
    """The unfused chain with DeepGEMM for cuBLAS: our activation quantizer, the scale
    relayout, DeepGEMM's GEMM, the Triton RoPE + Hadamard + MXFP4 kernel. Returns
    (q_fp4, q_scale) like the fused op with out_format "mxfp4"."""
    import indexer_q
    from tuning.peers.triton_rope_hadamard_mxfp4 import rope_hadamard_mxfp4

    a, sa = indexer_q.quantize_act_fp8(x["qr"])
    q = gemm(a, sa, x["weight"], x["weight_scale"])
    return rope_hadamard_mxfp4(q, x["positions"], x["cos_sin"], hadamard=hadamard, fp4_rounding=fp4_rounding)


def set_pdl(enabled: bool) -> bool:
    """Launch DeepGEMM's kernels with programmatic dependent launch (its kernels wait with
    cudaGridDependencySynchronize before any load); False where this build cannot."""
    fn = getattr(getattr(load(), "_C", None), "set_pdl", None)
    if fn is None:
        return False
    fn(bool(enabled))
    return True


def run_gemm_pdl(args, pdl: bool):
    """run_gemm with DeepGEMM's PDL setting on or off for this launch (a graph capture
    records it), restored to off after."""
    set_pdl(pdl)
    try:
        return run_gemm(args)
    finally:
        set_pdl(False)


def main(argv=None) -> None:
    """`python -m tuning.peers.deepgemm M N K [CALLS]`: DeepGEMM's GEMM on random
    operands (quantized by our quantizer), CALLS times (default 2: the first JIT-compiles),
    synchronously; for Nsight Compute beside our kernel (tuning/profile.sh PEER=deepgemm)."""
    import sys

    import indexer_q
    from indexer_q.testing import make_inputs

    argv = sys.argv[1:] if argv is None else argv
    m, n, k = (int(v) for v in argv[:3])
    calls = int(argv[3]) if len(argv) > 3 else 2
    x = make_inputs(m, n, k, seed=0, device="cuda")
    c = gemm_args(x, *indexer_q.quantize_act_fp8(x["qr"]))
    for _ in range(calls):
        run_gemm(c)
    torch.cuda.synchronize()
    print(f"ok deepgemm M={m} N={n} K={k} x{calls}", flush=True)


if __name__ == "__main__":
    main()
