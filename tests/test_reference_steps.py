"""Each exact step of SPEC.md, bit for bit, against hand-worked cases."""
import math

import pytest
import torch

from indexer_q import reference as R

BF = torch.bfloat16


def bf(values):
    return torch.tensor(values, dtype=torch.float32).to(BF)


def head(values32):
    """A bf16 head [1, 1, 128] whose first 32-block is values32 (padded with zeros)."""
    q = torch.zeros(128)
    q[: len(values32)] = torch.tensor(values32, dtype=torch.float32)
    return q.to(BF).reshape(1, 1, 128)


def unpack_codes(q_fp4):
    b = q_fp4.to(torch.int32).flatten()
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten()


def scale_bytes(q_scale):
    s = int(q_scale.flatten()[0]) & 0xFFFFFFFF
    return [(s >> (8 * i)) & 0xFF for i in range(4)]


# ------------------------------------------------------------------ ceil_log2
@pytest.mark.parametrize("k", [-30, -22, -15, -1, 0, 1, 5, 20, 100, 127])
def test_ceil_log2_at_powers_of_two_and_around(k):
    p = torch.tensor([2.0 ** k], dtype=torch.float32)
    above = torch.nextafter(p, torch.tensor([math.inf]))
    below = torch.nextafter(p, torch.tensor([0.0]))
    assert R.ceil_log2_exact(p).item() == k
    assert R.ceil_log2_exact(above).item() == k + 1
    assert R.ceil_log2_exact(below).item() == k
    assert R.ceil_log2_exact(p).dtype == torch.int32


def test_ceil_log2_non_powers():
    x = torch.tensor([3.0, 0.75, 1.5, 1e-4 / 448, 448.0, 6.0], dtype=torch.float32)
    assert R.ceil_log2_exact(x).tolist() == [2, 0, 1, -22, 9, 3]


def test_ceil_log2_nan_inf_give_byte_255():
    x = torch.tensor([math.nan, math.inf], dtype=torch.float32)
    assert (R.ceil_log2_exact(x) + 127).tolist() == [255, 255]


# ------------------------------------------------------------------ step 1
def test_act_quant_scale_and_values():
    qr = torch.zeros(2, 256)
    qr[0, :128] = 1.0
    qr[0, 5] = 448.0          # amax 448 -> s = 1 -> e = 0
    qr[0, 128:] = 0.5
    qr[0, 130] = 449.0        # bf16(449) = 448
    qr[1, 128] = 3.0          # amax 3 -> s = 3/448 -> e = ceil(log2 0.0067) = -7
    a, s = R.quantize_act_fp8(qr.to(BF))
    assert s.dtype == torch.float32 and s.shape == (2, 2)
    assert s.tolist() == [[1.0, 1.0], [2.0 ** -22, 2.0 ** -7]]
    assert a.dtype == torch.float8_e4m3fn
    assert a[0, 5].float().item() == 448.0
    assert a[1, 128].float().item() == 3.0 * 128  # 384, exact in e4m3
    assert (R.act_scale_ue8m0(qr.to(BF)) == torch.tensor([[127, 127], [105, 120]], dtype=torch.uint8)).all()


def test_act_quant_all_zero_block_uses_floor():
    a, s = R.quantize_act_fp8(torch.zeros(1, 128, dtype=BF))
    # amax floor 1e-4: s = fp32(1e-4 / 448) in (2^-23, 2^-22] -> e = -22
    assert s.item() == 2.0 ** -22
    assert (a.view(torch.uint8) == 0).all()


def test_act_quant_keeps_negative_zero_and_rne():
    qr = torch.zeros(1, 128)
    qr[0, 0] = -0.0
    qr[0, 1] = 448.0
    qr[0, 2] = 17.0        # e4m3 neighbours 16 (mantissa 000) and 18 (001): tie -> 16
    qr[0, 3] = 19.0        # neighbours 18 (001) and 20 (010): tie -> 20
    a, s = R.quantize_act_fp8(qr.to(BF))
    assert s.item() == 1.0
    bits = a.view(torch.uint8)[0]
    assert bits[0].item() == 0x80
    assert a[0, 2].float().item() == 16.0
    assert a[0, 3].float().item() == 20.0


def test_pack_ue8m0_mn_major_layout():
    sf = torch.arange(5 * 6, dtype=torch.uint8).reshape(5, 6)   # MN = 5, SF_K = 6
    packed = R.pack_ue8m0_mn_major(sf)
    assert packed.dtype == torch.int32
    assert packed.shape == (5, 2)
    assert packed.stride() == (1, 8)                            # MN padded to 8
    for m in range(5):
        for j in range(2):
            word = int(packed[m, j]) & 0xFFFFFFFF
            want = [int(sf[m, 4 * j + i]) if 4 * j + i < 6 else 0 for i in range(4)]
            assert [(word >> (8 * i)) & 0xFF for i in range(4)] == want
    # from float32 powers of two
    scale = torch.tensor([[2.0 ** -3, 1.0, 2.0 ** 4, 2.0 ** -127]])
    word = int(R.pack_ue8m0_mn_major(scale)[0, 0]) & 0xFFFFFFFF
    assert [(word >> (8 * i)) & 0xFF for i in range(4)] == [124, 127, 131, 0]


# ------------------------------------------------------------------ step 2
def test_block_scaled_gemm_small():
    a = torch.zeros(1, 256)
    a[0, 0] = 2.0
    a[0, 128] = 3.0
    w = torch.zeros(128, 256)
    w[0, 0] = 4.0
    w[0, 128] = 5.0
    w[1, 1] = 7.0
    q = R.block_scaled_gemm(a.to(torch.float8_e4m3fn), torch.tensor([[0.5, 2.0]]),
                            w.to(torch.float8_e4m3fn), torch.tensor([[2.0 ** -3, 4.0]]))
    assert q.dtype == BF and q.shape == (1, 128)
    assert q[0, 0].item() == 2 * 4 * 0.5 * 2.0 ** -3 + 3 * 5 * 2.0 * 4.0
    assert (q[0, 1:] == 0).all()


def test_round_f64_to_bf16_single_rounding():
    # 1 + 2^-8 + 2^-30 rounds to float32 1 + 2^-8, a bf16 tie that would then go to 1.0;
    # rounded once it is 1 + 2^-7.
    x = torch.tensor([1 + 2.0 ** -8 + 2.0 ** -30, 1 + 2.0 ** -8, -(1 + 3 * 2.0 ** -8)], dtype=torch.float64)
    assert R.round_f64_to_bf16(x).float().tolist() == [1 + 2.0 ** -7, 1.0, -(1 + 2 * 2.0 ** -7)]


# ------------------------------------------------------------------ step 3
def test_rope_pairs_and_untouched_dims():
    torch.manual_seed(0)
    q = torch.randn(3, 2, 128).to(BF)
    cs = torch.randn(10, 64)
    pos = torch.tensor([0, 9, 4])
    out = R.apply_rope(q, pos, cs)
    assert torch.equal(out[..., :64], q[..., :64])
    for t in range(3):
        for i in range(32):
            c, s = cs[pos[t], i], cs[pos[t], 32 + i]
            x, y = q[t, :, 64 + 2 * i].float(), q[t, :, 65 + 2 * i].float()
            assert torch.equal(out[t, :, 64 + 2 * i], (x * c - y * s).to(BF))
            assert torch.equal(out[t, :, 65 + 2 * i], (x * s + y * c).to(BF))


def test_rope_quarter_turn_swaps_pairs():
    q = torch.zeros(1, 1, 128)
    q[0, 0, 64], q[0, 0, 65] = 3.0, 5.0
    cs = torch.zeros(1, 64)
    cs[0, 0], cs[0, 32] = 0.0, 1.0    # angle pi/2 for pair 0; pairs 1.. get c = s = 0
    out = R.apply_rope(q.to(BF), torch.tensor([0]), cs)
    assert out[0, 0, 64].item() == -5.0 and out[0, 0, 65].item() == 3.0


def test_rope_out_of_range_positions_are_not_rotated():
    torch.manual_seed(1)
    q = torch.randn(3, 2, 128).to(BF)
    cs = torch.randn(4, 64)
    out = R.apply_rope(q, torch.tensor([-1, 4, 1000], dtype=torch.int32), cs)
    assert torch.equal(out, q)


# ------------------------------------------------------------------ step 4
def sylvester(n=128):
    i = torch.arange(n)
    a = i[:, None] & i[None, :]
    pc = sum(((a >> b) & 1) for b in range(7))
    return (1 - 2 * (pc % 2)).to(torch.float64)


def test_hadamard_sylvester_order_on_basis_vectors():
    eye = torch.eye(128).to(BF).reshape(128, 1, 128)
    out = R.hadamard_128(eye).reshape(128, 128).float()
    scale = R.HADAMARD_SCALE_F32
    want = (sylvester() * scale).to(torch.float32).to(BF).float()
    assert torch.equal(out, want)          # row i = H[i, :] / sqrt(128)
    assert scale == torch.tensor(128 ** -0.5, dtype=torch.float32).item()


def test_hadamard_orthonormal():
    torch.manual_seed(2)
    q = torch.randn(16, 4, 128).to(BF)
    out = R.hadamard_128(q).double()
    want = q.double() @ (sylvester() / math.sqrt(128))
    assert (out - want).abs().max().item() < 0.02 * want.abs().max().item()
    assert abs(out.norm().item() / q.double().norm().item() - 1) < 1e-2
    twice = R.hadamard_128(R.hadamard_128(q)).double()
    assert (twice - q.double()).abs().max().item() < 0.05


def test_hadamard_exact_fp32_order():
    torch.manual_seed(3)
    q = torch.randn(5, 128).to(BF)
    x = q.float().clone()
    for bit in range(7):
        h = 1 << bit
        y = x.clone()
        for i in range(128):
            if not i & h:
                y[:, i] = x[:, i] + x[:, i | h]
                y[:, i | h] = x[:, i] - x[:, i | h]
        x = y
    want = (x * torch.tensor(R.HADAMARD_SCALE_F32)).to(BF)
    assert torch.equal(R.hadamard_128(q), want)


# ------------------------------------------------------------------ step 5
TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
FLOOR_CODES = [0, 1, 2, 3, 4, 5, 6]
RNE_CODES = [0, 2, 2, 4, 4, 6, 6]


@pytest.mark.parametrize("rounding,codes", [("floor-ties", FLOOR_CODES), ("rne", RNE_CODES)])
def test_fp4_ties(rounding, codes):
    # amax 6 -> s = 1 -> e = 0: y = q exactly
    vals = [6.0] + TIES + [-t for t in TIES]
    q_fp4, q_scale = R.quantize_mxfp4(head(vals), rounding)
    got = unpack_codes(q_fp4)[: len(vals)].tolist()
    want = [7] + codes + [(c | 8) if c else 0 for c in codes]
    assert got == want
    assert scale_bytes(q_scale)[0] == 127


@pytest.mark.parametrize("rounding", ["floor-ties", "rne"])
def test_fp4_just_around_ties(rounding):
    # the bf16 neighbours just below and just above each tie (bits - 1, bits + 1)
    vals = [6.0]
    for t in TIES:
        bits = torch.tensor([t]).to(BF).view(torch.int16)
        vals += [(bits - 1).view(BF).item(), (bits + 1).view(BF).item()]
    q_fp4, _ = R.quantize_mxfp4(head(vals), rounding)
    got = unpack_codes(q_fp4)[1: len(vals)].tolist()
    want = []
    for c in range(7):
        want += [c, c + 1]
    assert got == want


def test_fp4_saturation_and_scale():
    # amax 24 -> s = 24/6 = 4 -> e = 2 (byte 129); y = q / 4: 13 -> 3.25 -> code 5, 24 -> 6 -> code 7
    vals = [13.0, -13.0, 24.0]
    q_fp4, q_scale = R.quantize_mxfp4(head(vals), "floor-ties")
    assert scale_bytes(q_scale)[0] == 129
    assert unpack_codes(q_fp4)[:3].tolist() == [5, 13, 7]


def test_fp4_saturates_at_6():
    # the scale ceil makes |y| <= 6 except through bf16; check codes via e2m1_codes directly
    y = torch.tensor([6.0, 7.0, 100.0, math.inf])
    for r in ("floor-ties", "rne"):
        assert R.e2m1_codes(y, r).tolist() == [7, 7, 7, 7]


def test_fp4_all_zero_block_and_floor():
    q = torch.zeros(1, 1, 128)
    q[0, 0, 32] = 1e-5        # block 1: below the floor 1e-4
    q[0, 0, 64] = -3e-5
    q_fp4, q_scale = R.quantize_mxfp4(q.to(BF), "rne")
    # floor: s = fp32(1e-4 / 6) -> e = ceil(log2 1.67e-5) = -15 -> byte 112
    assert scale_bytes(q_scale) == [112, 112, 112, 112]
    codes = unpack_codes(q_fp4)
    # 1e-5 * 2^15 = 0.33 -> code 1; -3e-5 * 2^15 = -0.98 -> code 2, sign
    assert codes[32].item() == 1 and codes[64].item() == 0xA
    assert (codes[:32] == 0).all()


def test_fp4_never_negative_zero():
    vals = [6.0, -0.0, -0.1, -0.25, -1e-3]
    for r in ("floor-ties", "rne"):
        q_fp4, _ = R.quantize_mxfp4(head(vals), r)
        codes = unpack_codes(q_fp4)
        assert codes[1:5].tolist() == [0, 0, 0, 0]
        assert not (codes == 8).any()


def test_fp4_nibble_order():
    vals = [6.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -6.0]
    q_fp4, _ = R.quantize_mxfp4(head(vals), "floor-ties")
    assert q_fp4.shape == (1, 1, 64) and q_fp4.dtype == torch.uint8
    assert q_fp4[0, 0, :4].tolist() == [0x17, 0x32, 0x54, 0xF6]


def test_fp4_scale_byte_order():
    q = torch.zeros(1, 1, 128)
    q[0, 0, 0] = 6.0          # block 0: e = 0    -> 127
    q[0, 0, 32] = 12.0        # block 1: e = 1    -> 128
    q[0, 0, 64] = 0.75        # block 2: e = -3   -> 124
    q[0, 0, 96] = -2.0 ** 20  # block 3: s = 2^20/6 -> e = 18 -> 145
    q_fp4, q_scale = R.quantize_mxfp4(q.to(BF), "floor-ties")
    assert q_scale.dtype == torch.int32 and q_scale.shape == (1, 1)
    assert scale_bytes(q_scale) == [127, 128, 124, 145]
    # byte 3 >= 128: the int32 is negative
    assert q_scale.item() == (127 | 128 << 8 | 124 << 16 | 145 << 24) - (1 << 32)


def test_dequantize_fp4_roundtrip():
    vals = [6.0, -0.5, 1.0, -1.5, 2.0, 3.0, -4.0]
    q_fp4, q_scale = R.quantize_mxfp4(head([v * 8 for v in vals]), "floor-ties")
    out = R.dequantize_fp4(q_fp4, q_scale)
    assert out.shape == (1, 1, 128) and out.dtype == torch.float32
    assert out[0, 0, :7].tolist() == [v * 8 for v in vals]
    assert (out[0, 0, 7:] == 0).all()


# ------------------------------------------------------------------ step 6
def test_fp8_per_head_scale_floor_and_values():
    q = torch.zeros(2, 2, 128)
    q[0, 0, 0] = 448.0        # e = 0
    q[0, 0, 1] = -17.0        # tie 16/18 -> 16 (even mantissa)
    q[0, 1, 0] = 3.0          # s = 3/448 -> e = -7: 3 * 128 = 384
    q_fp8, q_scale = R.quantize_fp8_per_head(q.to(BF))
    assert q_fp8.dtype == torch.float8_e4m3fn and q_fp8.shape == (2, 2, 128)
    assert q_scale.dtype == torch.float32 and q_scale.shape == (2, 2)
    assert q_scale.tolist() == [[1.0, 2.0 ** -7], [2.0 ** -22, 2.0 ** -22]]
    assert q_fp8[0, 0, 0].float().item() == 448.0
    assert q_fp8[0, 0, 1].float().item() == -16.0
    assert q_fp8[0, 1, 0].float().item() == 384.0
    assert (q_fp8[1].view(torch.uint8) == 0).all()


def test_fp8_unscaled_saturation_rne_negative_zero():
    q = bf([448.0, 480.0, -1e6, 464.0, 17.0, 19.0, -0.0, 0.0, -1e-6, 2.0 ** -10, 3 * 2.0 ** -10])
    out = R.quantize_fp8_unscaled(q)
    assert out.dtype == torch.float8_e4m3fn
    assert out.float()[:6].tolist() == [448.0, 448.0, -448.0, 448.0, 16.0, 20.0]
    bits = out.view(torch.uint8).tolist()
    assert bits[6] == 0x80 and bits[7] == 0x00 and bits[8] == 0x80
    # subnormals: 2^-10 is a tie between 0 and 2^-9 -> 0; 3*2^-10 -> tie 2^-9 / 2^-8 -> 2^-8
    assert out.float()[9:].tolist() == [0.0, 2.0 ** -8]
