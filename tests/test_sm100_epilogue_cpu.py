"""The sm_100a kernel's own epilogue parts, modelled on the CPU (the kernel itself only
compiles here): the Hadamard with packed fp32x2 butterflies is the SPEC's butterfly."""
from __future__ import annotations

import numpy as np
import torch

from indexer_q import reference as R


def _other_order(q, order):
    """The butterfly stages in another order (what a wrong kernel would compute)."""
    x = q.float()
    for bit in order:
        h = 1 << bit
        xv = x.reshape(-1, 128 // (2 * h), 2, h)
        x = torch.stack((xv[:, :, 0, :] + xv[:, :, 1, :], xv[:, :, 0, :] - xv[:, :, 1, :]), 2).reshape(-1, 128)
    return (x * torch.tensor(128 ** -0.5, dtype=torch.float32)).to(torch.bfloat16)


def test_packed_hadamard_is_the_reference_butterfly(monkeypatch):
    """hadamard_row_packed with each packed fp32x2 operation as two numpy float32 ones (what
    `add/sub/mul.rn.f32x2` compute: two IEEE fp32 results, each rounded on its own) gives the
    reference's bf16 bytes on 4096 rows: the pairing of butterflies into packed operations
    keeps each value's operands and their order. (The rows are such that the stages in
    another order give other bytes: checked below.)"""
    from indexer_q.kernels import gemm_sm100 as k

    ops = {"add": np.add, "sub": np.subtract, "mul": np.multiply}

    def f32x2(op, a0, a1, b0, b1):
        f = ops[op]
        return f(a0, np.float32(b0)), f(a1, np.float32(b1))

    def bf16_word(lo, hi):  # a word modelled as its two bf16 values
        return tuple(torch.from_numpy(np.asarray(v, dtype=np.float32)).to(torch.bfloat16).float().numpy()
                     for v in (lo, hi))

    monkeypatch.setattr(k, "_f32x2", f32x2)
    monkeypatch.setattr(k, "_bf16_word", bf16_word)
    g = torch.Generator().manual_seed(0)
    scales = torch.pow(2.0, torch.randint(-12, 12, (4096, 128), generator=g).float())
    rows = torch.randn(4096, 128, generator=g) * scales
    rows[0] = torch.arange(128)
    rows[1] = 1.0  # cancels to zero everywhere but column 0
    q = rows.to(torch.bfloat16)
    want = R.hadamard_128(q).view(torch.int16)
    cols = [q[:, c].float().numpy() for c in range(128)]  # one value a column, all rows at once
    words = k.hadamard_row_packed(cols)
    got = torch.stack([torch.from_numpy(np.asarray(v, dtype=np.float32)) for w in words for v in w], 1)
    assert torch.equal(got.to(torch.bfloat16).view(torch.int16), want)
    for order in ([6, 5, 4, 3, 2, 1, 0], [0, 2, 1, 3, 4, 5, 6]):  # the data tells orders apart
        assert not torch.equal(_other_order(q, order).view(torch.int16), want), order
