"""Compile cache: one compiled kernel per (kernel, arch, config), never per M.

Every tensor's row count (M, and the cos_sin table's P) is symbolic at compile time,
so a tactic compiles once and serves every token count.

Lookup order: this process's memory, then the disk cache, then compile and store. A
disk entry is CuTe DSL's exported object file linked into a shared library against the
CuTe DSL and TVM-FFI runtimes, so a later process loads it through TVM-FFI alone,
without importing or running the CuTe DSL compiler. Entries live under
`env.cache_dir()/kernels`, are named by a digest of the kernel sources, arch, config
and library versions, are written to a temp file and renamed into place, and are built
under a per-entry file lock, so processes that want the same kernel compile it once.
INDEXER_Q_DISK_CACHE=0 turns the disk cache off.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field

_LOCK = threading.Lock()  # guards _MEMORY
# Held across a build: two threads that miss at once compile one after the other (the
# second then finds the first's result), and CuTe DSL's compiler never runs concurrently.
_BUILD_LOCK = threading.RLock()
_MEMORY: dict = {}
# Bump when what this module passes to the compiler changes (options, fake tensors).
JIT_FORMAT = 2

# The persistent kernels' grid is the device's SM count (one CTA an SM), a compile-time
# constant: it is part of the compile key. On a GPU it is the device's own
# (torch.cuda.get_device_properties(...).multi_processor_count, passed by dispatch.run_fused);
# cross-compiling (no GPU, or a GPU of another arch) takes the arch's usual count.
DEFAULT_SMS = {"sm_90a": 132, "sm_100a": 148}  # H100 / H200 SXM; B200
H200_SMS = DEFAULT_SMS["sm_90a"]


def default_sms(arch: str) -> int:
    """SM count to compile `arch`'s kernels for when the caller names no device: the
    current CUDA device's if it is of that arch, else DEFAULT_SMS[arch]."""
    try:
        import torch

        if torch.cuda.is_available():
            from .constants import ARCH_BY_CAPABILITY

            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            if ARCH_BY_CAPABILITY.get((props.major, props.minor)) == arch:
                return int(props.multi_processor_count)
    except Exception:  # noqa: BLE001  (no usable CUDA: cross-compiling)
        pass
    return DEFAULT_SMS[arch]


@dataclass
class CompiledKernel:
    name: str
    arch: str
    fn: object
    seconds: float  # what getting it took: compile, or load from disk
    artifacts: dict = field(default_factory=dict)
    source: str = "compiled"  # "compiled" or "disk"
    module: object = None  # keeps a disk-loaded module alive

    def __call__(self, *args):
        return self.fn(*args)


def _compile(name: str, arch: str, obj, args, keep_dir: str | None) -> CompiledKernel:
    import cutlass.cute as cute

    # The target is a compile option, so one process can build for every arch.
    opts = f"--enable-tvm-ffi --gpu-arch {arch}"
    if keep_dir:
        os.makedirs(keep_dir, exist_ok=True)  # CuTe DSL silently skips a missing dir
        opts += f" --keep-ptx --keep-cubin --dump-dir {keep_dir}"
    t0 = time.perf_counter()
    fn = cute.compile(obj, *args, options=opts)
    ck = CompiledKernel(name, arch, fn, time.perf_counter() - t0)
    if keep_dir:
        for kind in ("ptx", "cubin"):  # the cubin is what runs: built by the DSL's own ptxas
            found = sorted(f for f in os.listdir(keep_dir) if f.endswith("." + kind))
            if found:
                ck.artifacts[kind] = os.path.join(keep_dir, found[-1])
    return ck


def _disk_enabled() -> bool:
    return os.environ.get("INDEXER_Q_DISK_CACHE", "1") != "0"


@functools.lru_cache(maxsize=None)
def _versions() -> str:
    """Versions of everything a cached binary depends on: the DSL and its runtime
    libraries (every nvidia-cutlass-dsl* distribution) and TVM-FFI. Read from the
    `{name}-{version}.dist-info` directory names on sys.path: parsing every installed
    distribution's metadata took 0.17 s of a new process's first call on the H200 host."""
    import sys

    out = set()
    for entry in sys.path:
        try:
            names = [e.name for e in os.scandir(entry or ".")]
        except OSError:
            continue
        for n in names:
            if n.endswith(".dist-info") and n.startswith(("nvidia_cutlass_dsl", "apache_tvm_ffi")):
                name, _, version = n[: -len(".dist-info")].partition("-")
                out.add(f"{name.replace('_', '-').lower()}={version}")
    return ";".join(sorted(out)) or "kit"


def disk_key(key) -> str:
    """Digest naming a disk entry: kernel sources, library versions and the compile key
    (a frozen dataclass repr and plain ints), so any change makes a new entry."""
    from . import __version__
    from .table import kernel_fingerprint

    text = f"{kernel_fingerprint(key[1])}|{__version__}|{JIT_FORMAT}|{_versions()}|{key!r}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _disk_dir():
    from .env import cache_dir

    path = cache_dir() / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _load_from_disk(path, symbol, name, arch) -> CompiledKernel:
    import tvm_ffi

    t0 = time.perf_counter()
    module = tvm_ffi.load_module(str(path))
    fn = module[symbol]
    return CompiledKernel(name, arch, fn, time.perf_counter() - t0, source="disk", module=module)


def _link_shared(obj_path: str, so_path: str) -> None:
    """Link an exported object into a shared library that finds its runtimes by rpath."""
    import subprocess

    from cutlass.cute.runtime import find_runtime_libraries

    libs = find_runtime_libraries(enable_tvm_ffi=True)
    rpaths = sorted({os.path.dirname(lib) for lib in libs})
    cmd = [os.environ.get("CC", "cc"), "-shared", "-o", so_path, obj_path, *libs]
    cmd += [f"-Wl,-rpath,{d}" for d in rpaths]
    subprocess.run(cmd, check=True, capture_output=True)


def _cached(key, keep_dir, build) -> CompiledKernel:
    """Memory, then disk, then build (and store). `keep_dir` (dump PTX) always builds."""
    with _LOCK:
        hit = _MEMORY.get(key)
    if hit is not None and keep_dir is None:
        return hit
    with _BUILD_LOCK:
        with _LOCK:
            hit = _MEMORY.get(key)
        if hit is not None and keep_dir is None:
            return hit
        if keep_dir is not None or not _disk_enabled():
            ck = build()
        else:
            ck = _through_disk(key, build)
        if keep_dir is not None:
            return ck
        with _LOCK:
            return _MEMORY.setdefault(key, ck)


def _through_disk(key, build) -> CompiledKernel:
    digest = disk_key(key)
    symbol = f"indexer_q_{digest}"
    try:
        directory = _disk_dir()
        lock = open(directory / f"{digest}.lock", "w")
    except OSError as exc:  # a read-only or missing cache home: work on, uncached
        warnings.warn(f"indexer_q: kernel cache directory unusable ({exc}); compiling without it")
        return build()
    path = directory / f"{digest}.so"
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process builds, the others wait and load
        if path.exists():
            try:
                return _load_from_disk(path, symbol, key[0], key[1])
            except Exception as exc:  # a damaged entry: rebuild it
                warnings.warn(f"indexer_q: could not load cached kernel {path} ({exc}); recompiling")
        ck = build()
        fd, tmp_obj = tempfile.mkstemp(dir=directory, prefix=f"{digest}.", suffix=".o.tmp")
        os.close(fd)
        tmp_so = tmp_obj[: -len(".o.tmp")] + ".so.tmp"
        try:
            ck.fn.export_to_c(tmp_obj, function_name=symbol)
            _link_shared(tmp_obj, tmp_so)
            os.replace(tmp_so, path)
            ck.artifacts["shared_library"] = str(path)
        except Exception as exc:  # no C compiler, say: keep working, just uncached
            warnings.warn(f"indexer_q: could not store compiled kernel in {directory} ({exc})")
        finally:
            for tmp in (tmp_obj, tmp_so):
                if os.path.exists(tmp):
                    os.unlink(tmp)
        return ck


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

    return _cached(("act_quant_fp8", arch), keep_dir, build)


def compile_fused(config, n: int, k: int, *, sms: int | None = None, keep_dir: str | None = None) -> CompiledKernel:
    """Compile the fused kernel for `config` (its arch), the weight shape (N, K) and a
    device of `sms` SMs (default: default_sms(config.arch)); `sms` is part of the key."""
    from .tactics import KERNEL_CLASSES, kernel_class

    if (config.arch, config.kind) not in KERNEL_CLASSES:
        raise NotImplementedError(f"no fused {config.kind} kernel for {config.arch} yet")
    sms = int(sms) if sms is not None else default_sms(config.arch)

    def build():  # the kernel module (and CuTe DSL) is imported only to compile
        from .validate import fail

        cls = kernel_class(config.arch, config.kind)
        problems = cls.problems(config, n, k)
        if problems:  # before any compile or launch; a disk entry exists only past this
            fail("tactic", f"a configuration the {config.arch} {config.kind} kernel can run at N = {n}, K = {k}",
                 "; ".join(problems))
        kernel = cls(config)
        return _compile("fused_indexer_q", config.arch, kernel.entry_point(), kernel.compile_args(n, k, sms),
                        keep_dir)

    return _cached(("fused_indexer_q", config.arch, config, n, k, sms), keep_dir, build)


def compile_row_epilogue(config, n: int, *, lanes_per_row: int = 4, units_per_group: int = 2,
                         keep_dir: str | None = None) -> CompiledKernel:
    """The two-kernel tactic's second launch (kernels/row_epilogue.py): SPEC steps 3-6 over
    the GEMM's bf16 output, for `config`'s numerics (GemmConfig: hadamard, fp4_rounding,
    out_format, positions_dtype, pdl; its other fields are ignored) and N; M and P symbolic."""
    from indexer_q.kernels.gemm_base import GemmConfig
    from indexer_q.kernels.numerics import HEAD_DIM, Q_BYTES_PER_HEAD

    config = GemmConfig(arch=config.arch, hadamard=config.hadamard, fp4_rounding=config.fp4_rounding,
                        out_format=config.out_format, positions_dtype=config.positions_dtype, pdl=config.pdl)

    def build():
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

        from indexer_q.kernels.row_epilogue import RowEpilogue

        kernel = RowEpilogue(config, n, lanes_per_row, units_per_group)
        m, p = cute.sym_int(), cute.sym_int()
        rowmaj = (1, 0)
        pos_dtype = cutlass.Int64 if config.positions_dtype == "int64" else cutlass.Int32
        args = [
            make_fake_compact_tensor(cutlass.Int32, (m, n // 2), stride_order=rowmaj, assumed_align=16),
            make_fake_compact_tensor(pos_dtype, (m,), assumed_align=8),
            make_fake_compact_tensor(cutlass.Float32, (p, 64), stride_order=rowmaj, assumed_align=16),
            make_fake_compact_tensor(cutlass.Int32, (m, n // HEAD_DIM * Q_BYTES_PER_HEAD[config.out_format] // 4),
                                     stride_order=rowmaj, assumed_align=16),
            make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(), cute.sym_int()), stride_order=rowmaj,
                                     assumed_align=4),
            make_fake_stream(use_tvm_ffi_env_stream=True),
        ]
        return _compile("row_epilogue", config.arch, kernel, args, keep_dir)

    return _cached(("row_epilogue", config.arch, config, n, lanes_per_row, units_per_group), keep_dir, build)


def _compile_job(job):
    """A worker's compile into the disk cache; a failure is returned, not raised."""
    config, n, k, *sms = job  # (config, n, k) or (config, n, k, sms)
    try:
        compile_fused(config, n, k, sms=sms[0] if sms else None)
    except Exception as exc:  # noqa: BLE001
        return f"{config}: {type(exc).__name__}: {exc}"
    return None


def precompile(jobs, workers: int | None = None) -> list[str]:
    """Compile the fused kernels [(config, n, k)] or [(config, n, k, sms)] at once in worker
    processes, each filling the disk cache that this process then loads from (a kernel
    compiles in 1-4 s, one CPU core each). Returns the failures as strings, in job order;
    does nothing without the disk cache.

    A worker process that dies (a crash in the compiler, the OOM killer, a main module
    the spawned worker cannot re-import) breaks the whole pool: the jobs it took down are
    compiled again, each in a fresh process of its own (`workers` at a time), so every other
    kernel still reaches the cache and the one that kills its process is named among the
    failures instead of aborting the caller (the tuner)."""
    import concurrent.futures
    import multiprocessing
    from concurrent.futures.process import BrokenProcessPool

    jobs = list(dict.fromkeys(jobs))
    if not jobs or not _disk_enabled():
        return []
    workers = workers or max(1, min(len(jobs), (os.cpu_count() or 2) // 2))
    spawn = multiprocessing.get_context("spawn")
    results: dict[int, str | None] = {}
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=spawn) as ex:
        futures = []
        try:
            for job in jobs:
                futures.append(ex.submit(_compile_job, job))
        except BrokenProcessPool:
            pass  # broken while submitting: the jobs not submitted are compiled below, alone
        for i, future in enumerate(futures):
            try:
                results[i] = future.result()
            except BrokenProcessPool:
                pass  # compiled again below, alone

    def alone(job):
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as ex:
            try:
                return ex.submit(_compile_job, job).result()
            except BrokenProcessPool:
                return f"{job[0]}: its compile worker process died (its stderr says why)"

    lost = [i for i in range(len(jobs)) if i not in results]
    with concurrent.futures.ThreadPoolExecutor(workers) as threads:
        results.update(zip(lost, threads.map(alone, [jobs[i] for i in lost])))
    return [results[i] for i in range(len(jobs)) if results[i]]
