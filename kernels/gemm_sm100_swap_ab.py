"""Blackwell (sm_100a) fused indexer-Q kernel, swapped-A/B tactic. Compiled and checked on
the CPU (tcgen05 block-scaled MMA in its PTX); no Blackwell GPU has run it yet.

q^T = W * a^T: `tcgen05.mma ... kind::mxf8f6f4.block_scale` with the weight as A (a head's
128 rows fill the MMA's M = 128) and a tile of T tokens as B (the MMA's N), the UE8M0
scale factors swapped to match (SFA = the weight's, SFB = the activation's: the same
atom-layout bytes the native kernel reads, in the other roles). One CTA takes (one head,
one token tile), all of K; T = 128, so that the activation's scale-factor atoms (128
rows) tile the token tile exactly (TOKEN_TILES says why not smaller or larger yet).

Warps as the native kernel's: 5 = TMA, 4 = MMA (scale factors to tensor memory, then
the MMAs into a TMEM accumulator of 128 lanes (dims) x T columns (tokens), one or two
stages), 0-3 = epilogue: they read the accumulator 32 columns at a time (`tcgen05.ld
32x32b`, one dim a thread), round it to bf16 (SPEC step 2) and write it transposed to
token rows in shared memory; then each thread takes a token row and runs the shared
epilogue (kernels/epilogue.py, SM100_ROW_LAYOUT: one whole row a thread).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import tcgen05

from . import epilogue as epi
from .gemm_base import SCALE_BLOCK_K, GemmConfig
from .gemm_sm100 import SF_VEC, SMEM_CAPACITY, Sm100FusedIndexerQ, row_epilogue

# Token tiles: whole 128-row scale-factor atoms of the tokens on the MMA's N (a smaller N
# would need the SFB tensor-memory offset of a sub-atom, which nothing here can check
# without a Blackwell GPU). 256 compiles but spills (32 bytes: two token rows a thread
# beside the 255-register epilogue), so it is not offered.
TOKEN_TILES = (128,)
EPI_WARPS = (0, 1, 2, 3)
MMA_WARP = 4
TMA_WARP = 5
TMEM_COLUMNS = 512
CHUNK = 32  # accumulator columns (tokens) a tcgen05.ld brings to registers at once
WORDS_PER_ROW = epi.HEAD_DIM // 2  # a token row of bf16 in the hand-off buffer


def swizzled_word(row, word):
    """16-byte chunks XORed with row % 8: the transposing 2-byte stores (a warp, one token
    row) and the row reads (a thread, one row) stay free of bank conflicts."""
    return ((word >> 2) ^ (row & 7)) * 4 + (word & 3)


def acc_stages(tile: int) -> int:
    """TMEM accumulator stages that fit beside the scale factors (512 columns)."""
    return 2 if 2 * tile + 16 <= TMEM_COLUMNS else 1


class Sm100SwapABFusedIndexerQ(Sm100FusedIndexerQ):
    supported_kinds = ("swap_ab",)
    ptx_signature = ("tcgen05.mma block_scale, weight as A",
                     "tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale")

    @classmethod
    def config_problems(cls, config: GemmConfig) -> list[str]:
        out = [p for p in super().config_problems(config) if not p.startswith("tile_m=")]
        if config.tile_m not in TOKEN_TILES:
            out.append(f"tile_m={config.tile_m} (sm_100a swap_ab: {TOKEN_TILES}, whole 128-row "
                       "scale-factor atoms of the tokens on the MMA's N)")
        if config.fused_act_quant:
            out.append("fused_act_quant is sm_90a only (sm_100a reads the quantizer's scale-factor layout)")
        return out

    @staticmethod
    def max_stages(config: GemmConfig) -> int:
        ab = (epi.HEAD_DIM + config.tile_m) * SCALE_BLOCK_K
        sf = (epi.HEAD_DIM + config.tile_m) * SCALE_BLOCK_K // SF_VEC
        epi_bytes = config.tile_m * epi.HEAD_DIM * 2
        return (SMEM_CAPACITY - epi_bytes - 2048) // (ab + sf)

    def __init__(self, config: GemmConfig):
        super().__init__(config)
        self.stages = config.stages or min(self.max_stages(config), 8)
        self.mma_tiler_mn = (epi.HEAD_DIM, config.tile_m)
        self.acc_stages = acc_stages(config.tile_m)
        self.weight_is_a = True

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # fp8 [M, K], K-major: the MMA's B
        sfa_bytes: cute.Tensor,  # uint8, the activation's UE8M0 bytes in the atom layout: SFB
        w: cute.Tensor,  # fp8 [N, K], K-major: the MMA's A
        sfw_bytes: cute.Tensor,  # uint8, the weight's UE8M0 bytes in the atom layout: SFA
        positions: cute.Tensor,
        cos_sin: cute.Tensor,
        out_q: cute.Tensor,
        out_scale: cute.Tensor,
        max_active_clusters: cutlass.Constexpr,
        stream,
    ):
        m = a.shape[0]
        n = w.shape[0]
        # the weight and its scale factors on A, the tokens and theirs on B
        operands = self._setup_operands(w, sfw_bytes, a, sfa_bytes)
        # scheduler tiles: (token tiles, heads)
        tiles_mnl = (cute.ceil_div(m, self.mma_tiler[1]), n // self.mma_tiler[0], 1)
        self.shared_storage = self._shared_storage(w.element_type, a.element_type,
                                                   self.config.tile_m * WORDS_PER_ROW)
        self._launch(operands, tiles_mnl, positions, cos_sin, out_q, out_scale, m, max_active_clusters, stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self, tiled_mma: cute.TiledMma, cluster_layout_vmnk: cute.Layout, tma_a: cute.CopyAtom,
        mA: cute.Tensor, tma_b: cute.CopyAtom,
        mB: cute.Tensor, tma_sfa: cute.CopyAtom, mSFA: cute.Tensor, tma_sfb: cute.CopyAtom, mSFB: cute.Tensor,
        a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout, sfa_smem_staged: cute.Layout,
        sfb_smem_staged: cute.Layout, sched_params: utils.PersistentTileSchedulerParams,
        positions: cute.Tensor, cos_sin: cute.Tensor, out_q: cute.Tensor, out_scale: cute.Tensor, m: Int32,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == TMA_WARP:
            for atom in (tma_a, tma_b, tma_sfa, tma_sfb):
                cute.nvgpu.cpasync.prefetch_descriptor(atom)

        (storage, ab_pipeline, acc_pipeline, tmem, k_tiles, loads, tCrA, tCrB, sSFA, sSFB,
         tCtAcc_fake) = self._device_setup(
            tiled_mma, cluster_layout_vmnk, tma_a, mA, tma_b, mB, tma_sfa, mSFA, tma_sfb, mSFB,
            a_smem_staged, b_smem_staged, sfa_smem_staged, sfb_smem_staged)

        if warp_idx == TMA_WARP:
            self._producer(ab_pipeline, k_tiles, sched_params, *loads)
        if warp_idx == MMA_WARP:
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(Float32)
            self._mma(tiled_mma, ab_pipeline, acc_pipeline, k_tiles, sched_params, acc_ptr, tCtAcc_fake,
                      tCrA, tCrB, sSFA, sSFB, sfa_smem_staged, sfb_smem_staged)
        if warp_idx < MMA_WARP:
            tmem.allocate(TMEM_COLUMNS)
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(Float32)
            sQ = storage.sQ.get_tensor(cute.make_layout((self.config.tile_m, WORDS_PER_ROW),
                                                        stride=(WORDS_PER_ROW, 1)))
            self._epilogue(acc_pipeline, sched_params, cute.make_tensor(acc_ptr, tCtAcc_fake.layout), sQ, tidx,
                           positions, cos_sin, out_q, out_scale, m)
            tmem.relinquish_alloc_permit()
            self.epilog_barrier.arrive_and_wait()
            tmem.free(acc_ptr)

    @cute.jit
    def _epilogue(self, acc_pipeline, sched_params, acc, sQ, tidx, positions, cos_sin, out_q, out_scale, m):
        t = self.config.tile_m
        # 32 columns (tokens) at a time, one TMEM lane (= dim) a thread
        atom = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), Float32)
        acc_tile = acc[((None, None), 0, 0, None)]  # (128 dims, T tokens, stage)
        chunks = cute.flat_divide(acc_tile, (epi.HEAD_DIM, CHUNK))  # (128, 32, 1, T/32, stage)
        t2r = tcgen05.make_tmem_copy(atom, chunks[(None, None, 0, 0, 0)])
        thr = t2r.get_slice(tidx)
        tTR_tAcc = thr.partition_S(chunks)
        tTR_cAcc = thr.partition_D(cute.make_identity_tensor((epi.HEAD_DIM, CHUNK)))
        regs = cute.make_rmem_tensor(tTR_cAcc.shape, Float32)
        sQ16 = cute.make_tensor(cute.recast_ptr(sQ.iterator, dtype=cutlass.Int16),
                                cute.make_layout((t, 2 * WORDS_PER_ROW), stride=(2 * WORDS_PER_ROW, 1)))
        layout = epi.SM100_ROW_LAYOUT
        num_pos = cos_sin.shape[0]
        zero = Int32(0)
        dim = tidx  # this thread's accumulator lane
        if cutlass.const_expr(self.config.pdl):
            cute.arch.griddepcontrol_wait()  # positions / cos_sin: nothing before the quantizer writes them

        sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(),
                                                           cute.arch.grid_dim())
        work = sched.initial_work_tile_info()
        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.acc_stages)
        while work.is_valid_tile:
            row0 = work.tile_idx[0] * t
            head = work.tile_idx[1]
            # cos/sin of this thread's first token row, requested before the tile is ready
            cs = epi.load_cos_sin(layout, row0 + tidx, m, num_pos, positions, cos_sin, zero)
            acc_pipeline.consumer_wait(acc_state)
            for c in cutlass.range_constexpr(t // CHUNK):
                cute.copy(t2r, tTR_tAcc[(None, None, None, 0, c, acc_state.index)], regs)
                for j in cutlass.range_constexpr(0, CHUNK, 2):  # tokens 32c + j, + 1 of this dim
                    word = epi.bf16x2_word(regs[j], regs[j + 1])
                    for v in cutlass.range_constexpr(2):
                        tok = c * CHUNK + j + v
                        sQ16[tok, swizzled_word(tok, dim >> 1) * 2 + (dim & 1)] = cutlass.Int16(word >> (16 * v))
            cute.arch.fence_view_async_tmem_load()
            acc_pipeline.consumer_release(acc_state)  # the MMA warp may reuse this stage now
            acc_state.advance()
            self.epilog_barrier.arrive_and_wait()  # the token rows are in shared memory
            if cutlass.const_expr(t > 32 * len(EPI_WARPS)):  # a second row a thread: as a loop, not unrolled
                for p in cutlass.range(1, t // (32 * len(EPI_WARPS)), unroll=1):  # (unrolled, it spilled)
                    r = p * 32 * len(EPI_WARPS) + tidx
                    cs_p = epi.load_cos_sin(layout, row0 + r, m, num_pos, positions, cos_sin, zero)
                    self._row_epilogue(sQ, r, cs_p, row0, m, head, out_q, out_scale)
            self._row_epilogue(sQ, tidx, cs, row0, m, head, out_q, out_scale)
            self.epilog_barrier.arrive_and_wait()  # every row read before the next tile's writes
            sched.advance_to_next_work()
            work = sched.get_current_work()

    def _row_epilogue(self, sQ, r, cs, row0, m, head, out_q, out_scale):
        """SPEC steps 3-6 on token row r of the tile (one whole row a thread)."""
        words = [sQ[r, swizzled_word(r, w)] for w in range(WORDS_PER_ROW)]
        row_epilogue(words, cs, self.config, row0 + r, m, head, out_q, out_scale)  # 16-byte stores
