"""Compile cache: one compiled kernel per (kernel, arch, config), never per M.

Every tensor's row count (M, and the cos_sin table's P) is symbolic at compile time,
so a tactic compiles once and serves every token count.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

_LOCK = threading.Lock()
_MEMORY: dict = {}

# Max CTAs resident at once; cross-compiling cannot ask a GPU, so it is part of the key.
H200_SMS = 132


@dataclass
class CompiledKernel:
    name: str
    arch: str
    fn: object
    seconds: float
    artifacts: dict = field(default_factory=dict)

    def __call__(self, *args):
        return self.fn(*args)


def _fake_fused_args(config, n: int, k: int):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    m = cute.sym_int()
    p = cute.sym_int()
    heads = n // 128
    pos_dtype = cutlass.Int64 if config.positions_dtype == "int64" else cutlass.Int32
    q_words = n // 8 if config.out_format == "mxfp4" else n // 4
    rowmaj = (1, 0)
    return [
        make_fake_compact_tensor(cutlass.Float8E4M3FN, (m, k), stride_order=rowmaj, assumed_align=16),
        make_fake_compact_tensor(cutlass.Float32, (m, k // 128), stride_order=rowmaj, assumed_align=16),
        make_fake_compact_tensor(cutlass.Float8E4M3FN, (n, k), stride_order=rowmaj, assumed_align=16),
        make_fake_compact_tensor(cutlass.Float32, (heads, k // 128), stride_order=rowmaj, assumed_align=16),
        make_fake_compact_tensor(pos_dtype, (m,), assumed_align=8),
        make_fake_compact_tensor(cutlass.Float32, (p, 64), stride_order=rowmaj, assumed_align=16),
        make_fake_compact_tensor(cutlass.Int32, (m, q_words), stride_order=rowmaj, assumed_align=16),
        make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(), cute.sym_int()), stride_order=rowmaj, assumed_align=4),
        H200_SMS // (config.cluster_m * config.cluster_n),  # clusters resident at once
        make_fake_stream(use_tvm_ffi_env_stream=True),
    ]


def _compile(name: str, arch: str, obj, args, keep_dir: str | None) -> CompiledKernel:
    import cutlass.cute as cute

    # The target is a compile option, so one process can build for every arch.
    opts = f"--enable-tvm-ffi --gpu-arch {arch}"
    if keep_dir:
        os.makedirs(keep_dir, exist_ok=True)  # CuTe DSL silently skips a missing dir
        opts += f" --keep-ptx --dump-dir {keep_dir}"
    t0 = time.perf_counter()
    fn = cute.compile(obj, *args, options=opts)
    ck = CompiledKernel(name, arch, fn, time.perf_counter() - t0)
    if keep_dir:
        ptx = sorted(f for f in os.listdir(keep_dir) if f.endswith(".ptx"))
        if ptx:
            ck.artifacts["ptx"] = os.path.join(keep_dir, ptx[-1])
    return ck


def _cached(key, keep_dir, build) -> CompiledKernel:
    with _LOCK:
        hit = _MEMORY.get(key)
    if hit is not None and keep_dir is None:
        return hit
    ck = build()
    with _LOCK:
        return _MEMORY.setdefault(key, ck) if keep_dir is None else ck


def compile_act_quant(arch: str, *, keep_dir: str | None = None) -> CompiledKernel:
    """SPEC step 1 kernel for `arch`; M and K are symbolic."""

    def build():
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

        from indexer_q.kernels.act_quant import ActQuantFp8

        m, kw, kq, kb = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
        args = [
            make_fake_compact_tensor(cutlass.Int32, (m, kw), stride_order=(1, 0), assumed_align=16),
            make_fake_compact_tensor(cutlass.Int32, (m, kq), stride_order=(1, 0), assumed_align=16),
            make_fake_compact_tensor(cutlass.Float32, (m, kb), stride_order=(1, 0), assumed_align=16),
            make_fake_stream(use_tvm_ffi_env_stream=True),
        ]
        return _compile("act_quant_fp8", arch, ActQuantFp8(arch), args, keep_dir)

    return _cached(("act_quant", arch), keep_dir, build)


def compile_fused(config, n: int, k: int, *, keep_dir: str | None = None) -> CompiledKernel:
    """Compile the fused kernel for `config` (its arch) and the weight shape (N, K)."""
    from indexer_q.kernels.gemm_sm90 import Sm90FusedIndexerQ

    kernel_classes = {"sm_90a": Sm90FusedIndexerQ}
    cls = kernel_classes.get(config.arch)
    if cls is None:
        raise NotImplementedError(f"no fused kernel for {config.arch} yet")
    return _cached(
        ("fused", config, n, k),
        keep_dir,
        lambda: _compile("fused_indexer_q", config.arch, cls(config),
                         _fake_fused_args(config, n, k), keep_dir),
    )
