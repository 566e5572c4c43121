"""How fast one SM works the swapped kernel's K blocks, with nothing else on it: `python -m
tuning.wgmma_pace` (GPU). A block is the 128 x 128 e4m3 weight tile as the A operand and T
tokens as B: 8 WGMMAs m64nTk32, two blocks in flight as the pipelined K loop keeps them
(`kernels/swap_ab_kloop_sm90.py`), each block promoted into an accumulator once it is done (as
the kernel does; it also keeps every block live: ptxas replaces WGMMAs whose partial is
overwritten unread by empty ones, which made the first version of this tool read 39 cycles).
Three ways, cycles a block (SM clock, median of 5 launches):

- SS: A read from shared memory by the WGMMAs (the kernels' way);
- RS: A first loaded into registers by `ldmatrix` from the same swizzled tile, the WGMMAs
  reading only B from shared memory;
- either with a second warpgroup storing to shared memory throughout (`writers`), as the
  ring's TMA writes share the SM's shared-memory bandwidth in the kernel.

The twenty-eighth session's traces (NOTES version 113) put the kernel's pace at ~275 cycles a
block; this tells whether the WGMMAs' shared-memory A costs that alone (then RS is the lever)
or only beside the ring's writes. Not a package kernel: a measuring tool, like trace_decode."""
from __future__ import annotations

import argparse

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int64
from cutlass.cute.nvgpu import warp, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

FP8 = cutlass.Float8E4M3FN
BK = 128  # a K block
ROWS = 128  # a head's weight rows
BLOCKS = 24  # blocks timed a launch
WARPGROUP = 128


class WgmmaPace:
    """One CTA: warpgroup 0 issues BLOCKS blocks of WGMMAs (SS or RS) and writes its
    clock64 span to out[0]; with `writers`, warpgroup 1 stores to shared memory meanwhile."""

    def __init__(self, tokens: int, a_in_registers: bool, writers: bool):
        self.tokens, self.a_in_registers, self.writers = tokens, a_in_registers, writers

    def _setup(self):
        kmajor = LayoutEnum.ROW_MAJOR
        source = warpgroup.OperandSource.RMEM if self.a_in_registers else warpgroup.OperandSource.SMEM
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            FP8, FP8, kmajor.sm90_mma_major_mode(), kmajor.sm90_mma_major_mode(), Float32, (1, 1, 1),
            tiler_mn=(64, self.tokens), a_source=source)
        atom = warpgroup.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(kmajor, FP8, BK), FP8)
        self.a_layout = cute.tile_to_shape(atom, (ROWS, BK, 2), order=(0, 1, 2))  # two stages
        self.b_layout = cute.tile_to_shape(atom, (self.tokens, BK), order=(0, 1))

    @cute.jit
    def __call__(self, out: cute.Tensor):
        self._setup()

        @cute.struct
        class Storage:
            sA: cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(self.a_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(self.b_layout)], 1024]
            sW: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, 32 * WARPGROUP], 1024]

        threads = WARPGROUP * (2 if self.writers else 1)
        self.kernel(out, self.tiled_mma, self.a_layout, self.b_layout, Storage).launch(
            grid=(1, 1, 1), block=(threads, 1, 1), smem=Storage.size_in_bytes())

    @cute.kernel
    def kernel(self, out: cute.Tensor, tiled_mma: cute.TiledMma, a_layout: cute.ComposedLayout,
               b_layout: cute.ComposedLayout, Storage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        st = SmemAllocator().allocate(Storage)
        sA = st.sA.get_tensor(a_layout.outer, swizzle=a_layout.inner)
        sB = st.sB.get_tensor(b_layout.outer, swizzle=b_layout.inner)
        sW = st.sW.get_tensor(cute.make_layout(32 * WARPGROUP))
        cute.arch.sync_threads()  # the operands' values do not matter to the pace
        if tidx < WARPGROUP:
            thr_mma = tiled_mma.get_slice(tidx)
            tCsA = thr_mma.partition_A(sA)
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            partials = tuple(cute.make_rmem_tensor(thr_mma.partition_shape_C((ROWS, self.tokens)), Float32)
                             for _ in range(2))
            acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((ROWS, self.tokens)), Float32)
            acc.fill(0.0)
            k_slices = cute.size(tCrB, mode=[2])
            if cutlass.const_expr(self.a_in_registers):
                a_regs = tuple(tiled_mma.make_fragment_A(tCsA[None, None, None, s]) for s in range(2))
                ldsm = cute.make_tiled_copy_A(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), FP8), tiled_mma)
                thr_ldsm = ldsm.get_slice(tidx)
            else:
                tCrA = tiled_mma.make_fragment_A(tCsA)
            start = cute.arch.clock64()
            for b in cutlass.range_constexpr(BLOCKS):
                stage = b % 2
                if cutlass.const_expr(self.a_in_registers):
                    # block b-2's WGMMAs, the last to read these registers, are done (wait below)
                    cute.copy(ldsm, thr_ldsm.partition_S(sA[None, None, stage]), thr_ldsm.retile(a_regs[stage]))
                tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                warpgroup.fence()
                for k in cutlass.range_constexpr(k_slices):
                    a = a_regs[stage][None, None, k] if self.a_in_registers else tCrA[None, None, k, stage]
                    cute.gemm(tiled_mma, partials[stage], a, tCrB[None, None, k], partials[stage])
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                if cutlass.const_expr(b > 0):
                    warpgroup.wait_group(1)  # block b-1 done: two blocks in flight, as the K loop keeps
                    self._promote(acc, partials[1 - stage], b)
            warpgroup.wait_group(0)
            self._promote(acc, partials[(BLOCKS - 1) % 2], BLOCKS)
            end = cute.arch.clock64()
            total = Float32(0.0)  # keep the results live
            for i in cutlass.range_constexpr(cute.size(acc)):
                total = total + acc[i]
            if tidx == 0:
                out[0] = end - start
                out[1] = Int64(total != Float32(1.0))
        else:
            for r in cutlass.range(4 * BLOCKS):  # outlasts the WGMMAs
                for j in cutlass.range_constexpr(32):
                    sW[(tidx - WARPGROUP) + WARPGROUP * j] = r + j


    def _promote(self, acc, partial, scale):
        """acc += partial x a block scale, as the kernel's promotion: it also keeps every
        block's WGMMAs live (each overwrites its partial; ptxas drops an unread one)."""
        for i in range(cute.size(acc)):
            acc[i] = acc[i] + partial[i] * Float32(scale)


def variants(tokens_list=(16, 32)):
    for tokens in tokens_list:
        for a_in_registers in (False, True):
            for writers in (False, True):
                yield WgmmaPace(tokens, a_in_registers, writers)


def main(argv=None):
    import torch
    from cutlass.cute.runtime import from_dlpack

    ap = argparse.ArgumentParser(prog="python -m tuning.wgmma_pace", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 32])
    args = ap.parse_args(argv)
    for v in variants(tuple(args.tokens)):
        out = torch.zeros(4, dtype=torch.int64, device="cuda")
        kernel = cute.compile(v, from_dlpack(out))
        spans = []
        for _ in range(5):
            kernel(from_dlpack(out))
            torch.cuda.synchronize()
            spans.append(int(out[0]) / BLOCKS)
        print(f"tokens {v.tokens:3d} A {'in registers (RS)' if v.a_in_registers else 'from shared (SS)':18s} "
              f"writers {'on ' if v.writers else 'off'}: {sorted(spans)[2]:.0f} cycles a block "
              f"({', '.join(f'{s:.0f}' for s in spans)})", flush=True)


if __name__ == "__main__":
    main()
