#!/bin/bash
# A/B test of a change in one device call: tree A is this checkout, tree B a copy of it with
# PATCH applied (-R: reversed, i.e. B is the tree before a change already in this checkout).
# Their bench processes alternate A, B, A, B, ... (ROUNDS pairs) with the same arguments,
# each tree on its own JIT cache, so run-to-run drift shows up as the spread inside A and
# inside B. From the repository root, on the GPU machine:
#   bash tuning/ab_bench.sh [-R] PATCH OUT ROUNDS BENCH_ARGS...
#   e.g. bash tuning/ab_bench.sh -R /tmp/change.patch $OUT 2 --no-peers --shapes v4-pro \
#          --m 192 256 --tactic kind=native,tile_m=128,epilogue_warpgroups=2
# Writes OUT/ab.tgz (each run's bench JSON and log) and prints python -m tuning.ab_summary's
# table of A against B. Make the patch with `git diff > PATCH` (or `git diff REV`), and
# keep it inside the tree that travels (e.g. an untracked file at the root).
set -uo pipefail
reverse=()
if [ "${1:-}" = "-R" ]; then reverse=(-R); shift; fi
patch_file=$(realpath "$1"); out=$2; rounds=$3; shift 3
mkdir -p "$out/ab"
here=$PWD
b_tree=$(mktemp -d /tmp/ab_tree_B.XXXX)
cp -a src kernels tuning tests "$b_tree"/ && (cd "$b_tree" && patch "${reverse[@]}" --batch -p1 -s < "$patch_file") \
  || { echo "ab_bench: the patch does not apply to src, kernels, tuning and tests"; rm -rf "$b_tree"; exit 1; }
base=$(echo "$PYTHONPATH" | tr ':' '\n' | grep -v -x -e "$here/src" -e "$here" | paste -sd: -)
t0=$SECONDS
for round in $(seq 1 "$rounds"); do
  for side in A B; do
    tree=$here; [ "$side" = B ] && tree=$b_tree
    tag=${side}${round}
    (cd "$tree" && INDEXER_Q_CACHE_DIR=/tmp/iqc_ab_$side PYTHONPATH="$tree/src:$tree:$base" \
      python3 -m tuning.bench --no-plots --out "$out/ab/$tag" "$@" > "$out/ab/$tag.log" 2>&1)
    echo "$tag rc=$? at $((SECONDS - t0)) s"
  done
done
shopt -s nullglob; runs=("$out"/ab/*.json)
if [ ${#runs[@]} -gt 0 ]; then python3 -m tuning.ab_summary "${runs[@]}" | tee "$out/ab/summary.md"
else echo "ab_bench: no bench run wrote its JSON (see the logs in ab.tgz)"; fi
tar czf "$out/ab.tgz" -C "$out" ab && rm -rf "$out/ab" "$b_tree"
