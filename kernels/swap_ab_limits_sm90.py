"""The swapped-A/B kernel's host-side limits (sm_90a): which configurations and shapes it
runs, and how its shared memory is shared between the weight's ring and the rest. A mixin
of Sm90SwapABFusedIndexerQ (kernels/gemm_sm90_swap_ab.py), ahead of Sm90KernelBase in its
bases, so `super().config_problems` reaches the base's checks."""
from __future__ import annotations

from . import epilogue as epi
from .gemm_base import SCALE_BLOCK_K, GemmConfig
from .sm90_parts import EPI_BUFFERS, SMEM_CAPACITY
from .swap_ab_kloop_sm90 import PIPELINED_MAX_TILE, TWO_PARTIALS_MAX_TILE

TOKEN_TILES = (8, 16, 32, 64)
# cluster_n: CTAs of consecutive heads (one cluster) sharing the first token tile's fused
# quantization: each quantizes 1 / cluster_n of the K blocks and sends its e4m3 bytes and
# scales to the others through distributed shared memory (kernels/swap_ab_quant_sm90.py).
HEAD_CLUSTERS = (1, 2, 4)
# cluster_m: CTAs of consecutive token tiles of one head (one cluster) sharing its weight:
# each requests 1 / cluster_m of every weight block and multicasts it to all of them, so
# the head's weight crosses from L2 once a cluster instead of once a token tile.
WEIGHT_CLUSTERS = (1, 2)
SEPARATE_QUANT_PIPELINED_MAX_BLOCKS_T16 = 8  # see shape_problems


class Sm90SwapABLimits:
    """Mixin: uses the quantizer mixin's stages_qr_by_tma."""
    supported_kinds = ("swap_ab",)
    split_k_choices = (1, 2, 3, 4, 6, 8)  # a cluster of up to 8 CTAs shares a head's K blocks
    epilogue_warpgroup_choices = (1, 2)

    @classmethod
    def config_problems(cls, config: GemmConfig) -> list[str]:
        out = super().config_problems(config)
        if config.tile_m not in TOKEN_TILES:
            out.append(f"tile_m={config.tile_m} (sm_90a swap_ab: tokens on the MMA's N, {TOKEN_TILES})")
        if config.cluster_m not in WEIGHT_CLUSTERS:
            out.append(f"swap_ab cluster_m={config.cluster_m} (token tiles sharing a head's weight: {WEIGHT_CLUSTERS})")
        elif config.cluster_m > 1 and (config.split_k > 1 or config.cluster_n > 1):
            out.append("swap_ab cluster_m > 1 (token tiles sharing the weight) needs split_k=1 and cluster_n=1")
        if config.cluster_n not in HEAD_CLUSTERS:
            out.append(f"swap_ab cluster_n={config.cluster_n} (heads sharing a token tile's quantizer: {HEAD_CLUSTERS})")
        elif config.cluster_n > 1 and not (config.fused_act_quant and config.split_k == 1):
            out.append("swap_ab cluster_n > 1 shares the fused quantizer's work: it needs fused_act_quant and "
                       "split_k=1")
        if config.mma_per_promotion != 4:
            out.append("swap_ab promotes once per 128-K block (mma_per_promotion=4)")
        if config.pipelined_promotion and config.tile_m > TWO_PARTIALS_MAX_TILE and not config.fused_act_quant:
            out.append("swap_ab pipelined_promotion at 64 tokens needs fused_act_quant (the separate quantizer's "
                       "scales a block ahead spill there)")
        if config.pipelined_promotion and config.tile_m > PIPELINED_MAX_TILE:
            out.append(f"swap_ab pipelined_promotion needs tile_m <= {PIPELINED_MAX_TILE}")
        return out

    @classmethod
    def shape_problems(cls, config: GemmConfig, n: int, k: int) -> list[str]:
        k_tiles = k // SCALE_BLOCK_K
        if k_tiles % config.split_k:
            return [f"swap_ab splits K evenly: split_k={config.split_k} does not divide the {k_tiles} K blocks"]
        if k_tiles % config.cluster_n:
            return [f"swap_ab cluster_n={config.cluster_n} shares the quantizer's K blocks evenly: it does not "
                    f"divide the {k_tiles} K blocks"]
        if (config.pipelined_promotion and not config.fused_act_quant and config.tile_m == 16
                and k_tiles // config.split_k > SEPARATE_QUANT_PIPELINED_MAX_BLOCKS_T16):
            # the unrolled loop's scales a block ahead spill (CUDA 13's ptxas, 25th session:
            # 14 local accesses at K = 1536 unsplit, 35 with cluster_m = 2; none at 8 blocks)
            return [f"swap_ab pipelined_promotion with the separate quantizer at 16 tokens: at most "
                    f"{SEPARATE_QUANT_PIPELINED_MAX_BLOCKS_T16} K blocks a CTA (here {k_tiles // config.split_k})"]
        fit = cls.stages_that_fit(config, k)
        if fit < 2 or (config.stages and config.stages > fit):
            return [f"shared memory: {fit} weight stages fit beside the rest at tile_m={config.tile_m}, "
                    f"split_k={config.split_k}, K={k}"]
        return []

    @staticmethod
    def reduce_scatters(config: GemmConfig) -> bool:
        """A K split whose ranks each finish whole groups of 8 tokens reduce-scatters."""
        return config.split_k > 1 and (config.tile_m // 8) % config.split_k == 0

    @classmethod
    def _reduce_words(cls, config: GemmConfig) -> int:
        """The K split's slots: S slots of T / S token rows (reduce-scatter), or S - 1 of T."""
        if cls.reduce_scatters(config):
            slots, rows = config.split_k, config.tile_m // config.split_k
        else:
            slots, rows = config.split_k - 1, config.tile_m
        return slots * rows * epi.HEAD_DIM

    @classmethod
    def _fixed_bytes(cls, config: GemmConfig, k: int) -> int:
        """Shared memory besides the weight ring: hand-off buffers, K-split slots and the
        resident quantized activation with its scales."""
        t = config.tile_m
        out = EPI_BUFFERS * t * epi.HEAD_DIM * 2 + cls._reduce_words(config) * 4 + 2048
        if config.fused_act_quant:
            k_blocks = k // SCALE_BLOCK_K // config.split_k
            out += k_blocks * t * (SCALE_BLOCK_K + 4) + 1024
            if cls.stages_qr_by_tma(config):  # the bf16 staging buffer and its two barriers
                out += k_blocks * t * SCALE_BLOCK_K * 2 + 2048
            if config.cluster_n > 1:  # the peers' bytes barrier (heads sharing the quantizer; 1024-aligned)
                out += 1024
        return out

    @classmethod
    def stages_that_fit(cls, config: GemmConfig, k: int) -> int:
        stage = epi.HEAD_DIM * SCALE_BLOCK_K + (0 if config.fused_act_quant else config.tile_m * SCALE_BLOCK_K)
        return min(16, (SMEM_CAPACITY - cls._fixed_bytes(config, k)) // stage)

    @classmethod
    def max_stages(cls, config: GemmConfig) -> int:
        # the bound without K (K's share is checked by shape_problems)
        return cls.stages_that_fit(config, SCALE_BLOCK_K * config.split_k)
