#!/bin/bash
# Nsight Compute profile of one fused-kernel launch, with per-SASS-instruction stall
# samples: bash tuning/profile.sh OUT_DIR [M N K [field=value,...]]
# Writes OUT_DIR/prof.ncu-rep, details.csv (sections) and sass.csv (source page).
# NCU_WARP_SAMPLING=0 samples every 32 cycles (ncu's --warp-sampling-interval): a short
# decode launch gives few stall samples at the default.
#   e.g. NCU_WARP_SAMPLING=0 bash tuning/profile.sh $OUT 256 8192 1536 tile_m=128,epilogue=False
set -uo pipefail
out=${1:-/tmp/indexer_q_prof}; m=${2:-16384}; n=${3:-8192}; k=${4:-1536}; spec=${5:-}
mkdir -p "$out"
sampling=(); [ -n "${NCU_WARP_SAMPLING:-}" ] && sampling=(--warp-sampling-interval "$NCU_WARP_SAMPLING")
ncu --kernel-name regex:Sm90.*Fused --launch-count 1 "${sampling[@]}" \
  --section SpeedOfLight --section WarpStateStats --section SourceCounters \
  --section LaunchStats --section Occupancy --section InstructionStats --section MemoryWorkloadAnalysis \
  -f -o "$out/prof" python3 -m tuning.smoke "$m" "$n" "$k" $spec > "$out/ncu.log" 2>&1
ncu -i "$out/prof.ncu-rep" --page details --csv > "$out/details.csv" 2>&1
ncu -i "$out/prof.ncu-rep" --page source --csv --print-source sass > "$out/sass.csv" 2>&1
tail -2 "$out/ncu.log"; wc -l "$out"/*.csv
