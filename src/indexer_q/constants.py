"""Names and sizes of the contract, importable without torch (the CLI parser uses them)."""

FP4_ROUNDINGS = ("floor-ties", "rne")
OUT_FORMATS = ("mxfp4", "fp8", "fp8-unscaled", "bf16")
SCALED_FORMATS = ("mxfp4", "fp8")  # the formats with a q_scale output (the others return None)
BLOCK = 128          # K block of the scales
HEAD_DIM = 128       # one head = one 128-wide N tile
ROPE_WIDTH = 64      # cos_sin columns: 32 cos then 32 sin
# q bytes of one head row in each format (the 32-bit offset limit uses it)
Q_BYTES_PER_HEAD = {"mxfp4": HEAD_DIM // 2, "fp8": HEAD_DIM, "fp8-unscaled": HEAD_DIM, "bf16": 2 * HEAD_DIM}

# compute capability -> kernel arch: the one map (indexer_q.arch uses it)
ARCH_BY_CAPABILITY = {(9, 0): "sm_90a", (10, 0): "sm_100a"}
SUPPORTED_ARCHES = tuple(ARCH_BY_CAPABILITY.values())
