"""qr passed already quantized (fused_indexer_q(..., qr_scale=...)): the checks, the
reference, the tactic twin that reads it (CPU), and on a GPU the same bytes as the bf16
qr that quantizes to it, under CUDA graphs and torch.compile too (marked gpu)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import indexer_q
from indexer_q import reference as R
from indexer_q.tactics import SM90_SMS, Tactic, can_run, for_quantized_input, heuristic, valid_tactics
from indexer_q.testing import make_inputs
from test_kernel_sm90 import _poisoned

SHAPES = {"v4-pro": (8192, 1536), "v4-flash": (8192, 1024), "tp8": (1024, 1536)}


def _expect(name, *fragments):
    return pytest.raises(indexer_q.InvalidInputError, match=rf"^{name}: expected.*" + ".*".join(fragments))


@pytest.fixture
def quantized():
    x = make_inputs(5, 256, 256, p=32, seed=1)
    a, s = R.quantize_act_fp8(x["qr"])
    return x, a, s


def _ref(x, **kw):
    return R.fused_indexer_q(x["qr"], x["weight"], x["weight_scale"], x["positions"], x["cos_sin"],
                             hadamard=True, **kw)


# ------------------------------------------------------------------ checks (CPU, reference path)
def test_fp8_qr_without_its_scale(quantized):
    x, a, _ = quantized
    with _expect("qr_scale", "float32", "quantize_act_fp8"):
        _ref(dict(x, qr=a))


def test_bf16_qr_with_a_scale(quantized):
    x, _, s = quantized
    with _expect("qr", "float8_e4m3fn", "bfloat16"):
        _ref(x, qr_scale=s)


@pytest.mark.parametrize("bad, fragment", [
    (lambda s: s.double(), "float32"),
    (lambda s: s[:, :1].contiguous(), r"\[5, 2\]"),
    (lambda s: s[:4], r"\[5, 2\]"),
    (lambda s: s.t().contiguous().t(), "contiguous"),
])
def test_qr_scale_checked(quantized, bad, fragment):
    x, a, s = quantized
    with _expect("qr_scale", fragment):
        _ref(dict(x, qr=a), qr_scale=bad(s))


def test_quantized_qr_contiguous(quantized):
    x, a, s = quantized
    wide = torch.zeros(5, 512, dtype=torch.float8_e4m3fn)
    wide[:, :256] = a
    with _expect("qr", "contiguous"):
        _ref(dict(x, qr=wide[:, :256]), qr_scale=s)


@pytest.mark.parametrize("out_format", ["mxfp4", "fp8", "bf16"])
def test_reference_same_as_bf16_qr(quantized, out_format):
    """Step 1 is exact, so step 1's output in gives the bf16 qr's outputs, bit for bit."""
    x, a, s = quantized
    got = _ref(dict(x, qr=a), qr_scale=s, out_format=out_format)
    want = _ref(x, out_format=out_format)
    for g, w in zip(got, want):
        assert (g is None and w is None) or torch.equal(g.view(torch.uint8), w.view(torch.uint8))


# ------------------------------------------------------------------ the tactic (CPU)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_fused_tactic_has_a_twin_that_reads_a_quantized_qr(shape):
    """Whatever the table or the tuner picked, a quantized qr runs a tactic without the
    fused quantizer that the kernels implement, keeping the picked tile, K split and
    epilogue where those run without it."""
    n, k = SHAPES[shape]
    for m in (1, 2, 7, 16, 24, 33, 64, 96, 128, 200, 256, 1000):
        for t in valid_tactics("sm_90a", m, n, k):
            got = for_quantized_input("sm_90a", t, m, n, k, sms=SM90_SMS)
            assert not got.fused_act_quant and can_run("sm_90a", got, n, k), (m, t, got)
            if not t.fused_act_quant:
                assert got == t
            elif got.kind == t.kind == "swap_ab":
                same = ("tile_m", "split_k", "epilogue_warpgroups", "tensor_core_hadamard", "uniform_descriptors",
                        "cluster_m")
                assert all(getattr(got, f) == getattr(t, f) for f in same), (m, t, got)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_heuristic_for_a_quantized_qr(shape):
    n, k = SHAPES[shape]
    for m in (1, 16, 64, 128, 256, 4096):
        t = heuristic("sm_90a", m, n, k, quantized_input=True)
        assert not t.fused_act_quant and can_run("sm_90a", t, n, k)


def test_explicit_fused_tactic_refused():
    from indexer_q.dispatch import choose_tactic

    t = Tactic(kind="swap_ab", tile_m=16, fused_act_quant=True, epilogue_warpgroups=2)
    with _expect("tactic", "fused_act_quant"):
        choose_tactic("sm_90a", torch.device("cpu"), 16, 1024, 1536, t, quantized_input=True)
    plain = dataclasses.replace(t, fused_act_quant=False)
    assert choose_tactic("sm_90a", torch.device("cpu"), 16, 1024, 1536, plain, quantized_input=True) == plain


def test_table_entries_for_a_quantized_qr(tmp_path, monkeypatch):
    """A table holds entries for the bf16 qr and, marked "qr": "fp8", for a quantized one:
    each call looks up its own; a quantized call without its own entries derives the bf16
    qr's choice's twin."""
    import json

    from indexer_q import table
    from indexer_q.dispatch import choose_tactic

    meta = {"gpu": "NVIDIA H200", "sms": 132, "cutlass_dsl": "4.8.1", "kernel_fingerprint": table.kernel_fingerprint()}
    monkeypatch.setattr(table, "metadata", lambda device=None: meta)
    monkeypatch.setattr(table, "PACKAGE_TABLES", tmp_path / "package")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    fused = Tactic(kind="swap_ab", tile_m=16, fused_act_quant=True, epilogue_warpgroups=2)
    plain = Tactic(kind="swap_ab", tile_m=32, split_k=2, epilogue_warpgroups=2)
    path = tmp_path / "t.json"
    table.write_table(path, meta, [{"n": 8192, "k": 1536, "m_max": 64, "tactic": fused},
                                   {"n": 8192, "k": 1536, "m_max": 16, "qr": "fp8", "tactic": plain},
                                   {"n": 8192, "k": 1536, "m_max": 16384, "tactic": Tactic()}])
    assert [e.get("qr") for e in json.loads(path.read_text())["entries"]] == [None, None, "fp8"]
    table.set_tactic_table(path)
    try:
        assert table.lookup(8, 8192, 1536) == fused
        assert table.lookup(8, 8192, 1536, quantized_input=True) == plain
        assert table.lookup(8, 1024, 1536, quantized_input=True) is None  # silently: derived
        cpu = torch.device("cpu")
        assert choose_tactic("sm_90a", cpu, 8, 8192, 1536, quantized_input=True) == plain
        assert choose_tactic("sm_90a", cpu, 8, 8192, 1536) == fused
        assert choose_tactic("sm_90a", cpu, 1000, 8192, 1536, quantized_input=True) == Tactic()
    finally:
        table.set_tactic_table(None)


def test_sm100_refuses_a_quantized_qr():
    from indexer_q.dispatch import KernelUnavailableError, check_quantized_input

    with pytest.raises(KernelUnavailableError, match="sm_90a only, not sm_100a"):
        check_quantized_input("sm_100a")


# ------------------------------------------------------------------ on the GPU
def _gpu_case(m, shape, seed):
    n, k = SHAPES[shape]
    x = make_inputs(m, n, k, p=4096, seed=seed, device="cuda")
    w = indexer_q.prepare_weights(x["weight"], x["weight_scale"])
    a, s = indexer_q.quantize_act_fp8(x["qr"])
    return x, w, a, s


def _bytes_equal(a, b):
    return (a is None and b is None) or torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("m", [1, 3, 16, 33, 64, 128, 200, 1000])
@pytest.mark.parametrize("out_format", ["mxfp4", "fp8", "bf16"])
def test_same_bytes_as_the_bf16_qr(shape, m, out_format):
    """Outputs poisoned twice: every byte written, and each equal to the bf16 qr's call with
    the same (quantizer-less) tactic, whose bytes the kernel tests hold to the SPEC."""
    from indexer_q import dispatch

    x, w, a, s = _gpu_case(m, shape, seed=m)
    opts = dict(hadamard=True, fp4_rounding="floor-ties", out_format=out_format)
    n, k = SHAPES[shape]
    tactic = dispatch.choose_tactic("sm_90a", x["qr"].device, m, n, k, quantized_input=True)
    outs = [dispatch.run_fused(a, w, x["positions"], x["cos_sin"], out=_poisoned(m, w.heads, out_format, byte),
                               qr_scale=s, **opts) for byte in (0x00, 0xA5)]
    want = dispatch.run_fused(x["qr"], w, x["positions"], x["cos_sin"], tactic=tactic, **opts)
    torch.cuda.synchronize()
    for got in outs:
        assert _bytes_equal(got[0], want[0]) and _bytes_equal(got[1], want[1]), (shape, m, out_format, tactic)


@pytest.mark.gpu
def test_public_op_graph_and_compile():
    """The public op with qr_scale: the same bytes eager, replayed in a CUDA graph on new
    inputs, and compiled (fullgraph)."""
    x, w, a, s = _gpu_case(24, "v4-pro", seed=5)

    def call(a_, s_):
        return indexer_q.fused_indexer_q(a_, w, x["positions"], x["cos_sin"], hadamard=True, qr_scale=s_)

    eager = call(a, s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, qs = call(a, s)
    y = make_inputs(24, 8192, 1536, p=4096, seed=6, device="cuda")
    a2, s2 = indexer_q.quantize_act_fp8(y["qr"])
    a.copy_(a2)
    s.copy_(s2)
    graph.replay()
    torch.cuda.synchronize()
    want = call(a2, s2)
    assert _bytes_equal(q, want[0]) and _bytes_equal(qs, want[1])
    assert not torch.equal(q, eager[0])
    compiled = torch.compile(call, fullgraph=True)
    got = compiled(a2, s2)
    assert _bytes_equal(got[0], want[0]) and _bytes_equal(got[1], want[1])


@pytest.mark.gpu
def test_opcheck_with_a_quantized_qr():
    """torch.library.opcheck on the op given an e4m3 qr and its scales: fake tensor,
    autograd registration and AOT dispatch. Its schema test is left out: it compares the
    inputs with allclose, which has no float8 kernel; the bf16 case (test_op_gpu) runs it on
    the same schema."""
    import indexer_q.op  # noqa: F401

    x, w, a, s = _gpu_case(64, "tp8", seed=7)
    args = (a, x["weight"].view(torch.uint8), x["weight_scale"], x["positions"], x["cos_sin"], True, "rne",
            "mxfp4", "", "sm_90a")
    torch.library.opcheck(torch.ops.indexer_q.fused_indexer_q.default, args, {"qr_scale": s},
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
