"""How fast a K split's partial tile crosses a cluster of two CTAs: `python -m
tuning.dsmem_probe` (GPU). Not a package kernel: a measuring tool, like wgmma_pace.

Each cluster of 2 (one CTA an SM, 128 threads a CTA, as one consumer warpgroup) runs ROUNDS
rounds of the K split's hand-off (kernels/sm90_parts.py): rank 1 sends B bytes of fp32 held
in registers to rank 0's slot; rank 0 waits for them, adds them, and frees the slot (one
remote arrive a thread, as add_partials). Ways of sending:

- `st_async`: the kernels' own code (`sm90_parts.send_partial` / `add_partials`): each
  thread `st.async`s its values 16 bytes at a time into the peer's slot, every store
  completing its bytes on the peer's barrier;
- `bulk`: the values stored to the sender's own shared memory, a proxy fence and a CTA
  barrier, then one `cp.async.bulk.shared::cluster.shared::cta` of B bytes (one completion);
- `global`: through L2 instead: 16-byte global stores, a CTA barrier, a cluster-scope fence
  and one remote arrive; rank 0 then loads them with `ld.global.cg` (L2, not a stale L1);
- `remote_arrive`: no bytes, the handshake alone (what the rounds cost besides the data).

Printed per case: cycles a round on rank 0's SM clock (median cluster, and the slowest), and
bytes a cycle. `--clusters 66` loads every SM pair at once, as the kernel's K split does;
`--clusters 1` shows one pair alone."""
from __future__ import annotations

import argparse
import statistics

import cutlass
import cutlass.cute as cute
from cutlass import AddressSpace, Float32, Int32, Int64
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cute.typing import Pointer
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.memory import SmemAllocator

from indexer_q.kernels.sm90_parts import add_partials, reduce_tensor, send_partial

WARPGROUP = 128
ROUNDS = 32
METHODS = ("st_async", "bulk", "global", "remote_arrive")


@dsl_user_op
def bulk_copy_to_peer(dst: Pointer, src: Pointer, mbar: Pointer, peer, size: int, *, loc=None, ip=None) -> None:
    """cp.async.bulk of `size` bytes from this CTA's `src` to `dst` in CTA `peer` of the
    cluster (the same offset there), completing them on `mbar` there."""
    dsmem = llvm.PointerType.get(AddressSpace.dsmem)
    rank = Int32(peer).ir_value(loc=loc, ip=ip)
    remote_dst = nvvm.mapa(dsmem, dst.to_llvm_ptr(loc=loc, ip=ip), rank, loc=loc, ip=ip)
    remote_bar = nvvm.mapa(dsmem, mbar.to_llvm_ptr(loc=loc, ip=ip), rank, loc=loc, ip=ip)
    # NVVM types the barrier operand as a shared::cta pointer, but PTX reads it as a
    # shared::cluster address: the peer's barrier is passed as its cluster address's value
    remote_bar = llvm.inttoptr(llvm.PointerType.get(AddressSpace.smem),
                               llvm.ptrtoint(T.i32(), remote_bar, loc=loc, ip=ip), loc=loc, ip=ip)
    nvvm.cp_async_bulk_shared_cluster_shared_cta(remote_dst, src.to_llvm_ptr(loc=loc, ip=ip), remote_bar,
                                                 Int32(size).ir_value(loc=loc, ip=ip), loc=loc, ip=ip)


@dsl_user_op
def st_global_v4(addr: Int64, words, *, loc=None, ip=None) -> None:
    llvm.inline_asm(None, [Int64(addr).ir_value(loc=loc, ip=ip)] + [Int32(w).ir_value(loc=loc, ip=ip) for w in words],
                    "st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def ld_global_cg_v4(addr: Int64, *, loc=None, ip=None):
    """Four words from L2 (`.cg`: not cached in L1, where an earlier round's line could be)."""
    quad = llvm.inline_asm(llvm.StructType.get_literal([T.i32()] * 4), [Int64(addr).ir_value(loc=loc, ip=ip)],
                           "ld.global.cg.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", has_side_effects=True,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return tuple(Int32(llvm.extractvalue(T.i32(), quad, [j], loc=loc, ip=ip)) for j in range(4))


class DsmemProbe:
    def __init__(self, method: str, nbytes: int):
        assert method in METHODS and nbytes % (16 * WARPGROUP) == 0
        self.method, self.nbytes = method, nbytes
        self.values = nbytes // 4 // WARPGROUP  # fp32 a thread

    @cute.jit
    def __call__(self, out: cute.Tensor, scratch: cute.Tensor, clusters: cutlass.Constexpr):
        words = self.nbytes // 4

        @cute.struct
        class Storage:
            bars: cute.struct.MemRange[Int64, 2]  # [0] slot full (rank 0), [1] slot free (rank 1)
            sReduce: cute.struct.Align[cute.struct.MemRange[Int32, words], 1024]  # rank 0's slot
            staging: cute.struct.Align[cute.struct.MemRange[Int32, words], 1024]

        self.kernel(out, scratch, Storage).launch(grid=(2 * clusters, 1, 1), block=(WARPGROUP, 1, 1), cluster=(2, 1, 1),
                                         smem=Storage.size_in_bytes())

    @cute.kernel
    def kernel(self, out: cute.Tensor, scratch: cute.Tensor, Storage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        st = SmemAllocator().allocate(Storage)
        full = st.bars.data_ptr()
        free = full + 1
        chunks = self.values // 4
        # [slot 0, chunk, thread, 4]: the kernels' K split in 2 (16-byte chunks, thread-minor)
        slot = reduce_tensor(st, 2, self.values)
        reduce = (full, free, slot)
        staging = st.staging.get_tensor(slot.layout)
        mine = scratch[bidx // 2, None, None, None]  # this cluster's partial in global memory (`global`)
        if tidx == 0:
            cute.arch.mbarrier_init(full, WARPGROUP if self.method == "remote_arrive" else 1)
            cute.arch.mbarrier_init(free, WARPGROUP)
        cute.arch.mbarrier_init_fence()
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        acc = cute.make_rmem_tensor(self.values, Float32)
        for i in cutlass.range_constexpr(self.values):
            acc[i] = Float32(tidx + i + bidx)
        start = cute.arch.clock64()
        first = start
        for r in cutlass.range(ROUNDS):
            if rank == 0:
                if cutlass.const_expr(self.method in ("st_async", "bulk")):
                    add_partials(acc, reduce, tidx, r, self.nbytes)  # bytes completing on `full`
                else:
                    cute.arch.mbarrier_wait(full, r & 1)
                    if cutlass.const_expr(self.method == "global"):
                        cute.arch.fence_acq_rel_cluster()
                        for c in cutlass.range_constexpr(chunks):
                            words = ld_global_cg_v4(mine[(c, tidx, None)].iterator.toint())
                            for j in cutlass.range_constexpr(4):
                                acc[4 * c + j] = acc[4 * c + j] + words[j].bitcast(Float32)
                    cute.arch.mbarrier_arrive(free, peer_cta_rank_in_cluster=1, scope=nvvm.MemScopeKind.CLUSTER)
                if r == 0:
                    first = cute.arch.clock64()
            elif cutlass.const_expr(self.method == "st_async"):
                send_partial(acc, reduce, tidx, r)  # waits until rank 0 has read the previous round
            else:
                cute.arch.mbarrier_wait(free, (r & 1) ^ 1)  # rank 0 has read the previous round
                if cutlass.const_expr(self.method == "bulk"):
                    if tidx == 0:
                        cute.arch.cp_async_bulk_wait_group(0, read=True)  # the last copy has read staging
                    cute.arch.sync_threads()
                    for c in cutlass.range_constexpr(chunks):
                        for j in cutlass.range_constexpr(4):
                            staging[0, c, tidx, j] = acc[4 * c + j].bitcast(Int32)
                    cute.arch.fence_proxy("async.shared", space="cta")
                    cute.arch.sync_threads()
                    if tidx == 0:
                        bulk_copy_to_peer(st.sReduce.data_ptr(), st.staging.data_ptr(), full, 0, self.nbytes)
                        cute.arch.cp_async_bulk_commit_group()
                elif cutlass.const_expr(self.method == "global"):
                    for c in cutlass.range_constexpr(chunks):
                        st_global_v4(mine[(c, tidx, None)].iterator.toint(),
                                     tuple(acc[4 * c + j].bitcast(Int32) for j in range(4)))
                    cute.arch.sync_threads()
                    if tidx == 0:
                        cute.arch.fence_acq_rel_cluster()
                        cute.arch.mbarrier_arrive(full, peer_cta_rank_in_cluster=0, scope=nvvm.MemScopeKind.CLUSTER)
                else:
                    cute.arch.mbarrier_arrive(full, peer_cta_rank_in_cluster=0, scope=nvvm.MemScopeKind.CLUSTER)
            if rank == 1:
                for i in cutlass.range_constexpr(self.values):
                    acc[i] = acc[i] + Float32(1.0)  # new values each round
        end = cute.arch.clock64()
        if rank == 1:
            cute.arch.mbarrier_wait(free, (ROUNDS & 1) ^ 1)  # no remote arrive may target an exited CTA
            if cutlass.const_expr(self.method == "bulk"):
                if tidx == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=False)
        total = Float32(0.0)
        for i in cutlass.range_constexpr(self.values):
            total = total + acc[i]
        if rank == 0:
            if tidx == 0:
                out[bidx // 2, 0] = end - start
                out[bidx // 2, 1] = first - start
                out[bidx // 2, 2] = Int64(total == Float32(-1.0))  # keeps the sums live


def main(argv=None):
    import torch
    from cutlass.cute.runtime import from_dlpack

    ap = argparse.ArgumentParser(prog="python -m tuning.dsmem_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kib", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--clusters", type=int, nargs="+", default=[66, 1])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    args = ap.parse_args(argv)
    for clusters in args.clusters:
        for kib in args.kib:
            for method in args.methods:
                if method == "remote_arrive" and kib != args.kib[0]:
                    continue
                probe = DsmemProbe(method, kib * 1024)
                out = torch.zeros(clusters, 3, dtype=torch.int64, device="cuda")
                scratch = torch.zeros(clusters, probe.values // 4, WARPGROUP, 4, dtype=torch.int32, device="cuda")
                kernel = cute.compile(probe, from_dlpack(out), from_dlpack(scratch, assumed_align=16), clusters)
                per_round, firsts = [], []
                for _ in range(5):
                    out.zero_()
                    kernel(from_dlpack(out), from_dlpack(scratch, assumed_align=16))
                    torch.cuda.synchronize()
                    spans = sorted(out[:, 0].tolist())
                    per_round.append((spans[len(spans) // 2] / ROUNDS, spans[-1] / ROUNDS))
                    firsts.append(sorted(out[:, 1].tolist())[clusters // 2])
                med = statistics.median(p[0] for p in per_round)
                slow = statistics.median(p[1] for p in per_round)
                data = 0 if method == "remote_arrive" else kib * 1024
                print(f"clusters {clusters:3d} {kib:3d} KiB {method:13s}: {med:7.0f} cycles a round (slowest "
                      f"{slow:7.0f}), {data / med:6.1f} B/cycle; first round {statistics.median(firsts):7.0f}",
                      flush=True)


if __name__ == "__main__":
    main()
