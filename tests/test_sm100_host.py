"""CPU: the host side of the sm_100a path (issue 18): weight scales UE8M0 can hold, the SM
count in the compile key, no host work between the quantizer and the GEMM, and the
knobs the Blackwell kernel does not implement refused."""
from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

import indexer_q
from indexer_q import dispatch, jit
from indexer_q import reference as R
from indexer_q import validate as V
from indexer_q.kernels.gemm_base import GemmConfig
from indexer_q.tactics import Tactic
from indexer_q.testing import make_inputs

T, N, K = 4, 256, 256


@pytest.fixture
def inp():
    return make_inputs(T, N, K, p=32, seed=0)


# ---------------------------------------------------------------- item 1: subnormal scales
@pytest.mark.parametrize("exp", [-128, -130, -149])
@pytest.mark.parametrize("arch", ["sm_100a", "sm_90a", None])
def test_prepare_weights_refuses_scales_below_ue8m0(inp, exp, arch):
    """fp32 subnormal scales (2^-128 .. 2^-149) are powers of two but have no UE8M0 byte:
    the Blackwell layout turned them all into byte 0 (2^-127), up to 2^22 off. Refused at
    load time for every arch (SPEC step 1), and by the reference, which shares the check."""
    s = inp["weight_scale"].clone()
    s[1, 0] = 2.0 ** exp
    with pytest.raises(V.InvalidInputError, match=r"weight_scale: expected every scale at least 2\^-127") as e:
        indexer_q.prepare_weights(inp["weight"], s, arch=arch)
    assert f"(2^{exp}) at index [1, 0]" in str(e.value)
    with pytest.raises(V.InvalidInputError, match="at least 2"):
        R.fused_indexer_q(**{**inp, "weight_scale": s})


def test_smallest_ue8m0_scale_is_byte_zero(inp):
    s = inp["weight_scale"].clone()
    s[0, 0] = 2.0 ** -127  # the smallest UE8M0 scale (still a normal fp32)
    s[1, 1] = 2.0 ** 127
    w = indexer_q.prepare_weights(inp["weight"], s, arch="sm_100a")
    flat = w.extras["sf_atoms"]
    from indexer_q.kernels.gemm_sm100 import sf_atom_offset

    assert flat[sf_atom_offset(0, 0, K)] == 0 and flat[sf_atom_offset(128, 4, K)] == 254


# ---------------------------------------------------------------- item 2: SM count
@pytest.fixture
def recorded_compiles(monkeypatch):
    """jit.compile_fused without compiling: records the max_active_clusters each build gets."""
    seen = []

    def fake_compile(name, arch, obj, args, keep_dir):
        seen.append((arch, args[-2]))
        return jit.CompiledKernel(name, arch, None, 0.0)

    monkeypatch.setattr(jit, "_compile", fake_compile)
    monkeypatch.setattr(jit, "_MEMORY", {})
    monkeypatch.setenv("INDEXER_Q_DISK_CACHE", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # cross-compiling
    return seen


def test_sm_count_is_per_arch_and_part_of_the_compile_key(recorded_compiles):
    """The persistent grid is one CTA an SM: 148 for a B200 (its 16 extra SMs sat idle
    with the H200's 132), 132 for sm_90a, or what the caller passes; each count is its own
    compile (memory and disk)."""
    b200, h200 = GemmConfig(arch="sm_100a"), GemmConfig(arch="sm_90a", tile_m=128)
    jit.compile_fused(b200, 8192, 1536)
    jit.compile_fused(h200, 8192, 1536)
    jit.compile_fused(b200, 8192, 1536, sms=132)
    jit.compile_fused(b200, 8192, 1536)  # cached
    assert recorded_compiles == [("sm_100a", 148), ("sm_90a", 132), ("sm_100a", 132)]
    keys = {jit.disk_key(("fused_indexer_q", "sm_100a", b200, 8192, 1536, s)) for s in (148, 132)}
    assert len(keys) == 2


def _sm100_call(monkeypatch, sms):
    """run_fused on CPU tensors with sm_100a weights, the GPU parts replaced by recorders:
    the device's SM count, the quantizer, the compiled GEMM. Returns the event list."""
    from torch.utils._python_dispatch import TorchDispatchMode

    events = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            events.append(str(func))
            return func(*args, **(kwargs or {}))

    x = make_inputs(200, 1024, 512, p=64, seed=1)
    w = indexer_q.prepare_weights(x["weight"], x["weight_scale"], arch="sm_100a")
    a_fp8 = torch.zeros(200, 512, dtype=torch.float8_e4m3fn)
    sf = torch.zeros(256 * 4, dtype=torch.int32)

    def quantizer(qr, out=None, arch=None):
        events.append("QUANTIZER")
        return a_fp8, sf.view(torch.uint8)

    def compile_fused(config, n, k, *, sms=None, keep_dir=None):
        events.append(("COMPILE", config.arch, sms))
        return lambda *args: events.append(("GEMM", args))

    monkeypatch.setattr(dispatch, "_FUSED", {})
    monkeypatch.setattr(dispatch, "_SM_COUNT", {})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(multi_processor_count=sms))
    monkeypatch.setattr(dispatch, "run_act_quant_sf", quantizer)
    monkeypatch.setattr(jit, "compile_fused", compile_fused)
    with Record():
        dispatch.run_fused(x["qr"], w, x["positions"], x["cos_sin"], hadamard=True, fp4_rounding="floor-ties",
                           out_format="mxfp4", tactic=Tactic(), verified_only=False)
    return events, a_fp8, sf, w


def test_run_fused_compiles_for_the_device_sm_count(monkeypatch):
    events, *_ = _sm100_call(monkeypatch, 148)
    assert ("COMPILE", "sm_100a", 148) in events
    events, *_ = _sm100_call(monkeypatch, 160)  # another part, another key
    assert ("COMPILE", "sm_100a", 160) in events


# ---------------------------------------------------------------- item 3: no host work
# what may run between the two launches: allocating the outputs and views of them
METADATA_OPS = ("aten.empty", "aten.view", "aten._unsafe_view", "aten.alias", "aten.as_strided", "aten.detach")


def test_nothing_runs_between_the_quantizer_and_the_gemm(monkeypatch):
    """The quantizer writes the scale-factor layout itself: the GEMM gets its output as is
    (no UE8M0 conversion, padding or permute on the host: those were 5-6 torch kernels a
    call, and any launch between the two would break PDL's pairing of them)."""
    events, a_fp8, sf, w = _sm100_call(monkeypatch, 148)
    names = [e if isinstance(e, str) else e[0] for e in events]
    between = events[names.index("QUANTIZER") + 1:names.index("GEMM")]
    compute = [e for e in between if isinstance(e, str) and not e.startswith(METADATA_OPS)]
    assert any(isinstance(e, str) for e in between)  # (the recorder sees the allocations)
    assert not compute, compute
    gemm_args = events[names.index("GEMM")][1]
    assert gemm_args[0] is a_fp8 and gemm_args[1].data_ptr() == sf.data_ptr() and gemm_args[1].dtype == torch.uint8
    assert gemm_args[2] is w.weight and gemm_args[3] is w.extras["sf_atoms"]


# ---------------------------------------------------------------- item 7: knobs
@pytest.mark.parametrize("field,value,why", [
    ("pipelined_promotion", True, "pipelined_promotion"),
    ("epilogue", False, "epilogue=False"),
    ("cluster_n", 2, "clusters"),
    ("epilogue_warpgroups", 3, "epilogue_warpgroups=3"),
])
def test_sm100_refuses_knobs_it_does_not_implement(field, value, why):
    """A knob the kernel would ignore is refused (the profiling probe, say, would run the
    full epilogue on sm_100a and mislead the tuner)."""
    from indexer_q.kernels.gemm_sm100 import Sm100FusedIndexerQ

    cfg = GemmConfig(arch="sm_100a", **{field: value})
    assert not Sm100FusedIndexerQ.can_implement(cfg, 8192, 1536)
    assert any(why in p for p in Sm100FusedIndexerQ.problems(cfg, 8192, 1536))
    assert Sm100FusedIndexerQ.can_implement(GemmConfig(arch="sm_100a", epilogue_warpgroups=2), 8192, 1536)
    with pytest.raises(V.InvalidInputError, match=why):
        jit.compile_fused(cfg, 8192, 1536)


def test_subclasses_opt_in_to_the_epilogue_split():
    """A subclass with its own device code (the swapped-A/B kernel) offers one epilogue
    warpgroup unless it declares more: it does not inherit the split silently."""
    from indexer_q.kernels.gemm_sm100 import Sm100FusedIndexerQ

    class Own(Sm100FusedIndexerQ):
        pass

    class Declared(Sm100FusedIndexerQ):
        epilogue_warpgroup_choices = (1, 2)

    two = GemmConfig(arch="sm_100a", epilogue_warpgroups=2)
    assert not Own.can_implement(two, 8192, 1536) and Declared.can_implement(two, 8192, 1536)


def test_no_deprecated_operand_major_mode():
    """cute.nvgpu.OperandMajorMode, not the deprecated tcgen05 alias."""
    code = "import indexer_q.kernels.gemm_sm100"
    p = subprocess.run([sys.executable, "-W", "error:tcgen05.OperandMajorMode is deprecated:DeprecationWarning",
                        "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
