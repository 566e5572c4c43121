"""One test per validation error: each names the argument and what was expected."""
import dataclasses

import pytest
import torch

import indexer_q
from indexer_q import reference as R
from indexer_q import validate as V
from indexer_q.arch import UnsupportedArchError, detect_arch
from indexer_q.testing import make_inputs

T, N, K = 4, 256, 256


@pytest.fixture
def inp():
    return make_inputs(T, N, K, p=32, seed=0)


def call_ref(inp, **changes):
    args = dict(inp)
    opts = {k: changes.pop(k) for k in ("hadamard", "fp4_rounding", "out_format") if k in changes}
    args.update(changes)
    return R.fused_indexer_q(**args, **opts)


def expect(name, *fragments):
    """pytest.raises for InvalidInputError whose message starts with `name:` and holds fragments."""
    class _Ctx:
        def __enter__(self):
            self.ctx = pytest.raises(indexer_q.InvalidInputError)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            ok = self.ctx.__exit__(*exc)
            msg = str(self.info.value)
            assert msg.startswith(f"{name}: expected"), msg
            for f in fragments:
                assert f in msg, msg
            return ok
    return _Ctx()


def test_exception_is_a_value_error():
    assert issubclass(indexer_q.InvalidInputError, ValueError)
    assert issubclass(UnsupportedArchError, indexer_q.InvalidInputError)


# ------------------------------------------------------------------ qr
def test_qr_dtype(inp):
    with expect("qr", "bfloat16", "float16"):
        call_ref(inp, qr=inp["qr"].half())


def test_qr_not_a_tensor(inp):
    with expect("qr", "torch.Tensor", "list"):
        call_ref(inp, qr=[[1.0]])


def test_qr_rank(inp):
    with expect("qr", "2-D", "3-D"):
        call_ref(inp, qr=inp["qr"].reshape(T, 2, K // 2))


def test_qr_k_divisible(inp):
    with expect("qr", "divisible by 128", "200"):
        call_ref(inp, qr=inp["qr"][:, :200].contiguous())


def test_qr_k_matches_weight(inp):
    with expect("qr", "K = 256", "K = 384"):
        call_ref(inp, qr=torch.zeros(T, 384, dtype=torch.bfloat16))


def test_qr_contiguous(inp):
    with expect("qr", "contiguous", "strides"):
        call_ref(inp, qr=torch.zeros(K, T, dtype=torch.bfloat16).t())


# ------------------------------------------------------------------ weight
def test_weight_dtype(inp):
    with expect("weight", "float8_e4m3fn", "bfloat16"):
        call_ref(inp, weight=inp["weight"].to(torch.bfloat16))


def test_weight_rank(inp):
    with expect("weight", "2-D", "1-D"):
        call_ref(inp, weight=inp["weight"].reshape(-1))


def test_weight_n_divisible(inp):
    with expect("weight", "N (dim 0) divisible by 128", "200"):
        call_ref(inp, weight=inp["weight"][:200].contiguous())


def test_weight_k_divisible(inp):
    with expect("weight", "K (dim 1) divisible by 128"):
        call_ref(inp, weight=inp["weight"][:, :200].contiguous())


def test_weight_contiguous(inp):
    w = torch.zeros(K, N, dtype=torch.float8_e4m3fn).t()
    with expect("weight", "contiguous"):
        call_ref(inp, weight=w)


# ------------------------------------------------------------------ weight_scale
def test_weight_scale_dtype(inp):
    with expect("weight_scale", "float32", "float8_e8m0fnu", "bfloat16"):
        call_ref(inp, weight_scale=inp["weight_scale"].to(torch.bfloat16))


def test_weight_scale_shape(inp):
    with expect("weight_scale", "[2, 2]", "[2, 1]"):
        call_ref(inp, weight_scale=inp["weight_scale"][:, :1])


def test_weight_scale_rank(inp):
    with expect("weight_scale", "2-D"):
        call_ref(inp, weight_scale=inp["weight_scale"].reshape(-1))


@pytest.mark.parametrize("bad", [3.0, 0.0, -0.5, float("inf"), float("nan")])
def test_weight_scale_power_of_two(inp, bad):
    s = inp["weight_scale"].clone()
    s[1, 0] = bad
    with expect("weight_scale", "power of two", "[1, 0]"):
        call_ref(inp, weight_scale=s)


# ------------------------------------------------------------------ positions, cos_sin
def test_positions_dtype(inp):
    with expect("positions", "int32", "int64", "float32"):
        call_ref(inp, positions=inp["positions"].float())


def test_positions_rank(inp):
    with expect("positions", "1-D", "2-D"):
        call_ref(inp, positions=inp["positions"].reshape(T, 1))


def test_positions_length(inp):
    with expect("positions", "[4]", "[3]"):
        call_ref(inp, positions=inp["positions"][:3])


def test_positions_contiguous(inp):
    with expect("positions", "contiguous"):
        call_ref(inp, positions=torch.zeros(2 * T, dtype=torch.int64)[::2])


def test_cos_sin_dtype(inp):
    with expect("cos_sin", "float32", "float64"):
        call_ref(inp, cos_sin=inp["cos_sin"].double())


def test_cos_sin_width(inp):
    with expect("cos_sin", "[P, 64]", "[32, 32]"):
        call_ref(inp, cos_sin=inp["cos_sin"][:, :32].contiguous())


def test_cos_sin_rank(inp):
    with expect("cos_sin", "2-D"):
        call_ref(inp, cos_sin=inp["cos_sin"].reshape(-1))


def test_cos_sin_empty(inp):
    with expect("cos_sin", "P (dim 0) >= 1"):
        call_ref(inp, cos_sin=torch.zeros(0, 64))


def test_cos_sin_contiguous(inp):
    with expect("cos_sin", "contiguous"):
        call_ref(inp, cos_sin=torch.zeros(64, 32).t())


def test_same_device(inp):
    with expect("positions", "device cpu", "device meta"):
        call_ref(inp, positions=torch.empty(T, dtype=torch.int64, device="meta"))


# ------------------------------------------------------------------ options
def test_fp4_rounding_value(inp):
    with expect("fp4_rounding", "'floor-ties'", "'rne'", "'nearest'"):
        call_ref(inp, fp4_rounding="nearest")


def test_out_format_value(inp):
    with expect("out_format", "'mxfp4'", "'fp8'", "'fp8-unscaled'", "'bf16'", "'nvfp4'"):
        call_ref(inp, out_format="nvfp4")


def test_hadamard_bool(inp):
    with expect("hadamard", "a bool", "1"):
        call_ref(inp, hadamard=1)


# ------------------------------------------------------------------ kernel path
def test_fused_indexer_q_needs_cuda(inp):
    w = indexer_q.prepare_weights(inp["weight"], inp["weight_scale"])
    with expect("qr", "CUDA", "device cpu"):
        indexer_q.fused_indexer_q(inp["qr"], w, inp["positions"], inp["cos_sin"])


def test_fused_indexer_q_needs_cuda_even_for_empty_t():
    inp = make_inputs(0, N, K, seed=1)
    w = indexer_q.prepare_weights(inp["weight"], inp["weight_scale"])
    with expect("qr", "CUDA"):
        indexer_q.fused_indexer_q(inp["qr"], w, inp["positions"], inp["cos_sin"])


def test_fused_indexer_q_weights_type(inp):
    with expect("weights", "IndexerQWeights", "Tensor"):
        indexer_q.fused_indexer_q(inp["qr"], inp["weight"], inp["positions"], inp["cos_sin"])


def test_fused_indexer_q_checks_shared_layer(inp):
    w = indexer_q.prepare_weights(inp["weight"], inp["weight_scale"])
    with expect("fp4_rounding"):
        indexer_q.fused_indexer_q(inp["qr"], w, inp["positions"], inp["cos_sin"], fp4_rounding="x")
    with expect("qr", "K = 256"):
        indexer_q.fused_indexer_q(torch.zeros(T, 128, dtype=torch.bfloat16), w,
                                  inp["positions"], inp["cos_sin"])


def test_arch_mismatch_message():
    with expect("weights", "sm_100a", "'sm_90a'"):
        V.check_arch_matches("weights", "sm_90a", "sm_100a", torch.device("cuda", 0))


def test_alignment_message():
    x = torch.zeros(64, dtype=torch.uint8)[1:]
    with expect("qr", "aligned to 16 bytes"):
        V.check_aligned("qr", x)
    V.check_aligned("qr", torch.zeros(64, dtype=torch.uint8))


# ------------------------------------------------------------------ prepare_weights
def test_prepare_weights_cpu(inp):
    w = indexer_q.prepare_weights(inp["weight"], inp["weight_scale"].to(torch.float8_e8m0fnu))
    assert isinstance(w, indexer_q.IndexerQWeights)
    assert (w.n, w.k, w.heads, w.arch) == (N, K, 2, None)
    assert w.weight_scale.dtype == torch.float32 and w.weight_scale.is_contiguous()
    assert torch.equal(w.weight_scale, inp["weight_scale"])
    assert w.extras == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.n = 3


def test_prepare_weights_arch_argument(inp):
    assert indexer_q.prepare_weights(inp["weight"], inp["weight_scale"], arch="sm_100a").arch == "sm_100a"
    with expect("arch", "sm_90a", "'sm_80'"):
        indexer_q.prepare_weights(inp["weight"], inp["weight_scale"], arch="sm_80")


def test_prepare_weights_validates(inp):
    s = inp["weight_scale"].clone()
    s[0, 0] = 0.3
    with expect("weight_scale", "power of two"):
        indexer_q.prepare_weights(inp["weight"], s)
    with expect("weight", "float8_e4m3fn"):
        indexer_q.prepare_weights(inp["weight"].float(), inp["weight_scale"])


# ------------------------------------------------------------------ quantize_act_fp8, arch
def test_quantize_act_fp8_cpu_runs_reference(inp):
    a, s = indexer_q.quantize_act_fp8(inp["qr"])
    ra, rs = R.quantize_act_fp8(inp["qr"])
    assert torch.equal(a.view(torch.uint8), ra.view(torch.uint8)) and torch.equal(s, rs)
    with expect("qr", "bfloat16"):
        indexer_q.quantize_act_fp8(inp["qr"].float())


def test_detect_arch_override(monkeypatch):
    monkeypatch.setenv("INDEXER_Q_ARCH", "sm_100a")
    assert detect_arch("cuda") == "sm_100a"
    monkeypatch.setenv("INDEXER_Q_ARCH", "sm_75")
    with expect("INDEXER_Q_ARCH", "sm_90a", "'sm_75'"):
        detect_arch("cuda")


def test_detect_arch_cpu(monkeypatch):
    monkeypatch.delenv("INDEXER_Q_ARCH", raising=False)
    with pytest.raises(UnsupportedArchError, match="device: expected a CUDA device"):
        detect_arch("cpu")


# ------------------------------------------------------------------ on a GPU
@pytest.mark.gpu
@pytest.mark.parametrize("out_format", ["mxfp4", "fp8", "fp8-unscaled", "bf16"])
def test_fused_indexer_q_empty_t_on_gpu(out_format):
    inp = make_inputs(0, N, K, seed=2, device="cuda")
    w = indexer_q.prepare_weights(inp["weight"], inp["weight_scale"])
    q, s = indexer_q.fused_indexer_q(inp["qr"], w, inp["positions"], inp["cos_sin"], out_format=out_format)
    rq, rs = R.fused_indexer_q(**inp, out_format=out_format)
    assert q.shape == rq.shape and q.dtype == rq.dtype and q.device == inp["qr"].device
    assert (s is None) == (rs is None)
    if s is not None:
        assert s.shape == rs.shape and s.dtype == rs.dtype


def test_positions_range_check_is_opt_in(monkeypatch):
    from indexer_q import validate as V
    from indexer_q.env import check_mode

    monkeypatch.delenv("INDEXER_Q_CHECK", raising=False)
    assert not check_mode()
    monkeypatch.setenv("INDEXER_Q_CHECK", "1")
    assert check_mode()
    V.check_positions_in_range(torch.tensor([0, 5, 9]), 10)
    V.check_positions_in_range(torch.tensor([], dtype=torch.int64), 10)
    with pytest.raises(V.InvalidInputError, match=r"positions: expected values in \[0, 10\).*position of 10"):
        V.check_positions_in_range(torch.tensor([0, 10]), 10)
    with pytest.raises(V.InvalidInputError, match="position of -1"):
        V.check_positions_in_range(torch.tensor([-1, 3], dtype=torch.int32), 10)
