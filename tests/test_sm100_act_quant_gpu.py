"""The sm_100a activation quantizer (kernels/act_quant_sm100.py) on a GPU: the e4m3 bytes
of SPEC step 1 and the scale factors in the fused kernel's atom layout, every byte, pad
rows included. Marked gpu. Its code is arch-neutral (plain loads, shuffles, stores), so on
a Hopper GPU it runs compiled for sm_90a: that checks the arithmetic and the layout; the
sm_100a build itself is only compiled (tests/test_compile.py)."""
from __future__ import annotations

import pytest
import torch

from indexer_q import dispatch
from indexer_q import reference as ref
from indexer_q.arch import detect_arch
from indexer_q.weights import sf_atom_layout

pytestmark = pytest.mark.gpu


def _qr(t, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * torch.pow(2.0, torch.randint(-12, 12, (t, 1), generator=g).float())
    x = x.to(torch.bfloat16)
    if t > 3:  # edge values: a NaN block, an Inf block, an all-zero block, a tiny block
        x[1, :128] = float("nan")
        x[2, -128:] = float("inf")
        x[3, :128] = 0
        x[0, -128:] = 1e-30
    return x.cuda()


@pytest.mark.parametrize("t", [1, 7, 127, 128, 129, 200, 1000])
@pytest.mark.parametrize("k", [128, 640, 1536])
def test_quantizer_writes_the_scale_factor_layout(t, k):
    from indexer_q.kernels.act_quant_sm100 import sf_words

    qr = _qr(t, k, seed=t * 7 + k)
    a_fp8 = torch.full((t, k), 0x5A, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    sf = torch.full((sf_words(t, k),), 0x5A5A5A5A, dtype=torch.int32, device="cuda")  # poisoned
    arch = detect_arch(qr.device)
    got_a, got_sf = dispatch.run_act_quant_sf(qr, (a_fp8, sf), arch=arch)
    torch.cuda.synchronize()
    want_a, want_scale = ref.quantize_act_fp8(qr.cpu())
    finite = torch.isfinite(qr.cpu().float()).all(dim=1)  # rows with NaN/Inf: codes unspecified
    assert torch.equal(got_a.cpu().view(torch.uint8)[finite], want_a.view(torch.uint8)[finite])
    want_sf = sf_atom_layout(want_scale, t)  # the host layout the GEMM read before (pad rows 0)
    assert got_sf.dtype == torch.uint8 and got_sf.numel() == want_sf.numel()
    assert torch.equal(got_sf.cpu(), want_sf)


def test_quantizer_matches_the_plain_quantizer():
    """Same e4m3 bytes as kernels/act_quant.py (the same quantize_unit), scales = its fp32 bits."""
    qr = _qr(300, 1536, seed=1)
    a0, s0 = dispatch.run_act_quant(qr)
    a1, sf = dispatch.run_act_quant_sf(qr, arch=detect_arch(qr.device))
    torch.cuda.synchronize()
    assert torch.equal(a0.view(torch.uint8), a1.view(torch.uint8))
    assert torch.equal(sf.cpu(), sf_atom_layout(s0.cpu(), 300))
