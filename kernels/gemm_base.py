"""What every fused indexer-Q GEMM shares, whatever the arch: its static
configuration and the problem bookkeeping. Arch files subclass `FusedIndexerQGemmBase`.
"""
from __future__ import annotations

from dataclasses import dataclass

from .numerics import HEAD_DIM, OUT_FORMATS, Q_BYTES_PER_HEAD  # no DSL import: GemmConfig is a cache key

SCALE_BLOCK_K = 128  # the SPEC's activation (1x128) and weight (128x128) scale blocks


@dataclass(frozen=True)
class GemmConfig:
    """Everything that changes the generated code (and nothing else): the compile key."""

    arch: str = "sm_90a"
    kind: str = "native"  # "native" (tokens on the MMA's M side) or "swap_ab"
    # tokens per CTA tile: native 64 per consumer warpgroup (the MMA's M); swap_ab 8..64
    # (the MMA's N, the weight's 128 rows of one head on its M)
    tile_m: int = 128
    stages: int = 0  # shared-memory ring depth of the TMA pipeline; 0 = as many as fit
    cluster_m: int = 1  # CTAs per cluster along M; >1 multicasts the weight tile
    cluster_n: int = 1  # CTAs per cluster along N (heads); >1 multicasts the activation tile
    raster_along_m: bool = True
    swizzle: int = 1  # tile-scheduler swizzle, in clusters
    # WGMMAs (k=32 each) between promotions of the partial accumulator; fewer = closer
    # to fp32 accuracy (Hopper's FP8 tensor-core accumulation keeps ~14 bits), slower.
    mma_per_promotion: int = 4
    # True: issue the next K block's WGMMAs into a second partial accumulator before
    # promoting this one, so the promotion runs under tensor-core work (needs the
    # register room of one consumer warpgroup: tile_m = 64, mma_per_promotion = 4).
    pipelined_promotion: bool = False
    # CTAs (one cluster) that split a tile's K blocks: each accumulates its share and the
    # others send their fp32 partial tiles to rank 0 through distributed shared memory,
    # which reduces them in rank order and runs the epilogue. For small M (decode), where
    # one CTA per head would leave most SMs idle streaming the weight.
    split_k: int = 1
    # sm_90a (native and swap_ab): K blocks a CTA's producer keeps requested but not yet landed, at most
    # (0: as many as the ring has free stages). With every CTA requesting its whole ring at
    # once, memory served the requests interleaved and each CTA's first block landed with
    # the last (H200 trace, V4-Pro M = 128, 64-row tiles on 8 stages: 3.75 us to the first
    # block, then the consumer at 0.24 us a block with the stream idle); a limit makes the
    # blocks land in order, so the MMAs start while the rest streams.
    loads_in_flight: int = 0
    hadamard: bool = False
    fp4_rounding: str = "floor-ties"
    out_format: str = "mxfp4"
    positions_dtype: str = "int64"
    # Programmatic dependent launch: the kernel may start while the activation quantizer
    # (the launch before it) still runs; it sets up, loads the first tile's weight blocks,
    # then waits for that grid before touching the activation or its scales.
    pdl: bool = True
    # Warpgroups running the epilogue (RoPE, Hadamard, quantization) beside the mainloop.
    # It is latency-bound with one warp per SM sub-partition; two give twice the warps in
    # the registers one had (sm_90a native: 4 lanes a row at 72 registers a thread; the
    # swapped-A/B kernel: 8 lanes a row).
    epilogue_warpgroups: int = 1
    # The Hadamard's H16 factor as bf16 mma.sync against a +-1 matrix held in registers
    # (H8 a butterfly in registers) instead of a butterfly of shuffles: two rows a thread in
    # the native kernel's one epilogue warpgroup, one row a thread in its two and in the
    # swapped-A/B kernel (hadamard_mma_sm90). Ignored without the Hadamard.
    tensor_core_hadamard: bool = False
    # swap_ab: the kernel quantizes the activation itself (SPEC step 1, the act_quant
    # kernel's arithmetic) into shared memory in the layout its MMA reads, while the
    # weight's first loads are in flight: one launch instead of two.
    fused_act_quant: bool = False
    # fused_act_quant, sm_90a: lanes sharing a (token, 128-K block) unit of the quantizer:
    # 16 (8 values a lane, as the act_quant kernel) or 4 (32 a lane: half the shuffle stages
    # and a quarter of the exponents a value). The same bytes either way.
    act_quant_lanes: int = 16
    # fused_act_quant, sm_90a swapped A/B, tiles up to 16 tokens: the tile's bf16 rows of qr
    # come into shared memory by TMA (True), or the quantizers load them (False: the staging
    # buffer's space goes to the weight's ring instead; 16 tokens unsplit at K = 1536: 48 KB,
    # 8 -> 11 stages).
    stage_qr: bool = True
    # sm_90a swapped A/B with pipelined promotion and PDL: the consumer loads its first
    # tile's weight block scales before its PDL wait instead of after it (they are not the
    # previous grid's output). ptxas can make the quantizer's later qr loads wait on the
    # scales' scoreboard, and the producer's weight requests wait for those loads; which
    # order is faster depends on the shape (H200: V4-Flash M = 24 -0.19 us, M = 32-64 and
    # V4-Pro +0.1-0.7 us on the 32-token head pair): the tuner decides.
    scales_before_pdl_wait: bool = False
    # sm_90a swapped A/B: each K block's WGMMA descriptors made from its stages' addresses
    # marked warp-uniform, beside its WGMMAs, so that ptxas forms them in uniform registers.
    # Made once before the tile loop (False), they are kept in vector registers in some
    # tactics (TP8's 16-token tile: ~4 R2UR moves a WGMMA), and the WGMMAs' issue, not their
    # execution, set the K block's pace (NOTES version 115: 0.154 -> 0.118 us a block there).
    # With it ptxas also kept the pipelined loops' weight scales in uniform registers, moved
    # there right after their loads, so the consumer waited for them before quantizing (V4's
    # pairs of heads: 0.4-0.7 us slower); so the scales are spread over the lanes and read
    # back by a shuffle (NOTES version 116). Which is faster depends on the tactic: the tuner
    # decides.
    uniform_descriptors: bool = False
    # fused_act_quant, sm_90a swapped A/B with PDL: at the kernel's start, before any PDL wait,
    # an idle warp of the producer's warpgroup asks the L2 to fetch the CTA's share of the first
    # tile's rows of qr (a bulk prefetch a row), so the quantizer's loads after the wait hit L2
    # instead of DRAM when qr is not there already. A prefetch reads nothing into the SM, and
    # the L2 is where the previous grid's writes land, so it cannot see stale data whatever
    # that grid writes. H200, 36th session, twins of the tables' tactics: V4 M = 96 -0.2 us,
    # TP8 M = 32-64 -0.1 to -0.2, V4 M = 32-64 +0.05-0.15: the tuner decides, from M = 24.
    prefetch_qr: bool = False
    # False builds a profiling probe: the full mainloop and the bf16 handoff, but the
    # epilogue warpgroup only takes each tile and writes nothing, so it measures what the
    # epilogue costs. Never chosen by the tuner.
    epilogue: bool = True
    # sm_90a profiling (a probe, or the swapped kernel whole): each CTA's roles write clock
    # stamps at phase boundaries (TRACE_SLOTS int64 a CTA) into the probe's unused q output,
    # or after the q output, to see where the decode time goes. Never chosen by the tuner;
    # no code when False.
    trace: bool = False

    @property
    def out_format_id(self) -> int:
        return OUT_FORMATS[self.out_format]

    @property
    def uses_tensor_core_hadamard(self) -> bool:
        return self.hadamard and self.tensor_core_hadamard

    @property
    def rne(self) -> bool:
        return self.fp4_rounding == "rne"

    def problems(self, n: int, k: int) -> list[str]:
        """Reasons this config cannot run (N, K); empty when it can."""
        out = []
        if n % HEAD_DIM:
            out.append(f"N={n} is not a multiple of {HEAD_DIM}")
        if k % SCALE_BLOCK_K:
            out.append(f"K={k} is not a multiple of {SCALE_BLOCK_K}")
        if self.out_format not in OUT_FORMATS:
            out.append(f"unknown out_format {self.out_format!r}")
        if self.fp4_rounding not in ("floor-ties", "rne"):
            out.append(f"unknown fp4_rounding {self.fp4_rounding!r}")
        if (n // HEAD_DIM) % self.cluster_n:
            out.append(f"{n // HEAD_DIM} heads are not a multiple of cluster_n={self.cluster_n}")
        if self.pipelined_promotion and ((k // SCALE_BLOCK_K) % 2 or k < 2 * SCALE_BLOCK_K):
            out.append(f"pipelined_promotion needs an even number (>= 2) of 128-K blocks (K={k})")
        if self.split_k > k // SCALE_BLOCK_K:
            out.append(f"split_k={self.split_k} exceeds the {k // SCALE_BLOCK_K} K blocks of K={k}")
        if self.out_format == "gemm-bf16" and (self.hadamard or self.arch != "sm_90a" or self.kind != "native"):
            out.append("out_format 'gemm-bf16' (the GEMM's own output) is the sm_90a native kernel's, "
                       "without the Hadamard")
        if self.positions_dtype not in ("int32", "int64"):
            out.append(f"positions dtype {self.positions_dtype!r}")
        return out


class FusedIndexerQGemmBase:
    """Shared shape of a fused kernel class: `__init__(config)` holds static config,
    `__call__` (host, @cute.jit) builds TMA atoms and launches, `kernel` is the device
    side, `can_implement` answers without compiling."""

    supported_kinds: tuple = ()
    arch: str = ""
    ptx_signature: tuple = ()  # (name, substring the compiled PTX must hold): CI checks it
    split_k_choices: tuple = (1,)  # K splits the kernel implements
    epilogue_warpgroup_choices: tuple = (1,)  # epilogue warpgroup counts it implements
    has_tensor_core_hadamard: bool = False  # implements GemmConfig.tensor_core_hadamard
    limits_loads_in_flight: bool = False  # implements GemmConfig.loads_in_flight
    act_quant_lane_choices: tuple = (16,)  # GemmConfig.act_quant_lanes it implements
    qr_staging_max_tile: int = 0  # its fused quantizer stages qr by TMA up to this tile_m (GemmConfig.stage_qr)
    orders_scales_before_pdl_wait: bool = False  # implements GemmConfig.scales_before_pdl_wait
    makes_uniform_descriptors: bool = False  # implements GemmConfig.uniform_descriptors
    prefetches_qr: bool = False  # implements GemmConfig.prefetch_qr
    traces_with_epilogue: bool = False  # GemmConfig.trace also with epilogue=True (stamps after q)

    def __init__(self, config: GemmConfig):
        problems = self.config_problems(config)
        if problems:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems))
        self.config = config

    @staticmethod
    def max_stages(config: GemmConfig) -> int:
        """Pipeline stages that fit in shared memory beside what else the kernel keeps there."""
        raise NotImplementedError

    @classmethod
    def config_problems(cls, config: GemmConfig) -> list[str]:
        out = []
        if config.arch != cls.arch:
            out.append(f"arch {config.arch} (this kernel is {cls.arch})")
        if config.kind not in cls.supported_kinds:
            out.append(f"kind {config.kind!r} not in {cls.supported_kinds}")
        if config.split_k not in cls.split_k_choices:
            out.append(f"split_k={config.split_k} (this kernel: {', '.join(map(str, cls.split_k_choices))})")
        if config.epilogue_warpgroups not in cls.epilogue_warpgroup_choices:
            out.append(f"epilogue_warpgroups={config.epilogue_warpgroups} "
                       f"(this kernel: {', '.join(map(str, cls.epilogue_warpgroup_choices))})")
        if config.uses_tensor_core_hadamard and not cls.has_tensor_core_hadamard:
            out.append("tensor_core_hadamard (this kernel: the butterfly only)")
        if config.fused_act_quant and config.kind != "swap_ab":
            out.append("fused_act_quant needs kind='swap_ab'")
        if config.act_quant_lanes != 16 and (not config.fused_act_quant
                                             or config.act_quant_lanes not in cls.act_quant_lane_choices):
            out.append(f"act_quant_lanes={config.act_quant_lanes} (16; with fused_act_quant, this kernel: "
                       f"{', '.join(map(str, cls.act_quant_lane_choices))})")
        if not config.stage_qr and not (config.fused_act_quant and config.tile_m <= cls.qr_staging_max_tile):
            out.append("stage_qr=False only where the fused quantizer stages qr by TMA (sm_90a swap_ab, "
                       f"fused_act_quant, tile_m <= {max(cls.qr_staging_max_tile, 16)})")
        if config.scales_before_pdl_wait and not (cls.orders_scales_before_pdl_wait and config.pipelined_promotion
                                                  and config.pdl):
            out.append("scales_before_pdl_wait needs the sm_90a swap_ab kernel with pipelined_promotion and pdl")
        if config.prefetch_qr and not (cls.prefetches_qr and config.fused_act_quant and config.pdl):
            out.append("prefetch_qr needs the sm_90a swap_ab kernel with fused_act_quant and pdl")
        if config.uniform_descriptors and not cls.makes_uniform_descriptors:
            out.append("uniform_descriptors needs the sm_90a swap_ab kernel")
        if config.trace and (config.arch != "sm_90a" or (config.epilogue and not cls.traces_with_epilogue)
                             or (config.kind == "native" and config.pipelined_promotion)):
            out.append("trace needs sm_90a, a probe (epilogue=False: it writes into the q output) but for the "
                       "swap_ab kernel, and native without pipelined_promotion (its K loop has no stamps)")
        if config.loads_in_flight and not cls.limits_loads_in_flight:
            out.append("loads_in_flight (this kernel: its ring's depth)")
        elif config.loads_in_flight < 0 or (config.stages and config.loads_in_flight >= config.stages):
            out.append(f"loads_in_flight={config.loads_in_flight} (0, or 1 up to the ring's stages - 1)")
        if config.stages and not 2 <= config.stages <= cls.max_stages(config):
            out.append(f"stages={config.stages} (2..{cls.max_stages(config)} fit shared memory)")
        return out

    @classmethod
    def shape_problems(cls, config: GemmConfig, n: int, k: int) -> list[str]:
        """Limits that depend on the weight's shape as well (e.g. shared memory by K)."""
        return []

    @classmethod
    def problems(cls, config: GemmConfig, n: int, k: int) -> list[str]:
        """Every reason this kernel cannot run `config` at (N, K); empty when it can."""
        out = cls.config_problems(config) + config.problems(n, k)
        return out or cls.shape_problems(config, n, k)

    @classmethod
    def can_implement(cls, config: GemmConfig, n: int, k: int) -> bool:
        return not cls.problems(config, n, k)

    def entry_point(self):
        """What cute.compile compiles (the @cute.jit host function)."""
        return self

    def operand_args(self, m, n: int, k: int) -> list:
        """Fake tensors for the GEMM operands and their scales (arch-specific)."""
        raise NotImplementedError

    def compile_args(self, n: int, k: int, sms: int) -> list:
        """Arguments for cute.compile: fake tensors with M (tokens) and P (cos_sin rows)
        symbolic, so one compile serves every M; N and K fixed."""
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

        cfg = self.config
        m, p = cute.sym_int(), cute.sym_int()
        pos_dtype = cutlass.Int64 if cfg.positions_dtype == "int64" else cutlass.Int32
        q_words = n // HEAD_DIM * Q_BYTES_PER_HEAD[cfg.out_format] // 4
        rowmaj = (1, 0)
        return [
            *self.operand_args(m, n, k),
            make_fake_compact_tensor(pos_dtype, (m,), assumed_align=8),
            make_fake_compact_tensor(cutlass.Float32, (p, 64), stride_order=rowmaj, assumed_align=16),
            make_fake_compact_tensor(cutlass.Int32, (m, q_words), stride_order=rowmaj, assumed_align=16),
            make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(), cute.sym_int()), stride_order=rowmaj,
                                     assumed_align=4),
            sms // (cfg.cluster_m * cfg.cluster_n * cfg.split_k),  # clusters resident at once
            make_fake_stream(use_tvm_ffi_env_stream=True),
        ]
