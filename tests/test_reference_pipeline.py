"""The torch reference against the independent numpy implementation (tests/spec_numpy.py),
bit for bit, and against the float64 pipeline (MXFP4's own error)."""
import numpy as np
import pytest
import torch

from indexer_q import reference as R
from indexer_q.testing import make_inputs, rope_cos_sin_table

import spec_numpy as S


def run_numpy(inp, **kw):
    return S.run(inp["qr"].view(torch.int16).numpy().view(np.uint16),
                 inp["weight"].view(torch.uint8).numpy(),
                 inp["weight_scale"].numpy(), inp["positions"].numpy(),
                 inp["cos_sin"].numpy(), **kw)


CASES = [(hadamard, rounding, "mxfp4") for hadamard in (False, True)
         for rounding in ("floor-ties", "rne")]
CASES += [(hadamard, "floor-ties", fmt) for hadamard in (False, True)
          for fmt in ("fp8", "fp8-unscaled")]


@pytest.mark.parametrize("hadamard,rounding,out_format", CASES)
def test_reference_matches_numpy_spec(hadamard, rounding, out_format):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())     # fresh inputs each run
    inp = make_inputs(37, 512, 384, p=64, seed=seed)
    inp["positions"][:3] = torch.tensor([-1, 64, 63])       # out-of-range and edge rows
    kw = dict(hadamard=hadamard, fp4_rounding=rounding, out_format=out_format)
    q, s = R.fused_indexer_q(**inp, **kw)
    nq, ns = run_numpy(inp, **kw)
    if out_format == "mxfp4":
        np.testing.assert_array_equal(q.numpy(), nq, err_msg=f"seed {seed}")
        np.testing.assert_array_equal(s.numpy(), ns, err_msg=f"seed {seed}")
    else:
        np.testing.assert_array_equal(q.view(torch.uint8).numpy(), nq, err_msg=f"seed {seed}")
        if out_format == "fp8":
            np.testing.assert_array_equal(s.numpy(), ns, err_msg=f"seed {seed}")
        else:
            assert s is None and ns is None


def test_bf16_pipeline_matches_numpy_steps():
    inp = make_inputs(9, 256, 256, p=16, seed=5)
    q = R.bf16_pipeline(**inp, hadamard=True)
    a, e = S.step1(inp["qr"].view(torch.int16).numpy().view(np.uint16))
    nq = S.step2(a, e, inp["weight"].view(torch.uint8).numpy(), inp["weight_scale"].numpy())
    nq = S.step4(S.step3(nq, inp["positions"].numpy(), inp["cos_sin"].numpy()))
    np.testing.assert_array_equal(q.float().numpy(), nq)


def test_weight_scale_e8m0_same_as_float32():
    inp = make_inputs(4, 256, 256, seed=6)
    a = R.fused_indexer_q(**inp)
    inp["weight_scale"] = inp["weight_scale"].to(torch.float8_e8m0fnu)
    b = R.fused_indexer_q(**inp)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("hadamard", [False, True])
def test_reference_vs_float64_pipeline_error(hadamard):
    inp = make_inputs(32, 1024, 1536, seed=7)
    out = R.fused_indexer_q(**inp, hadamard=hadamard)
    err = R.relative_error(R.dequantize_fp4(*out), R.float64_pipeline(**inp, hadamard=hadamard))
    assert 0.08 < err < 0.14, err


def test_fp8_formats_vs_float64_pipeline_error():
    inp = make_inputs(16, 512, 512, seed=8)
    exact = R.float64_pipeline(**inp)
    q, s = R.fused_indexer_q(**inp, out_format="fp8")
    err = R.relative_error(q.float() * s[..., None], exact)
    assert err < 0.05, err


@pytest.mark.parametrize("out_format,shapes", [
    ("mxfp4", ((0, 4, 64), (0, 4))), ("fp8", ((0, 4, 128), (0, 4))), ("fp8-unscaled", ((0, 4, 128), None))])
def test_reference_empty_t(out_format, shapes):
    inp = make_inputs(0, 512, 256, seed=9)
    q, s = R.fused_indexer_q(**inp, out_format=out_format)
    assert tuple(q.shape) == shapes[0]
    assert q.dtype == (torch.uint8 if out_format == "mxfp4" else torch.float8_e4m3fn)
    if shapes[1] is None:
        assert s is None
    else:
        assert tuple(s.shape) == shapes[1]
        assert s.dtype == (torch.int32 if out_format == "mxfp4" else torch.float32)


def test_positions_int32_and_int64_agree():
    inp = make_inputs(8, 256, 256, seed=10)
    a = R.fused_indexer_q(**inp)
    inp["positions"] = inp["positions"].to(torch.int32)
    b = R.fused_indexer_q(**inp)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_cos_sin_table():
    cs = rope_cos_sin_table(8)
    assert cs.shape == (8, 64) and cs.dtype == torch.float32
    assert torch.equal(cs[0, :32], torch.ones(32)) and torch.equal(cs[0, 32:], torch.zeros(32))


def test_bf16_format_is_steps_3_and_4_unquantized():
    """out_format="bf16": q after RoPE and the optional Hadamard, bf16 [T, H, 128], no
    scale; every other format quantizes exactly that tensor."""
    from indexer_q import reference as R
    from indexer_q.testing import make_inputs

    inp = make_inputs(9, 1024, 1024, seed=4)
    for hadamard in (False, True):
        q, s = R.fused_indexer_q(**inp, hadamard=hadamard, out_format="bf16")
        assert s is None and q.dtype == torch.bfloat16 and tuple(q.shape) == (9, 8, 128)
        assert torch.equal(q, R.bf16_pipeline(**inp, hadamard=hadamard))
        fq, fs = R.fused_indexer_q(**inp, hadamard=hadamard, out_format="fp8")
        rq, rs = R.quantize_fp8_per_head(q)
        assert torch.equal(fq.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(fs, rs)


def test_format_sizes_agree_between_host_and_kernels():
    """The host's and the kernels' tables of output formats (kernels/ may not import src/)."""
    from indexer_q import constants
    from indexer_q.kernels import numerics

    # the kernels' one more: the two-kernel tactic's GEMM output, never the op's
    internal = {"gemm-bf16"}
    assert tuple(f for f in numerics.OUT_FORMATS if f not in internal) == constants.OUT_FORMATS
    assert {f: b for f, b in numerics.Q_BYTES_PER_HEAD.items() if f not in internal} == constants.Q_BYTES_PER_HEAD
