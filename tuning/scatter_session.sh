#!/bin/bash
# Branch perf/reduce-scatter: the first GPU run of the reduce-scattering K split (swapped A/B),
# from the repository root on an H100/H200 (logs under OUT), in two parts of < 10 minutes:
#   bash tuning/scatter_session.sh OUT 1   bytes against the gathering split (a hang shows here
#                                          first), helper-quantizer tests, Nsight Compute on the
#                                          T = 64 probe, where the decode time goes
#   bash tuning/scatter_session.sh OUT 2   compute-sanitizer over scattering tactics, every valid
#                                          tactic timed at M = 16-64 beside DeepGEMM
# The tables are stale on this branch until re-tuned.
set -uo pipefail
out=${1:-/tmp/scatter}; part=${2:-1}
mkdir -p "$out"
export PYTHONWARNINGS=ignore
if [ "$part" = 1 ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_sm90_swap_ab.py -k "reduce_scatter or helpers" \
    > "$out/tests.log" 2>&1; echo "tests rc=$? $(tail -1 "$out/tests.log")"
  # where the swap-AB stream time goes at T = 64 (NOTES "Next" 3a): Nsight Compute on the probe
  timeout 150 bash tuning/profile.sh "$out/prof64" 64 8192 1536 \
    kind=swap_ab,tile_m=64,split_k=2,epilogue_warpgroups=2,fused_act_quant=True,epilogue=False; echo "profile rc=$?"
  for spec in "v4-pro 16 tile_m=16,split_k=2" "v4-pro 32 tile_m=32,split_k=2" "v4-pro 64 tile_m=64,split_k=2" \
              "tp8-pro 32 tile_m=32,split_k=4" "tp8-pro 64 tile_m=64,split_k=4"; do
    set -- $spec
    timeout 60 python3 -m tuning.decode_parts --shapes "$1" --m "$2" \
      --tactic "kind=swap_ab,$3,epilogue_warpgroups=2,fused_act_quant=True" 2>&1 | grep '^{' >> "$out/decode_parts.jsonl"
  done
  echo "decode parts: $(wc -l < "$out/decode_parts.jsonl") rows"
else
  SANITIZE_SPECS="kind=swap_ab,tile_m=16,split_k=2,epilogue_warpgroups=2,fused_act_quant=True \
kind=swap_ab,tile_m=64,split_k=4,epilogue_warpgroups=2,fused_act_quant=True kind=swap_ab,tile_m=32,split_k=4" \
    timeout 200 bash tuning/sanitize.sh "$out/sanitize"; echo "sanitize rc=$?"
  timeout 300 python3 -m tuning.bench --shapes v4-pro tp8-pro --m 16 32 64 --all-tactics --no-plots --out "$out/allt" \
    > "$out/bench.log" 2>&1; echo "bench rc=$?"
fi
