"""The torch op's registration and fake implementation (CPU, fake CUDA tensors)."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import indexer_q.op  # noqa: F401  (registers torch.ops.indexer_q.fused_indexer_q)


def _fake_inputs(t=5, n=1024, k=1536):
    return (torch.empty(t, k, dtype=torch.bfloat16, device="cuda"),
            torch.empty(n, k, dtype=torch.uint8, device="cuda"),  # the fp8 weight's bytes
            torch.empty(n // 128, k // 128, dtype=torch.float32, device="cuda"),
            torch.empty(t, dtype=torch.int64, device="cuda"),
            torch.empty(100, 64, dtype=torch.float32, device="cuda"))


@pytest.mark.parametrize("out_format,q_shape,q_dtype,s_shape,s_dtype", [
    ("mxfp4", (5, 8, 64), torch.uint8, (5, 8), torch.int32),
    ("fp8", (5, 8, 128), torch.float8_e4m3fn, (5, 8), torch.float32),
    ("fp8-unscaled", (5, 8, 128), torch.float8_e4m3fn, (0,), torch.float32),
    ("bf16", (5, 8, 128), torch.bfloat16, (0,), torch.float32),
])
def test_fake_impl_shapes(out_format, q_shape, q_dtype, s_shape, s_dtype):
    with FakeTensorMode():
        q, s = torch.ops.indexer_q.fused_indexer_q(*_fake_inputs(), True, "rne", out_format, "", "sm_90a")
    assert (tuple(q.shape), q.dtype, q.device.type) == (q_shape, q_dtype, "cuda")
    assert (tuple(s.shape), s.dtype) == (s_shape, s_dtype)


def test_traces_into_one_graph_node():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(qr, w, s, p, cs):
        return torch.ops.indexer_q.fused_indexer_q(qr, w, s, p, cs, False, "floor-ties", "mxfp4", "", "sm_90a")

    with FakeTensorMode():
        args = _fake_inputs()
    gm = make_fx(f, tracing_mode="fake")(*args)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "indexer_q" in str(n.target)]
    assert len(calls) == 1
