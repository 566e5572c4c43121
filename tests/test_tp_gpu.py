"""Tensor parallelism over heads (issue 4): two ranks on two GPUs, NCCL, TP = 2, each
projecting its 32 heads with its half of the weight; the all-gathered output equals the
TP = 1 output byte for byte. Marked gpu; skipped with fewer than two GPUs."""
from __future__ import annotations

import os
import socket

import pytest
import torch

pytestmark = pytest.mark.gpu

HEADS, K = 64, 1536
# the same tactic on both sides: sharding heads must not change a single byte (a K split
# would change the accumulation order, so it is compared only where both sides take it)
CASES = [(1, "tile_m=64"), (7, "tile_m=64,split_k=2"), (1000, "tile_m=128"), (4096, "")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, results):
    import dataclasses

    import torch.distributed as dist

    import indexer_q
    from indexer_q.tactics import heuristic
    from indexer_q.testing import make_inputs
    from tuning.bench import parse_fields

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        for m, spec in CASES:
            x = make_inputs(m, HEADS * 128, K, p=4096, seed=m, device="cuda")  # same on every rank
            shard = slice(rank * HEADS * 128 // world, (rank + 1) * HEADS * 128 // world)
            n_shard = HEADS * 128 // world
            fields = parse_fields(spec) if spec else {}
            t_shard = dataclasses.replace(heuristic("sm_90a", m, n_shard, K), **fields) if spec else None
            w = indexer_q.prepare_weights(x["weight"][shard], x["weight_scale"][shard.start // 128:shard.stop // 128])
            q, s = indexer_q.fused_indexer_q(x["qr"], w, x["positions"], x["cos_sin"], hadamard=True, tactic=t_shard)
            qs = [torch.empty_like(q) for _ in range(world)]
            ss = [torch.empty_like(s) for _ in range(world)]
            dist.all_gather(qs, q.contiguous())
            dist.all_gather(ss, s.contiguous())
            if rank == 0:
                full = indexer_q.prepare_weights(x["weight"], x["weight_scale"])
                t_full = dataclasses.replace(heuristic("sm_90a", m, HEADS * 128, K), **fields) if spec else None
                q1, s1 = indexer_q.fused_indexer_q(x["qr"], full, x["positions"], x["cos_sin"], hadamard=True,
                                                   tactic=t_full)
                qg, sg = torch.cat(qs, dim=1), torch.cat(ss, dim=1)
                results.append((m, spec, torch.equal(qg, q1), torch.equal(sg, s1),
                                (qg == q1).double().mean().item()))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_tp2_gathered_output_equals_tp1():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.list()
        mp.spawn(_rank_main, args=(2, _free_port(), results), nprocs=2, join=True)
        results = list(results)
    for r in results:
        print("TP2 M=%d tactic=%r q equal=%s scales equal=%s (%.6f)" % r)
    assert len(results) == len(CASES)
    for m, spec, q_eq, s_eq, frac in results:  # M = 4096: both sides' default is one 128-row tile
        assert q_eq and s_eq, (m, spec, frac)
