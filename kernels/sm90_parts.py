"""What the sm_90a kernels (native and swapped-A/B) share: warp-role constants, the
WGMMA issue of a K block, the shared-storage struct, the setmaxnreg split, the K split's
reduction through distributed shared memory, the bf16 hand-off buffer's swizzle and the
trace probe's clock stamps.

Warpgroups of every sm_90a kernel: 0 = TMA producer, 1..C = MMA consumers, C+1.. =
epilogue (kernels/epilogue_sm90.py).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cutlass_dsl import T, dsl_user_op

from . import epilogue as epi
from .gemm_base import FusedIndexerQGemmBase

WARPGROUP = 128
ROWS_PER_CONSUMER = 64  # one m64 WGMMA block
SMEM_CAPACITY = 227 * 1024
EPI_BUFFERS = 2  # bf16 tiles in flight between the consumers and the epilogue warpgroup
# The epilogue's row layout by its lanes a row: 4 lanes (32 values a thread), or 8 lanes
# (16 values) so that twice the threads fit the registers one warpgroup had, or so that a
# small tile's rows spread over every thread.
ROW_LAYOUTS = {4: epi.SM90_EPI_ROW_LAYOUT, 8: epi.SM90_EPI8_ROW_LAYOUT}
WORDS_PER_ROW = 64  # a head row of bf16, two a 32-bit word
BAR_LAST_TILE_HANDED = 2  # the consumers' bf16 rows of the CTA's last tile are all in shared memory
ACCUMULATE = cute.nvgpu.warpgroup.Field.ACCUMULATE
# traced kernels (GemmConfig.trace): int64 clock stamps a CTA, in a probe's unused q output
# or after the q output (_trace_tensor); each kernel's slots are listed beside it
# (gemm_sm90.py, gemm_sm90_swap_ab.py)
TRACE_SLOTS = 64
TRACE_BLOCKS = 12  # per-block stamps (first tile): its first 12 K blocks


def issue_wgmmas(tiled_mma, acc, tCrA, tCrB, k_slices, stage=None, stage_b=None):
    """One commit group of WGMMAs: the K slices `k_slices` (of one shared-memory stage, or
    of fragments without a stage mode; `stage_b`: B's stage when it differs from A's) into
    `acc`, the first overwriting it. Returns
    `tiled_mma`, whose accumulate flag this rebinds: callers rebind it in their own body
    (`tiled_mma = issue_wgmmas(tiled_mma, ...)`), so that the tracer carries the new
    value out of a loop or branch."""
    tiled_mma.set(ACCUMULATE, False)
    cute.nvgpu.warpgroup.fence()
    for kb in k_slices:
        coord = (None, None, kb) if stage is None else (None, None, kb, stage)
        coord_b = coord if stage_b is None else (None, None, kb, stage_b)
        cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord_b], acc)
        tiled_mma.set(ACCUMULATE, True)
    cute.nvgpu.warpgroup.commit_group()
    return tiled_mma


@dsl_user_op
def opaque_i32(x, *, loc=None, ip=None) -> Int32:
    """x through a move the compiler can neither see through nor hoist."""
    return Int32(llvm.inline_asm(T.i32(), [Int32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,r",
                                 has_side_effects=True, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT))


def opaque_stage(state):
    """A consumer's pipeline state at the top of a tile, its stage index and phase made
    run-time values. Unrolled over a tile's K blocks, a ring whose stage count divides them
    (12 blocks: 3, 4 or 6 stages) returns to the same stage every tile; the compiler then
    folds every stage index and keeps each stage's descriptors live across the tile loop.
    With CUDA 13's ptxas (the device kit's) that spilled: 47 and 479 local loads and stores
    at 3 and 4 stages (V4-Pro M = 1024: 4 stages 1.6x the time of 5); computed per block as
    at 5 stages, they do not."""
    return pipeline.PipelineState(state.stages, state.count, opaque_i32(state.index), opaque_i32(state.phase))


def uniform_view(t, swizzle):
    """`t` (a shared-memory tensor whose pointer carries `swizzle`) through an address
    marked warp-uniform: WGMMA descriptors made from it right before their WGMMAs stay in
    ptxas's uniform datapath, instead of being kept in vector registers across the tile
    loop and moved (R2UR) before each WGMMA."""
    addr = cute.arch.make_warp_uniform(t.iterator.toint())
    return cute.make_tensor(cute.make_ptr(t.element_type, addr, cute.AddressSpace.smem, assumed_align=1024,
                                          swizzle_=swizzle), t.layout)


def landed_state(producer_state, behind: int):
    """The consumer-side state (index, phase) of the block the producer issued `behind`
    issues before `producer_state`: waiting on it with consumer_wait returns once that
    block's bytes have landed. Valid while behind < stages (the stage is not refilled)."""
    stages = producer_state.stages
    count = producer_state.count - behind
    return pipeline.PipelineState(stages, count, count % stages, (count // stages) % 2)


@cute.jit
def pace_loads(ab_pipeline, producer_state, in_flight: cutlass.Constexpr):
    """GemmConfig.loads_in_flight, before the producer requests its next K block: wait until
    the block requested `in_flight` before it has landed. No code without a limit."""
    if cutlass.const_expr(in_flight < producer_state.stages):
        if producer_state.count >= in_flight:
            ab_pipeline.consumer_wait(landed_state(producer_state, in_flight))


def swizzled_word(row, word):
    """Word index inside a row of a bf16 hand-off tile: the 16-byte chunk is XORed with
    row % 8, so the consumers' 4-byte and the epilogue's 16-byte accesses are both free
    of bank conflicts."""
    return ((word >> 2) ^ (row & 7)) * 4 + (word & 3)


def shared_storage(*, stages: int, split_k: int, reduce_words: int, epi_words: int, operands: list,
                   extra: list = ()):
    """The CTA's shared-memory struct: barriers, then 1024-aligned buffers. `operands`:
    [(name, dtype, elements)] of the MMA operand rings (or resident operands), last;
    `extra`: [(name, dtype, elements)] placed before them."""
    def buf(dtype, n):
        return cute.struct.Align[cute.struct.MemRange[dtype, n], 1024]

    fields = {
        "pipeline_mbar": cute.struct.MemRange[cutlass.Int64, stages * 2],
        "epi_mbar": cute.struct.MemRange[cutlass.Int64, EPI_BUFFERS * 2],
        # K split: [0, split_k - 1) "slot full" (rank 0), [split_k - 1] "slot free" (others)
        "reduce_mbar": cute.struct.MemRange[cutlass.Int64, split_k],
        "sReduce": buf(Int32, reduce_words),
        "sQ": buf(Int32, epi_words),
    }
    for name, dtype, n in list(extra) + list(operands):
        fields[name] = buf(dtype, n)
    return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))


def reduce_tensor(storage, split_k: int, values_per_thread: int):
    """Rank 0's slots for the other K-split ranks' fp32 partial tiles, [slot, chunk,
    consumer thread, 4]: 16-byte chunks, thread-minor."""
    tile = WARPGROUP * values_per_thread
    return storage.sReduce.get_tensor(cute.make_layout(
        (max(1, split_k - 1), values_per_thread // 4, WARPGROUP, 4),
        stride=(tile, WARPGROUP * 4, 4, 1)))


@cute.jit
def send_partial(acc, reduce, ctidx, tiles_done):
    """K-split rank r >= 1: once rank 0 has freed slot r-1, store this thread's fp32
    accumulators into it (st.async, completing bytes on rank 0's "slot full" barrier)."""
    full, free, sReduce = reduce
    rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
    slot = rank - 1
    cute.arch.mbarrier_wait(free, (tiles_done & 1) ^ 1)
    for c in cutlass.range_constexpr(cute.size(sReduce, mode=[1])):
        words = tuple(acc[4 * c + j].bitcast(Int32) for j in range(4))
        dst = sReduce[(slot, c, ctidx, None)].iterator
        cute.arch.store_async_dsmem(dst, words, full + slot, 0)


@cute.jit
def add_partials(acc, reduce, ctidx, tiles_done, tile_bytes: cutlass.Constexpr):
    """K-split rank 0: add ranks 1.. partial tiles in rank order, then free their slots."""
    full, free, sReduce = reduce
    slots = cute.size(sReduce, mode=[0])
    if ctidx == 0:
        for slot in cutlass.range_constexpr(slots):
            cute.arch.mbarrier_arrive_and_expect_tx(full + slot, tile_bytes)
    for slot in cutlass.range_constexpr(slots):
        cute.arch.mbarrier_wait(full + slot, tiles_done & 1)
        for c in cutlass.range_constexpr(cute.size(sReduce, mode=[1])):
            for j in cutlass.range_constexpr(4):
                acc[4 * c + j] = acc[4 * c + j] + sReduce[slot, c, ctidx, j].bitcast(Float32)
    for slot in cutlass.range_constexpr(slots):
        # cluster scope: the reads above must be done before rank slot+1 overwrites
        cute.arch.mbarrier_arrive(free, peer_cta_rank_in_cluster=slot + 1, scope=nvvm.MemScopeKind.CLUSTER)



# Reduce-scatter over a K split (swapped A/B): rank d finishes token groups [d J, (d + 1) J)
# of the tile (J groups of 8 tokens), so every rank runs the epilogue on T / S rows instead
# of rank 0 on all T. Each rank stores its fp32 partial of rank d's groups into rank d's slot
# [this rank] (st.async through distributed shared memory; its own slot with a plain store,
# read back by the same thread, so only (S - 1) / S of the tile crosses the cluster), then
# sums its S slots in rank order: the order add_partials sums in, so the bytes are those of
# the gather-to-rank-0 reduction.
def scatter_tensor(storage, split_k: int, values_per_slot: int):
    """A rank's slots, one per source rank: [source, chunk, consumer thread, 4]."""
    slot = WARPGROUP * values_per_slot
    return storage.sReduce.get_tensor(cute.make_layout(
        (split_k, values_per_slot // 4, WARPGROUP, 4), stride=(slot, WARPGROUP * 4, 4, 1)))


@cute.jit
def scatter_partial(acc, scatter, ctidx, tiles_done, groups: cutlass.Constexpr, half: cutlass.Constexpr):
    """Send side: once every rank has released its slots of the previous tile, this
    thread's accumulator chunks of rank d's token groups go to rank d's slot [this rank].
    Accumulator value i = v + 2h + 4j + half * mi (token group j, m64 block mi)."""
    full, free, sSlots = scatter
    split = cute.size(sSlots, mode=[0])
    rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
    cute.arch.mbarrier_wait(free, (tiles_done & 1) ^ 1)
    for d in cutlass.range_constexpr(split):  # the other ranks' groups first: they travel
        if d != rank:
            for mi in cutlass.range_constexpr(2):
                for jl in cutlass.range_constexpr(groups):
                    i0 = 4 * (d * groups + jl) + half * mi
                    words = tuple(acc[i0 + k].bitcast(Int32) for k in range(4))
                    dst = sSlots[(rank, jl + groups * mi, ctidx, None)].iterator
                    cute.arch.store_async_dsmem(dst, words, full, d)
    for d in cutlass.range_constexpr(split):
        if d == rank:
            for mi in cutlass.range_constexpr(2):
                for jl in cutlass.range_constexpr(groups):
                    i0 = 4 * (d * groups + jl) + half * mi
                    for k in cutlass.range_constexpr(4):
                        sSlots[rank, jl + groups * mi, ctidx, k] = acc[i0 + k].bitcast(Int32)


@cute.jit
def gather_partials(mine, scatter, ctidx, tiles_done, slot_bytes: cutlass.Constexpr):
    """Receive side: `mine` [chunk * 4 + k] = the sum over source ranks, in rank order, of
    this rank's token groups; then release this rank's slots to every source. The other
    S - 1 ranks' bytes complete on `full`; this rank's own slot was written by this very
    thread (scatter_partial), so program order covers it."""
    full, free, sSlots = scatter
    split = cute.size(sSlots, mode=[0])
    if ctidx == 0:
        cute.arch.mbarrier_arrive_and_expect_tx(full, slot_bytes * (split - 1))
    cute.arch.mbarrier_wait(full, tiles_done & 1)
    for c in cutlass.range_constexpr(cute.size(sSlots, mode=[1])):
        for k in cutlass.range_constexpr(4):
            v = sSlots[0, c, ctidx, k].bitcast(Float32)
            for src in cutlass.range_constexpr(1, split):
                v = v + sSlots[src, c, ctidx, k].bitcast(Float32)
            mine[4 * c + k] = v
    for d in cutlass.range_constexpr(split):
        # cluster scope: the reads above must be done before rank d writes the next tile
        cute.arch.mbarrier_arrive(free, peer_cta_rank_in_cluster=d, scope=nvvm.MemScopeKind.CLUSTER)


class Sm90KernelBase(FusedIndexerQGemmBase):
    """Warp roles and the setmaxnreg split of an sm_90a kernel. Subclasses set
    num_consumers, epi_wgs, tc_hadamard and the epilogue's row layout before calling
    _setup_roles()."""

    arch = "sm_90a"

    def _setup_roles(self, lanes_per_row: int):
        self.epi_wg = 1 + self.num_consumers  # the first epilogue warpgroup
        self.threads = WARPGROUP * (1 + self.num_consumers + self.epi_wgs)
        self.row_layout = ROW_LAYOUTS[lanes_per_row]
        self.lanes_per_row = lanes_per_row
        self.rows_per_pass = self.epi_wgs * WARPGROUP // lanes_per_row
        self._split_registers()

    def _split_registers(self):
        """setmaxnreg budgets. They move registers inside the CTA's launch allocation
        (ptxas's entry register count, 65536 / threads rounded down to 8, x threads): a
        split that needs more makes the consumers' increase wait forever (seen on the
        H200). tests/test_compile.py checks the split against the entry count ptxas chose."""
        launch = (65536 // self.threads) // 8 * 8
        self.launch_regs = launch
        pool = launch * self.threads
        # The tensor-core Hadamard keeps a 64-value accumulator and 32 words of A operand
        # live in the epilogue: it takes the producer's spare registers.
        self.producer_regs = 40 if self.epi_wgs == 1 and not self.tc_hadamard else 24
        if self.num_consumers == 1:
            self.consumer_regs = 232
        else:  # two accumulators of 64 a thread, plus addressing
            # two epilogue warpgroups: 72 registers each (their rows at 4 lanes, no spills)
            self.consumer_regs = 168 if self.epi_wgs == 1 else 152
        rest = pool - WARPGROUP * (self.producer_regs + self.num_consumers * self.consumer_regs)
        self.epilogue_regs = min(160 if self.tc_hadamard else 128, rest // (WARPGROUP * self.epi_wgs) // 8 * 8)
        total = WARPGROUP * (self.producer_regs + self.num_consumers * self.consumer_regs
                             + self.epi_wgs * self.epilogue_regs)
        assert total <= pool and self.epilogue_regs >= 64, (
            f"setmaxnreg budgets: {total} of {pool} registers, epilogue {self.epilogue_regs}")

    def _set_epilogue_registers(self):
        # setmaxnreg.dec may only lower the count (raising is an illegal instruction)
        if cutlass.const_expr(self.epilogue_regs > self.launch_regs):
            cute.arch.setmaxregister_increase(self.epilogue_regs)
        else:
            cute.arch.setmaxregister_decrease(self.epilogue_regs)

    def _loads_in_flight(self, stages: int) -> int:
        """GemmConfig.loads_in_flight on a ring of `stages` (0, or more than fit: the ring's depth)."""
        return min(self.config.loads_in_flight or stages, stages)

    def _trace_tensor(self, out_q):
        """Traced kernels only: this CTA's TRACE_SLOTS int64 slots, in the q output of a probe
        (which writes no q), right after the q output otherwise (the caller's buffer holds
        both: tuning/trace_decode.py); None when the kernel is not traced."""
        if not self.config.trace:
            return None
        bx, by, bz = cute.arch.block_idx()
        gx, gy, _ = cute.arch.grid_dim()
        cta = bx + gx * (by + gy * bz)
        base = out_q.iterator
        if self.config.epilogue:
            base = base + cute.cosize(out_q.layout)
        return cute.make_tensor(cute.recast_ptr(base, dtype=Int64) + cta * TRACE_SLOTS, cute.make_layout(TRACE_SLOTS))

    @cute.jit
    def _stamp(self, trace, slot, thread, global_timer: cutlass.Constexpr = False):
        """Trace probes only: thread 0 of a role writes the SM clock (or the global ns
        timer) into its CTA's slot. No code when the kernel is not traced."""
        if cutlass.const_expr(trace is not None):
            if thread == 0:
                if cutlass.const_expr(global_timer):
                    trace[slot] = cute.arch.globaltimer()
                else:
                    trace[slot] = cute.arch.clock64()
