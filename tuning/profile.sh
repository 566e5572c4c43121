#!/bin/bash
# Nsight Compute profile of one fused-kernel launch, with per-SASS-instruction stall
# samples: bash tuning/profile.sh OUT_DIR [M N K [field=value,...]]
# Writes OUT_DIR/prof.ncu-rep, details.csv (sections) and sass.csv (source page); summarize
# the stall samples with `python -m tuning.ncu_sass OUT_DIR` (the K loop's apart).
# NCU_WARP_SAMPLING=0 samples every 32 cycles (ncu's --warp-sampling-interval): a short
# decode launch gives few stall samples at the default.
#   e.g. NCU_WARP_SAMPLING=0 bash tuning/profile.sh $OUT 256 8192 1536 tile_m=128,epilogue=False
# NCU_KERNEL=REGEX profiles another of the op's kernels (e.g. RowEpilogue, the two-kernel
# tactic's second launch, with separate_epilogue=True in the fields).
# PEER=deepgemm profiles DeepGEMM's GEMM at the same shape instead (its second launch: the
# first JIT-compiles), for a cycle-for-cycle comparison.
set -uo pipefail
out=${1:-/tmp/indexer_q_prof}; m=${2:-16384}; n=${3:-8192}; k=${4:-1536}; spec=${5:-}
mkdir -p "$out"
sampling=(); [ -n "${NCU_WARP_SAMPLING:-}" ] && sampling=(--warp-sampling-interval "$NCU_WARP_SAMPLING")
target=(--kernel-name "regex:${NCU_KERNEL:-Sm90.*Fused}" --launch-count 1); cmd=(python3 -m tuning.smoke "$m" "$n" "$k" $spec)
if [ "${PEER:-}" = deepgemm ]; then
  target=(--kernel-name regex:fp8_gemm --launch-skip 1 --launch-count 1); cmd=(python3 -m tuning.peers.deepgemm "$m" "$n" "$k")
fi
ncu "${target[@]}" "${sampling[@]}" \
  --section SpeedOfLight --section WarpStateStats --section SourceCounters --section ComputeWorkloadAnalysis \
  --section LaunchStats --section Occupancy --section InstructionStats --section MemoryWorkloadAnalysis \
  -f -o "$out/prof" "${cmd[@]}" > "$out/ncu.log" 2>&1
ncu -i "$out/prof.ncu-rep" --page details --csv > "$out/details.csv" 2>&1
ncu -i "$out/prof.ncu-rep" --page source --csv --print-source sass > "$out/sass.csv" 2>&1
tail -2 "$out/ncu.log"; wc -l "$out"/*.csv
