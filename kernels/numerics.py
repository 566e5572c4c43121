"""The SPEC's numeric constants as plain Python, importable without CuTe DSL (the host's
compile keys and cache lookups use them; a process that loads kernels from the disk cache
never imports the DSL)."""

HEAD_DIM = 128
ROPE_DIMS = 64
MXFP4_BLOCK = 32
FP8_MAX = 448.0
FP4_MAX = 6.0
AMAX_FLOOR = 1e-4
HADAMARD_SCALE = 128.0 ** -0.5  # rounded to fp32 once, as the reference does

# Output formats; plain ints so they can be compile-time constants of a kernel.
OUT_MXFP4 = 0
OUT_FP8 = 1
OUT_FP8_UNSCALED = 2
OUT_BF16 = 3
# The GEMM's own bf16 output y (SPEC step 2), no RoPE, Hadamard or quantization: the first
# launch of the two-kernel tactic (Tactic.separate_epilogue), whose second launch,
# kernels/row_epilogue.py, runs steps 3-6 over it. Internal: the public op never offers it.
OUT_GEMM_BF16 = 4
OUT_FORMATS = {"mxfp4": OUT_MXFP4, "fp8": OUT_FP8, "fp8-unscaled": OUT_FP8_UNSCALED, "bf16": OUT_BF16,
               "gemm-bf16": OUT_GEMM_BF16}
# Output bytes a head row takes in each format (q only; the scale is separate).
Q_BYTES_PER_HEAD = {"mxfp4": HEAD_DIM // 2, "fp8": HEAD_DIM, "fp8-unscaled": HEAD_DIM, "bf16": 2 * HEAD_DIM,
                    "gemm-bf16": 2 * HEAD_DIM}
