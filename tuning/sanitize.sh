#!/bin/bash
# compute-sanitizer (memcheck, racecheck, synccheck) over every tactic kind at small
# shapes, one process per tool. Needs a GPU; from the repository root:
#   bash tuning/sanitize.sh [OUT_DIR]
# Kernels come from the disk cache when present (a first plain run fills it). Overrides:
# SANITIZE_SPECS (tactics), SANITIZE_TOOLS (e.g. "memcheck"), INDEXER_Q_SMOKE_FORMATS
# (output formats, comma-separated; default mxfp4).
set -uo pipefail
out=${1:-/tmp/indexer_q_sanitize}
mkdir -p "$out"
cases=()
specs=("tile_m=64" "tile_m=128" "tile_m=128,cluster_m=2" "tile_m=128,cluster_n=2" "tile_m=64,pipelined_promotion=True"
       "tile_m=64,split_k=2" "tile_m=64,split_k=4" "tile_m=64,epilogue_warpgroups=2"
       "tile_m=128,epilogue_warpgroups=2" "tile_m=64,split_k=4,epilogue_warpgroups=2"
       "tile_m=128,epilogue_warpgroups=1,tensor_core_hadamard=True"
       "tile_m=64,epilogue_warpgroups=1,tensor_core_hadamard=True"
       "kind=swap_ab,tile_m=8" "kind=swap_ab,tile_m=8,fused_act_quant=True"
       "kind=swap_ab,tile_m=16,split_k=2,fused_act_quant=True" "kind=swap_ab,tile_m=64,split_k=4"
       "kind=swap_ab,tile_m=64,split_k=2,epilogue_warpgroups=2,fused_act_quant=True"
       "kind=swap_ab,tile_m=16,epilogue_warpgroups=2,fused_act_quant=True,pipelined_promotion=True,cluster_n=2"
       "kind=swap_ab,tile_m=8,fused_act_quant=True,cluster_n=4"
       "kind=swap_ab,tile_m=16,epilogue_warpgroups=2,fused_act_quant=True,pipelined_promotion=True,cluster_m=2"
       "kind=swap_ab,tile_m=32,epilogue_warpgroups=2,fused_act_quant=True,pipelined_promotion=True,cluster_m=2"
       "tile_m=128,epilogue_warpgroups=2,tensor_core_hadamard=True"
       "kind=swap_ab,tile_m=8,split_k=2,epilogue_warpgroups=2,fused_act_quant=True,pipelined_promotion=True,tensor_core_hadamard=True"
       "kind=swap_ab,tile_m=16,cluster_n=2,epilogue_warpgroups=2,fused_act_quant=True,pipelined_promotion=True,tensor_core_hadamard=True"
       "kind=swap_ab,tile_m=32,split_k=2,epilogue_warpgroups=2,fused_act_quant=True,pipelined_promotion=True,tensor_core_hadamard=True"
       "tile_m=64,epilogue_warpgroups=2,tensor_core_hadamard=True,pipelined_promotion=True,loads_in_flight=3"
       "kind=swap_ab,tile_m=32,cluster_n=2,epilogue_warpgroups=2,fused_act_quant=True,pipelined_promotion=True,act_quant_lanes=4,scales_before_pdl_wait=True"
       "kind=swap_ab,tile_m=16,epilogue_warpgroups=2,fused_act_quant=True,pipelined_promotion=True,act_quant_lanes=4,tensor_core_hadamard=True,uniform_descriptors=True"
       "kind=swap_ab,tile_m=8,split_k=4,epilogue_warpgroups=2,fused_act_quant=True,pipelined_promotion=True,uniform_descriptors=True"
       "kind=swap_ab,tile_m=32,cluster_n=2,epilogue_warpgroups=2,fused_act_quant=True,pipelined_promotion=True,act_quant_lanes=4,tensor_core_hadamard=True,uniform_descriptors=True,prefetch_qr=True"
       "kind=swap_ab,tile_m=8,split_k=2,epilogue_warpgroups=2,fused_act_quant=True,pipelined_promotion=True,tensor_core_hadamard=True,uniform_descriptors=True,prefetch_qr=True")
[ -n "${SANITIZE_SPECS:-}" ] && read -ra specs <<< "$SANITIZE_SPECS"  # e.g. "tile_m=64,split_k=2 tile_m=64"
for spec in "${specs[@]}"; do
  for m in 1 130; do cases+=("$m:1024:1024:$spec"); done
done
python3 -m tuning.smoke --cases "${cases[@]}" > "$out/plain.log" 2>&1 || { echo "plain run failed"; exit 1; }
status=0
tools=(memcheck racecheck synccheck)
[ -n "${SANITIZE_TOOLS:-}" ] && read -ra tools <<< "$SANITIZE_TOOLS"
for tool in "${tools[@]}"; do
  log="$out/$tool.log"
  compute-sanitizer --tool "$tool" --error-exitcode 99 python3 -m tuning.smoke --cases "${cases[@]}" > "$log" 2>&1
  rc=$?
  summary=$(grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$log" | tail -1)
  echo "$tool: ${#cases[@]} cases, rc=$rc, $(grep -c '^ok ' "$log") ok, $summary"
  [ $rc -eq 0 ] || status=1
done
exit $status
