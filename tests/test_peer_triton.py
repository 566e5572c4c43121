"""The Triton peer (RoPE + Hadamard + MXFP4 after a GEMM): its butterfly kernel computes
SPEC steps 3-5 bit for bit like the reference; its tensor-core kernel steps 3 and 5, and
step 4 with the tensor core's fp32 sum (another order than the reference's butterfly).
On the CPU it runs in Triton's interpreter."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton reads this when it is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from indexer_q import reference as ref  # noqa: E402


@pytest.mark.parametrize("method", ["butterfly", "tensor_core"])
@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("rounding", ["floor-ties", "rne"])
def test_peer_matches_reference_steps_3_to_5(hadamard, rounding, method):
    import tuning.peers.triton_rope_hadamard_mxfp4 as peer

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    t, n, p = 70, 256, 50  # two token tiles, the second partial
    q = (torch.randn(t, n, generator=g) * torch.rand(t, 1, generator=g) * 30).to(torch.bfloat16)
    q[0, :32] = 0  # amax floor
    positions = torch.randint(-3, p + 3, (t,), generator=g)  # some out of range
    from indexer_q.testing import rope_cos_sin_table

    cos_sin = rope_cos_sin_table(p)
    got = peer.rope_hadamard_mxfp4(q.to(dev), positions.to(dev), cos_sin.to(dev), hadamard=hadamard,
                                   fp4_rounding=rounding, method=method)
    x = ref.apply_rope(q.reshape(t, -1, 128), positions, cos_sin)
    x = ref.hadamard_128(x) if hadamard else x
    want = ref.quantize_mxfp4(x, rounding)
    if not hadamard or method == "butterfly":
        assert torch.equal(got[0].cpu(), want[0]), f"seed {seed}"
        assert torch.equal(got[1].cpu(), want[1]), f"seed {seed}"
        return
    # Another fp32 summation order moves a bf16 value only at a rounding boundary: nearly
    # every code and scale byte agrees, and a code that differs is one step away.
    from indexer_q.testing import compare_outputs

    agree = compare_outputs("mxfp4", got, want)
    assert agree["codes_equal"] >= 0.999 and agree["scales_equal"] >= 0.999 and agree["max_step"] <= 1, (seed, agree)
