#!/bin/bash
# The GPU check of swap_ab_weight_multicast.patch (NOTES version 54), in one device call of
# under 10 minutes. From the repository root, with the patch applied:
#   git apply tuning/pending/swap_ab_weight_multicast.patch
#   bash tuning/pending/swap_ab_weight_multicast.sh OUT
# 1. its byte cases, with the sanitizers beside them (different processes, one GPU);
# 2. once both are done, the timing: every valid cluster_m=2 tactic beside the tables'
#    choices (one process, interleaved), and the graph-replay trace of the 16-token pair
#    against the 16-token heads pair at V4-Pro M = 32.
# Everything lands in OUT; tar it (the device tool returns 8 files at most).
set -uo pipefail
out=${1:-/tmp/weight_multicast}
mkdir -p "$out"
pair="kind=swap_ab,epilogue_warpgroups=2,fused_act_quant=True,pipelined_promotion=True,cluster_m=2"
(
  SANITIZE_SPECS="${pair/kind=swap_ab,/kind=swap_ab,tile_m=16,} ${pair/kind=swap_ab,/kind=swap_ab,tile_m=32,}" \
    timeout 400 bash tuning/sanitize.sh "$out/sanitize" > "$out/sanitize.txt" 2>&1
  echo "sanitize rc=$?" >> "$out/sanitize.txt"
  # a CTA moving between token tiles (7 token tiles over 64 heads), which N = 1024 never gives
  timeout 200 compute-sanitizer --tool racecheck --error-exitcode 99 python3 -m tuning.smoke --cases \
    "100:8192:1536:${pair/kind=swap_ab,/kind=swap_ab,tile_m=16,}" > "$out/racecheck_n8192.txt" 2>&1
  echo "racecheck N=8192 rc=$?" >> "$out/racecheck_n8192.txt"
) &
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_sm90_swap_ab.py -k token_tiles \
  > "$out/tests.txt" 2>&1
echo "tests rc=$?" >> "$out/tests.txt"
wait
tail -2 "$out/tests.txt" "$out/sanitize.txt" "$out/racecheck_n8192.txt"
grep -q "tests rc=0" "$out/tests.txt" || exit 1
timeout 150 python3 -m tuning.bench --m 9 16 24 32 48 64 96 128 --no-plots --tactics-where cluster_m=2 \
  --out "$out/forced" > "$out/forced.log" 2>&1
echo "forced bench rc=$?"
for t in "kind=swap_ab,tile_m=16,cluster_m=2,epilogue_warpgroups=2,pipelined_promotion=True,fused_act_quant=True" \
         "kind=swap_ab,tile_m=16,cluster_n=2,epilogue_warpgroups=2,pipelined_promotion=True,fused_act_quant=True"; do
  echo "== $t"
  timeout 60 python3 -m tuning.trace_decode --stream --shapes v4-pro --m 32 --tactic "$t" --runs 7 2>&1 \
    | grep "M=" | grep -v "kb[1-4]"
done > "$out/trace.txt"
cat "$out/trace.txt"
