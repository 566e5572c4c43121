#!/bin/bash
# The GPU check of swap_ab_grid_quantizer.patch (NOTES version 55), in two device calls of
# under 10 minutes each. From the repository root, with the patch applied:
#   git apply tuning/pending/swap_ab_grid_quantizer.patch
#   bash tuning/pending/swap_ab_grid_quantizer.sh OUT check   # ~5 minutes
#   bash tuning/pending/swap_ab_grid_quantizer.sh OUT time    # ~4 minutes, only if check passed
# check: its byte cases (a hang shows as the timeout; stop there if they fail), then
#   compute-sanitizer over two grid tactics at M = 1 and 130 (N = K = 1024), and racecheck at
#   N = 8192, M = 200 (CTAs visiting several token tiles: claims and resets across them);
# time: every valid grid_act_quant tactic forced beside the tables' choices (one process,
#   interleaved), then the graph-replay trace of the grid's 32- and 16-token pairs at V4-Pro
#   M = 64 and 32 against the table's 32-token heads pair.
# Everything lands in OUT; tar it (the device tool returns 8 files at most).
set -uo pipefail
out=${1:-/tmp/grid_quant}
part=${2:-check}
mkdir -p "$out"
export INDEXER_Q_CACHE_DIR=/tmp/iq_cache
g="kind=swap_ab,epilogue_warpgroups=2,pipelined_promotion=True,grid_act_quant=True"
if [ "$part" = check ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_sm90_swap_ab.py -k grid > "$out/tests.txt" 2>&1
  echo "tests rc=$?" >> "$out/tests.txt"
  tail -n 3 "$out/tests.txt"
  grep -q "tests rc=0" "$out/tests.txt" || exit 1
  SANITIZE_SPECS="$g,tile_m=16,cluster_m=2 $g,tile_m=8,split_k=2" timeout 200 bash tuning/sanitize.sh \
    "$out/sanitize" > "$out/sanitize.txt" 2>&1
  echo "sanitize rc=$?" >> "$out/sanitize.txt"
  timeout 100 compute-sanitizer --tool racecheck --error-exitcode 99 python3 -m tuning.smoke --cases \
    "200:8192:1536:$g,tile_m=32,cluster_m=2" > "$out/racecheck_n8192.txt" 2>&1
  echo "racecheck N=8192 rc=$?" >> "$out/racecheck_n8192.txt"
  tail -n 2 "$out/sanitize.txt" "$out/racecheck_n8192.txt"
else
  timeout 300 python3 -m tuning.bench --m 16 24 32 48 64 96 128 --no-plots --tactics-where grid_act_quant=True \
    --out "$out/forced" > "$out/forced.log" 2>&1
  echo "forced bench rc=$?"
  base="kind=swap_ab,epilogue_warpgroups=2,pipelined_promotion=True"
  for t in "$base,grid_act_quant=True,tile_m=32,cluster_m=2" "$base,fused_act_quant=True,tile_m=32,cluster_n=2" \
           "$base,grid_act_quant=True,tile_m=16,cluster_m=2"; do
    echo "== $t"
    timeout 70 python3 -m tuning.trace_decode --stream --shapes v4-pro --m 64 32 --tactic "$t" --runs 7 2>&1 \
      | grep "since_pdl_wait" | grep -v "kb[1-4]"
  done > "$out/trace.txt"
  cat "$out/trace.txt"
fi
