#!/bin/bash
# compute-sanitizer (memcheck, racecheck, synccheck) over every tactic kind at small
# shapes. Needs a GPU; run from the repository root:  bash tuning/sanitize.sh [OUT_DIR]
set -uo pipefail
out=${1:-/tmp/indexer_q_sanitize}
mkdir -p "$out"
status=0
for tool in memcheck racecheck synccheck; do
  for spec in "tile_m=64" "tile_m=128" "tile_m=128,cluster_m=2" "tile_m=128,cluster_n=2"; do
    for m in 1 130; do
      log="$out/${tool}_${spec//[,=]/_}_m${m}.log"
      compute-sanitizer --tool "$tool" --error-exitcode 99 \
        python3 -m tuning.smoke "$m" 1024 1024 "$spec" > "$log" 2>&1
      rc=$?
      summary=$(grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$log" | tail -1)
      echo "$tool $spec M=$m rc=$rc $summary"
      [ $rc -eq 0 ] || status=1
    done
  done
done
exit $status
