"""Tactics: the performance knobs of the fused kernel, named, frozen, hashable.

A `Tactic` holds only what changes speed; the call's numerics (Hadamard, rounding,
output format, positions dtype) are added by `to_config` to make the kernel's compile
key. `valid_tactics` asks each kernel's own `can_implement`, so a tactic is offered only
where it compiles; the heuristic's choice is always one of them.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass

# (arch, kind) -> kernel class path; the one place that says which kernels exist
KERNEL_CLASSES = {
    ("sm_90a", "native"): ("indexer_q.kernels.gemm_sm90", "Sm90FusedIndexerQ"),
    ("sm_90a", "swap_ab"): ("indexer_q.kernels.gemm_sm90_swap_ab", "Sm90SwapABFusedIndexerQ"),
    ("sm_100a", "native"): ("indexer_q.kernels.gemm_sm100", "Sm100FusedIndexerQ"),  # compiled only so far
    ("sm_100a", "swap_ab"): ("indexer_q.kernels.gemm_sm100_swap_ab", "Sm100SwapABFusedIndexerQ"),  # likewise
}
ARCHES_WITH_KERNELS = tuple(dict.fromkeys(arch for arch, _ in KERNEL_CLASSES))


@dataclass(frozen=True)
class Tactic:
    kind: str = "native"  # "native" (tokens on the MMA's M side) or "swap_ab" (small M)
    tile_m: int = 128  # tokens per CTA tile (swap_ab: 8, 16, 32 or 64, on the MMA's N side)
    stages: int = 0  # TMA ring depth; 0 = as many as fit in shared memory
    cluster_m: int = 1  # CTAs sharing (multicasting) one weight tile
    cluster_n: int = 1  # CTAs sharing one activation tile (swap_ab: heads sharing its fused quantizer's work)
    raster_along_m: bool = True
    swizzle: int = 1
    mma_per_promotion: int = 4  # WGMMAs (32 K each) between block-scale promotions
    pipelined_promotion: bool = False  # promote block k under block k+1's WGMMAs (native tile_m 64, swap_ab <= 32)
    split_k: int = 1
    # sm_90a (native and swap_ab): K blocks requested and not yet landed, at most, a CTA (0: the ring's free stages)
    loads_in_flight: int = 0
    pdl: bool = True  # programmatic dependent launch after the activation quantizer
    epilogue_warpgroups: int = 1  # 2: twice the epilogue warps (see GemmConfig)
    # the Hadamard's H16 factor as a bf16 MMA (native: 1 or 2 epilogue warpgroups; swap_ab: 8 lanes a row)
    tensor_core_hadamard: bool = False
    # swap_ab: the kernel quantizes the activation itself (one launch instead of two)
    fused_act_quant: bool = False
    # fused_act_quant: lanes a (token, 128-K block) unit of its quantizer, 16 or 4 (see GemmConfig)
    act_quant_lanes: int = 16
    # fused_act_quant, tiles up to 16 tokens: qr staged by TMA (False: loaded by the quantizers; see GemmConfig)
    stage_qr: bool = True
    # sm_90a swap_ab, pipelined: the first tile's weight scales loaded before the PDL wait (see GemmConfig)
    scales_before_pdl_wait: bool = False
    # sm_90a swap_ab: each K block's WGMMA descriptors made from warp-uniform addresses (see GemmConfig)
    uniform_descriptors: bool = False
    # sm_90a swap_ab, fused_act_quant: the first tile's qr rows prefetched into L2 before the PDL wait (see GemmConfig)
    prefetch_qr: bool = False
    # False: a profiling probe that runs the mainloop only and writes nothing (it
    # measures the epilogue's cost); never among valid_tactics.
    epilogue: bool = True
    # Two launches instead of one (native, sm_90a): the GEMM stores its bf16 output y and
    # kernels/row_epilogue.py runs RoPE, the Hadamard and the quantization over it, with
    # the SM to itself (large M: the fused epilogue takes the MMA warps' issue slots).
    separate_epilogue: bool = False

    def __post_init__(self):
        from .validate import fail

        if self.kind not in ("native", "swap_ab"):
            fail("tactic.kind", '"native" or "swap_ab"', repr(self.kind))
        for name in ("tile_m", "stages", "cluster_m", "cluster_n", "swizzle", "mma_per_promotion", "split_k",
                     "loads_in_flight", "epilogue_warpgroups", "act_quant_lanes"):
            value = getattr(self, name)
            if type(value) is not int:
                fail(f"tactic.{name}", "an int", repr(value))
        for name in ("raster_along_m", "epilogue", "pipelined_promotion", "pdl",
                     "tensor_core_hadamard", "fused_act_quant", "stage_qr", "scales_before_pdl_wait",
                     "uniform_descriptors", "prefetch_qr", "separate_epilogue"):
            if type(getattr(self, name)) is not bool:
                fail(f"tactic.{name}", "a bool", repr(getattr(self, name)))
        for name, low in (("tile_m", 1), ("stages", 0), ("cluster_m", 1), ("cluster_n", 1), ("swizzle", 1),
                          ("mma_per_promotion", 1), ("split_k", 1), ("loads_in_flight", 0), ("epilogue_warpgroups", 1),
                          ("act_quant_lanes", 1)):
            if getattr(self, name) < low:
                fail(f"tactic.{name}", f">= {low}", getattr(self, name))

    def problems(self, n: int) -> list[str]:
        """What this tactic cannot do for N (heads) beyond what a kernel's can_implement
        says: a tile-scheduler swizzle along N rounds the number of head clusters up to
        a multiple of it, and the padded tiles would write past the last head; rastered
        along N it pads the token tiles instead, where a swapped-A/B cluster sharing its
        quantizer would wait for bytes no peer sends, and the fused quantizer's producer
        for the quantizers' first loads of qr (none in a tile wholly past M)."""
        head_clusters = (n // 128) // self.cluster_n
        if self.swizzle > 1 and self.raster_along_m and head_clusters % self.swizzle:
            return [f"swizzle={self.swizzle} along N needs the head clusters ({head_clusters}) "
                    "to be a multiple of it"]
        if self.separate_epilogue and (self.kind != "native" or self.tensor_core_hadamard or not self.epilogue):
            return ["separate_epilogue needs kind='native', the butterfly Hadamard and epilogue=True"]
        if (self.kind == "swap_ab" and (self.cluster_n > 1 or self.fused_act_quant) and self.swizzle > 1
                and not self.raster_along_m):
            what = f"cluster_n={self.cluster_n}" if self.cluster_n > 1 else "fused_act_quant"
            return [f"swap_ab {what} with swizzle={self.swizzle} rastered along N pads the token tiles past M"]
        return []

    def to_config(self, arch: str, *, hadamard: bool, fp4_rounding: str, out_format: str,
                  positions_dtype: str):
        """The (first) kernel's compile key: this tactic plus the call's numerics. With
        separate_epilogue, the GEMM's that stores y: no numerics but the positions dtype."""
        from indexer_q.kernels.gemm_base import GemmConfig

        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del fields["separate_epilogue"]
        # without the Hadamard the knob changes no code: one compile key, not two
        fields["tensor_core_hadamard"] = self.tensor_core_hadamard and bool(hadamard)
        if self.separate_epilogue:
            return GemmConfig(arch=arch, out_format="gemm-bf16", positions_dtype=positions_dtype, **fields)
        return GemmConfig(arch=arch, hadamard=bool(hadamard), fp4_rounding=fp4_rounding,
                          out_format=out_format, positions_dtype=positions_dtype, **fields)

    def epilogue_config(self, arch: str, *, hadamard: bool, fp4_rounding: str, out_format: str,
                        positions_dtype: str):
        """separate_epilogue: the second kernel's compile key (kernels/row_epilogue.py reads
        the numerics fields of a GemmConfig)."""
        from indexer_q.kernels.gemm_base import GemmConfig

        return GemmConfig(arch=arch, hadamard=bool(hadamard), fp4_rounding=fp4_rounding, out_format=out_format,
                          positions_dtype=positions_dtype, pdl=self.pdl)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def spec(self) -> str:
        """'field=value,...': the kind and the fields that differ from the defaults (the
        bench's --tactic syntax, a tuner table's timing keys); from_spec reads it back."""
        default = Tactic()
        return ",".join([f"kind={self.kind}"] + [
            f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
            if f.name != "kind" and getattr(self, f.name) != getattr(default, f.name)])

    @classmethod
    def spec_fields(cls, spec: str) -> dict:
        """A spec's fields as typed values (the types of this class's fields)."""
        default = cls()
        names = {f.name for f in dataclasses.fields(cls)}
        values = {}
        for item in spec.split(","):
            name, _, value = item.partition("=")
            if name not in names or name in values:
                raise ValueError(f"tactic spec {spec!r}: {'a repeated' if name in values else 'an unknown'} "
                                 f"field {name!r}")
            current = getattr(default, name)
            if isinstance(current, bool):
                if value not in ("True", "False"):
                    raise ValueError(f"tactic spec {spec!r}: {name} is True or False, not {value!r}")
                values[name] = value == "True"
            else:
                values[name] = int(value) if isinstance(current, int) else value
        return values

    @classmethod
    def from_spec(cls, spec: str) -> "Tactic":
        return cls(**cls.spec_fields(spec))

    @classmethod
    def from_dict(cls, d: dict) -> "Tactic":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"tactic: unknown fields {sorted(unknown)}")
        return cls(**d)


def kernel_class(arch: str, kind: str = "native"):
    """The kernel class for (arch, kind), or None where none is built."""
    import importlib

    if (arch, kind) not in KERNEL_CLASSES:
        return None
    module, name = KERNEL_CLASSES[(arch, kind)]
    return getattr(importlib.import_module(module), name)


SWAP_AB_MAX_M = 256  # swapped-A/B tactics are offered up to here (decode and small batches)
SWAP_AB_HEURISTIC_MAX_M = 128  # and chosen by the heuristic up to here (few heads: up to SWAP_AB_MAX_M)
SWAP_AB_PIPELINED_MAX_TILE = 64  # the sm_90a kernel's limit for pipelined_promotion (PIPELINED_MAX_TILE)
SWAP_AB_QR_STAGED_MAX_TILE = 16  # the sm_90a kernel's fused quantizer stages qr by TMA up to here (QR_TMA_MAX_TILE)
SWAP_AB_UNSPLIT_MIN_HEADS = 64  # with qr staged, no K split from here (measured at 64 heads; 8 keep it)


def swap_ab_tile(m: int) -> int:
    """The token tile of the swapped-A/B kernel for M tokens: the smallest of 8..64 that
    holds them (a larger tile computes columns nobody stores; a smaller one reads the
    weight once per tile)."""
    return min(64, max(8, 1 << (max(m, 1) - 1).bit_length()))


def _swap_ab_candidates(m: int, n: int, k: int, sms: int):
    """The token tile for M; the activation quantized in the kernel or by its own launch;
    K split over a cluster of 1, 2, 4 CTAs, and 3, 6 or 8 for few heads (TP8: 8 heads on
    132 SMs); a second epilogue warpgroup where a tile has 32 rows or more (below that one
    warpgroup's 16-row pass already covers it) or where it helps quantize the first tile;
    each block's promotion under the next block's WGMMAs as well (64-token tiles: with the
    fused quantizer only; the kernel's shape_problems rejects the rest)."""
    tile = swap_ab_tile(m)
    heads = n // 128
    splits = [s for s in (1, 2, 3, 4, 6, 8) if (k // 128) % s == 0 and (s in (1, 2, 4) or heads <= 16)]
    pipelined = (False, True) if tile <= SWAP_AB_PIPELINED_MAX_TILE else (False,)
    for fused, split, ewg, pipe in itertools.product((True, False), splits, (1, 2), pipelined):
        if ewg == 2 and tile < 32 and not fused:
            continue
        yield Tactic(kind="swap_ab", tile_m=tile, split_k=split, epilogue_warpgroups=ewg, fused_act_quant=fused,
                     pipelined_promotion=pipe)
    # Smaller token tiles than M needs: more CTAs quantize, multiply and run the epilogue
    # on fewer tokens each, at the cost of reading a head's weight once per tile (from L2
    # after the first). On the H200 they won at M = 64-128 (V4-Flash M = 128: 9.1 us with
    # 32-token tiles against 11.0 native; TP8 M = 64: 5.9 against 9.6). Only the knobs that
    # win at decode (fused quantizer, two epilogue warpgroups, pipelined promotion), and at
    # most two rounds of CTAs.
    small = tile // 2
    while small >= 8:
        units = -(-m // small) * heads
        for split in splits:
            if units * split <= 2 * sms:
                yield Tactic(kind="swap_ab", tile_m=small, split_k=split, epilogue_warpgroups=2,
                             fused_act_quant=True, pipelined_promotion=True)
        small //= 2
    # Token tiles unsplit, the first tile's quantizer shared by a cluster of 2 or 4 heads
    # (each quantizes 1 / cluster_n of the K blocks and sends them to the others): the
    # quantizer is the critical path there (trace, V4-Pro M = 16: 1.7 us of quantizing after
    # qr is staged, while the weight's ring stays full; 5.3 us for 32 tokens loading qr
    # themselves). Pairs on up to two rounds of CTAs (the second round's tiles quantize
    # alone; H200, V4-Pro M = 48: 16-token pairs on 192 tiles 7.84 us against 8.18 for the
    # table's unshared choice), clusters of 4 within about half the SMs (beyond that not
    # all stay resident).
    for t in (8, 16, 32, 64):  # M's tile and the smaller ones
        if t > tile:
            break
        units = -(-m // t) * heads
        for share in (2, 4):
            if heads % share == 0 and units <= (2 * sms if share == 2 else sms // 2):
                yield Tactic(kind="swap_ab", tile_m=t, cluster_n=share, epilogue_warpgroups=2,
                             fused_act_quant=True, pipelined_promotion=True)
    # Pairs of token tiles sharing a head's weight (cluster_m = 2: each CTA requests half of
    # every block and multicasts it to both), where M spans two tiles or more, on up to two
    # rounds of CTAs: each head's weight then enters the SMs once a pair, not once a tile
    # (a second tile's copy arrives no faster than DRAM serves the first: graph trace, V4-Pro
    # M = 64). But each CTA quantizes its tile alone; on the H200 they won at V4-Flash M =
    # 17-32 and V4-Pro M = 97-128 (ninth session) and lost to heads sharing the quantizer
    # elsewhere. With the separate quantizer as well: no CTA quantizes, the weight crosses once
    # and no K split has to be reduced (V4 at M = 64 on 32-token pairs: 128 CTAs); on the
    # H200 these lost everywhere (eleventh session: V4-Pro M = 64 10.4 us against the
    # table's 8.3), kept as candidates for other GPUs.
    for t in (8, 16, 32, 64):
        tiles = -(-m // t)
        if t > tile or tiles < 2:
            continue
        if -(-tiles // 2) * 2 * heads <= 2 * sms:
            for fused in (True, False):
                yield Tactic(kind="swap_ab", tile_m=t, cluster_m=2, epilogue_warpgroups=2, fused_act_quant=fused,
                             pipelined_promotion=True)


def _candidates():
    """Speed knobs worth timing: 64- and 128-row tiles with one or two epilogue
    warpgroups, the cluster shapes that won somewhere on the H200 (64-row tiles
    multicasting the weight, 128-row tiles multicasting the activation), 128-row tiles
    with the Hadamard on the tensor cores, a K split in 4 (TP8 decode), and 128-row tiles
    on a ring of 3 or 4 stages instead of the 5 that fit (H200, twelfth session: 4 stages
    0.1-0.6 us faster at V4 M = 192-512, where a CTA has one or two tiles). Left out:
    finer promotion (mma_per_promotion < 4 buys accuracy, never speed: 1.1x / 1.3x the
    time), 2x2 clusters (too few resident clusters: 1.9x the time), pipelined promotion
    (V4-Pro on the H200: 168 us at M = 4096 and 670 us at M = 16384, against 157 / 649 us
    for plain 64-row tiles and 136 / 574 us for 128-row tiles) and a K split in 2 (never
    won); all remain valid Tactics for experts."""
    for tile_m, ewg in itertools.product((64, 128), (1, 2)):
        yield Tactic(tile_m=tile_m, epilogue_warpgroups=ewg)
        if tile_m == 64:
            yield Tactic(tile_m=64, cluster_m=2, epilogue_warpgroups=ewg)
        else:
            yield Tactic(tile_m=128, cluster_n=2, epilogue_warpgroups=ewg)
    # the Hadamard's H16 factor on the tensor cores (one epilogue warpgroup); 3 stages leave
    # L1 room and won at V4-Pro M = 1024 and 16384 (H200, seventeenth session); with 64-row
    # tiles it never won on the H200 (decode: its tiles' latency the butterfly's skip avoids)
    yield Tactic(tile_m=128, tensor_core_hadamard=True)
    yield Tactic(tile_m=128, tensor_core_hadamard=True, stages=3)
    yield Tactic(tile_m=128, cluster_n=2, tensor_core_hadamard=True)
    # rastered along N, a wave's CTAs share their M tiles: 7% ahead of the tables' choice at
    # TP8 M = 16384 in one forced run, 24% behind at V4-Pro (H200, nineteenth session)
    yield Tactic(tile_m=128, tensor_core_hadamard=True, stages=3, raster_along_m=False)
    # in two epilogue warpgroups, one row a thread (and in the consumers' helper rows): ~22%
    # fewer epilogue instructions than their butterfly (CPU count, twentieth session)
    for tile_m, stages in ((128, 0), (128, 3), (64, 0)):
        yield Tactic(tile_m=tile_m, epilogue_warpgroups=2, tensor_core_hadamard=True, stages=stages)
    yield Tactic(tile_m=64, split_k=4, epilogue_warpgroups=2)
    for stages in (3, 4):
        yield Tactic(tile_m=128, epilogue_warpgroups=2, stages=stages)


def can_run(arch: str, tactic: Tactic, n: int, k: int) -> bool:
    """Whether the arch has a kernel of the tactic's kind that runs it at (N, K)."""
    cls = kernel_class(arch, tactic.kind)
    probe = dict(hadamard=True, fp4_rounding="floor-ties", out_format="mxfp4", positions_dtype="int64")
    return cls is not None and not tactic.problems(n) and cls.can_implement(tactic.to_config(arch, **probe), n, k)


def valid_tactics(arch: str, m: int, n: int, k: int, sms: int | None = None,
                  quantized_input: bool = False) -> list[Tactic]:
    """Every tactic the arch's kernels can run for (M, N, K) on a GPU of `sms` SMs (default
    SM90_SMS); the heuristic's is first. Swapped-A/B tactics are offered up to
    SWAP_AB_MAX_M tokens. `quantized_input`: for qr passed quantized, each tactic's twin
    that reads it (for_quantized_input; the knobs offered beside the fused quantizer are
    offered so), the heuristic's for that first."""
    if not any(a == arch for a, _ in KERNEL_CLASSES):
        return []
    sms = sms or SM90_SMS
    if quantized_input:
        twins = [for_quantized_input(arch, t, m, n, k, sms) for t in valid_tactics(arch, m, n, k, sms)]
        return list(dict.fromkeys([heuristic(arch, m, n, k, sms=sms, quantized_input=True)] + twins))
    out = [heuristic(arch, m, n, k, sms=sms)]
    cands = list(_candidates())
    if m <= PACED_NATIVE_MAX_M:
        # 64-row tiles whose producer keeps 3 K blocks in flight (loads_in_flight), plain and
        # with the pipelined promotion: with the whole ring requested at once every CTA's first
        # block landed with the last (H200, V4-Pro M = 128: 9.84 / 9.64 us against 11.24 for
        # 64-row tiles on 8 stages and 10.19 for the 128-row tile; lost at M = 256 and 4096)
        for pipe in (False, True):
            cands.append(Tactic(tile_m=64, epilogue_warpgroups=2, tensor_core_hadamard=True,
                                pipelined_promotion=pipe, loads_in_flight=3))
    if m >= SEPARATE_EPILOGUE_MIN_M:
        # two epilogue warpgroups: with one, the GEMM's copy-out was 3-7% slower (H200, 16th session)
        cands.append(Tactic(tile_m=128, epilogue_warpgroups=2, separate_epilogue=True))
    if m <= SWAP_AB_MAX_M:
        swapped = list(_swap_ab_candidates(m, n, k, sms))
        # The Hadamard's H16 factor on the tensor cores at 8 lanes a row, beside the knobs
        # that win at decode (fused quantizer, two epilogue warpgroups). On the H200 the
        # butterfly's Hadamard is ~0.66 of the 1.46 us epilogue tail of a 32-token tile (V4-Pro
        # M = 64, twentieth session); this one has 2 exchange stages fewer a value.
        swapped += [dataclasses.replace(t, tensor_core_hadamard=True) for t in swapped
                    if t.fused_act_quant and t.epilogue_warpgroups == 2]
        # The fused quantizer at 4 lanes a unit (32 values a lane), beside the knobs the tables
        # pick (tensor-core Hadamard, pipelined promotion), for tiles of 16 tokens or more: on
        # the H200 (25th session, the tables' tactics so) 0.3-0.7 us faster at V4 M = 24-96;
        # TP8's 8-token tiles split in 4 (24 units a CTA) lost 0.2 us, where 16 lanes a unit
        # spread the few units over more threads.
        swapped += [dataclasses.replace(t, act_quant_lanes=4) for t in swapped
                    if t.fused_act_quant and t.tile_m >= 16 and t.tensor_core_hadamard and t.pipelined_promotion]
        # 16-token tiles whose quantizers load qr themselves (stage_qr=False): the staging
        # buffer's 48 KB at K = 1536 go to the weight's ring (8 -> 11 stages), so the last
        # blocks are not requested only as the K loop frees stages (trace, V4-Pro M = 32: the
        # producer's last request at 3.6 us, the K loop's end 1.7 us later). The tables re-tuned
        # with them (H200, 26th session) pick them at V4-Pro M = 9-32 (16-token pairs of heads):
        # bench 5.88 -> 5.69 us at M = 16, 6.86 -> 6.70 at 24, 6.85 -> 6.54 at 32. Forced, 8-token
        # tiles lost 0.1-1 us so (their staged qr is small beside the ring). TP8's few heads
        # were not offered them until the 30th session: once the uniform descriptors made the K
        # loop ~0.12 us a block, TP8 M = 128's trace had blocks 6-11 wait on the ring's refills
        # (K loop end 3.40 -> 3.05 us after the PDL wait with them). Unsplit only: a split
        # rank's staged ring already holds its K blocks.
        swapped += [dataclasses.replace(t, stage_qr=False) for t in swapped
                    if t.fused_act_quant and t.tile_m == 16 and t.split_k == 1 and t.tensor_core_hadamard
                    and t.pipelined_promotion]
        # The first tile's weight scales loaded before the consumer's PDL wait (see GemmConfig),
        # for the 4-lane quantizers of 32-64-token tiles, whose later qr loads waited on the
        # scales' scoreboard in the SASS (16-token tiles issue their one batch before it). On
        # the H200 (27th session, A/B of the 32-token head pair): V4-Flash M = 24 5.15 -> 4.96
        # us, but M = 32-64 +0.15-0.30 and V4-Pro M = 24-96 +0.11-0.72.
        swapped += [dataclasses.replace(t, scales_before_pdl_wait=True) for t in swapped
                    if t.fused_act_quant and t.tile_m >= 32 and t.act_quant_lanes == 4]
        # Each block's WGMMA descriptors made from warp-uniform addresses, and the weight's
        # scales spread over the lanes (see GemmConfig): on the H200 (30th session, A/B on the
        # tables' tactics, NOTES version 116) TP8 0.05-0.47 us faster than the hoisted twins,
        # V4-Pro M = 1-8 and 48-64 0.15-0.3, V4's pairs of heads +0.0-0.16 (before the scales
        # were spread, +0.4-0.7: offered at few heads only then). Twins of the fused, pipelined
        # tiles up to 32 tokens at every head count; the tuner decides.
        swapped += [dataclasses.replace(t, uniform_descriptors=True) for t in swapped
                    if t.fused_act_quant and t.pipelined_promotion and t.tile_m <= 32]
        # The first tile's qr rows prefetched into L2 before the PDL wait (GemmConfig.prefetch_qr),
        # twins of the tiles the tables pick from M = 24 (fused, pipelined, tensor-core Hadamard,
        # uniform descriptors). On the H200 (36th session, forced twins of the tables' tactics,
        # two runs) V4 M = 96 -0.1 to -0.2 us and TP8 M = 32-64 -0.05 to -0.2, V4 M = 32-64
        # +0.05-0.17 and M <= 16 +-0.1: offered where it may win, the tuner decides.
        if m >= PREFETCH_QR_MIN_M:
            swapped += [dataclasses.replace(t, prefetch_qr=True) for t in swapped
                        if t.fused_act_quant and t.pipelined_promotion and t.tensor_core_hadamard
                        and t.uniform_descriptors]
        cands += swapped
        cands.append(Tactic(kind="swap_ab", tile_m=128))  # sm_100a's token tile (whole SF atoms)
    for t in cands:
        if t not in out and can_run(arch, t, n, k):
            out.append(t)
    return out


# The two-kernel tactic is offered from here (issue 17's range): below, its second launch
# and pass over y cost more (H200, 16th session: 15-50% slower than the fused op at M = 512).
SEPARATE_EPILOGUE_MIN_M = 1024
PACED_NATIVE_MAX_M = 512  # native tactics with loads_in_flight are offered up to here (decode and small batches)
PREFETCH_QR_MIN_M = 24  # prefetch_qr twins are offered from here (below, +-0.1 us: noise)
SM90_SMS = 132  # H100 / H200 SXM: the default where the caller does not give the GPU's count


def _many_heads(heads: int, sms: int) -> bool:
    """Heads that fill more than a quarter of the SMs with one CTA each (V4's 64 on 132,
    not TP8's 8): the heuristic sizes tiles, K splits and its swapped-A/B range by this."""
    return heads * 4 > sms


def _decode_token_tile(m: int, heads: int, sms: int) -> int:
    """The heuristic's token tile. Many heads (64: V4) fill about half the SMs with one CTA
    a head: the tile that holds M up to 32 tokens, 32-token tiles above (H200 tables, sixth
    session: V4-Flash M = 128 9.1 us against 11.0 with 64-token tiles). Few heads (TP8's 8):
    the smallest tile whose CTAs fit one round, so that more SMs quantize, multiply and
    run the epilogue (TP8 M = 64: 8- or 16-token tiles 4.9 us against 9.6 before)."""
    if _many_heads(heads, sms):
        return min(32, swap_ab_tile(m))
    tile = 8
    while tile < swap_ab_tile(m) and -(-m // tile) * heads > sms:
        tile *= 2
    return tile


@functools.lru_cache(maxsize=None)
def _swap_ab_heuristic(tile: int, token_tiles: int, n: int, k: int, sms: int,
                       quantized_input: bool = False) -> Tactic | None:
    """The decode heuristic's swapped-A/B tactic for `token_tiles` tiles of `tile` tokens at
    (N, K): the preferred K split first (the largest whose CTAs fit one round, none for
    staged tiles at many heads); where that does not fit the kernel's shared memory (at a
    large K the resident quantized tile and the qr staging buffer grow with it), the next
    split, then the separate quantizer; None where no swapped-A/B tactic runs (native
    tiles then). Cached: `can_run` is arithmetic, but the heuristic runs on every call
    without a table."""
    heads = n // 128
    units = token_tiles * heads

    def fits(split):
        # H200 tables, sixth session: clusters of 4 beyond ~64 CTAs do not all stay resident
        # (TP8 M = 32, 8-token tiles: 6.8 us split in 4 on 128 CTAs, 4.4 split in 2 on 64),
        # and few heads are fastest on about half the SMs (TP8 M = 64: 4.1-5.1 us on 64 CTAs,
        # 4.5-5.2 on 128); many heads want them all (V4-Pro M = 32: 7.3 us split in 2 on 128
        # CTAs, 9.5 unsplit on 64).
        return units * split <= (sms // 2 if split == 4 or not _many_heads(heads, sms) else sms)

    splits = [s for s in (4, 2, 1) if (k // 128) % s == 0 and fits(s)] or [1]
    share = 1  # heads (a cluster) sharing the first token tile's fused quantizer
    if tile <= SWAP_AB_QR_STAGED_MAX_TILE and heads >= SWAP_AB_UNSPLIT_MIN_HEADS:
        splits = [1] + [s for s in reversed(splits) if s != 1]
        # unsplit 16-token tiles: the quantizer is the critical path, a pair of heads shares
        # it (H200 tables, seventh session: V4-Pro M = 16 6.15 us against 6.56 alone,
        # V4-Flash 4.87 against 4.96). 8-token tiles quantize half as much: there the pair
        # was 1-4% slower (V4-Pro M = 1-8 5.86-6.00 against 5.66-5.84).
        if tile > 8 and heads % 2 == 0 and (k // 128) % 2 == 0 and units <= sms:
            share = 2
    even_blocks = (k // 128) % 2 == 0  # GemmConfig: pipelined_promotion needs an even K-block count
    for fused in (False,) if quantized_input else (True, False):
        # 64-token tiles pipeline their promotion with the fused quantizer only (with the
        # separate one the scales, loaded a block ahead, spill)
        pipelined = even_blocks and tile <= SWAP_AB_PIPELINED_MAX_TILE and (fused or tile <= 32)
        for split in splits:
            shared = share if fused and split == 1 else 1
            tactic = Tactic(kind="swap_ab", tile_m=tile, split_k=split, fused_act_quant=fused,
                            epilogue_warpgroups=2, pipelined_promotion=pipelined, cluster_n=shared)
            if can_run("sm_90a", tactic, n, k):
                return tactic
    return None


def heuristic(arch: str, m: int, n: int, k: int, sms: int | None = None, quantized_input: bool = False) -> Tactic:
    """The default without a tuned table, for a GPU of `sms` SMs (default SM90_SMS: the
    op passes the device's count, the tuner the table's). sm_90a: swapped A/B for decode
    and small batches (below); above, native 64-row tiles (one consumer warpgroup) while
    128-row tiles would fill at most half the SMs, 128-row tiles otherwise, no K split (on
    the H200 a native K split never won). sm_100a: its one tile. `quantized_input`: qr
    comes quantized (no fused quantizer)."""
    if arch == "sm_100a":
        return Tactic(tile_m=128)
    sms = sms or SM90_SMS
    if m <= (SWAP_AB_HEURISTIC_MAX_M if _many_heads(n // 128, sms) else SWAP_AB_MAX_M):
        # Decode and small batches: swapped A/B, one launch, the K split filling about the SMs (H200: V4-Pro
        # M = 1 6.2 us split in 2, 7.0 unsplit, 10.8 split in 4; TP8 3.7-3.9 split in 4,
        # 4.9 unsplit), two epilogue warpgroups (they also quantize the first tile: H200
        # V4-Pro M = 16 6.94 us against 7.18 with one, TP8 4.34 against 4.45), and up to
        # 32-token tiles each block's promotion under the next block's WGMMAs (the tuner's
        # timings, fourth session: within 0-8% of the fastest candidate at M <= 32 on the
        # four H200 tables, against 3-14% without it). No K split for tiles whose qr the
        # kernel stages by TMA where the heads alone fill about half the SMs: one CTA a head then
        # streams the weight at copy speed and skips the reduction (H200, fifth session:
        # V4-Pro M = 13 6.38 us against 6.56 split in 2, V4-Flash M = 16 4.93 against 5.47).
        # Token tiles sized to the SMs rather than to M (_decode_token_tile): up to M = 128
        # for many heads, 256 for few; against the sixth session's H200 timings this picks
        # within 0-10% of the fastest candidate at every M bucket of the four tables.
        tile = _decode_token_tile(m, n // 128, sms)
        decode = _swap_ab_heuristic(tile, -(-m // tile), n, k, sms, quantized_input)
        if decode is not None:
            return decode
    tiles_of_128 = -(-m // 128) * (n // 128)
    # Two epilogue warpgroups: on the H200 faster at every M for 64-row tiles (0.4-1 us
    # at M <= 128) and for 128-row tiles but at V4-Pro M >= 4096 (3% slower there, which
    # its table covers); up to 9% faster at V4-Flash M = 4096.
    return Tactic(tile_m=64 if tiles_of_128 <= sms // 2 else 128, epilogue_warpgroups=2)


@functools.lru_cache(maxsize=4096)  # on every quantized-qr call without a table entry for it
def for_quantized_input(arch: str, tactic: Tactic, m: int, n: int, k: int, sms: int | None = None) -> Tactic:
    """The tactic to run where the caller passes qr already quantized (SPEC step 1's output):
    `tactic` itself unless it quantizes qr in the kernel; else its twin that reads the
    quantized activation (the fused quantizer's own knobs back to their defaults; a 64-token
    tile's pipelined promotion, which needs the fused quantizer, off with what needs it);
    else the heuristic's.
    The twin keeps what the tables tuned about the weight's stream and the epilogue."""
    if not tactic.fused_act_quant:
        return tactic
    twin = dataclasses.replace(tactic, fused_act_quant=False, act_quant_lanes=16, stage_qr=True, prefetch_qr=False,
                               cluster_n=1 if tactic.kind == "swap_ab" else tactic.cluster_n)
    for candidate in (twin, dataclasses.replace(twin, pipelined_promotion=False, scales_before_pdl_wait=False)):
        if can_run(arch, candidate, n, k):
            return candidate
    return heuristic(arch, m, n, k, sms=sms, quantized_input=True)
