#!/bin/bash
# After a kernel change, in one device call (~6 minutes on an H200): re-tune the four
# (model, TP) tables, merge them into the packaged table, then bench decode and small M on
# them. From the repository root:
#   [BENCH_MS="1024 4096 16384"] [M_MAX=512] [TABLES="v4-pro:8 v4-flash:8:256"] bash tuning/retune_bench.sh OUT [COMMIT]
# (M_MAX: re-tune only the buckets up to it, keeping the committed tables' entries above;
# TABLES: re-tune only these (model:tp, or model:tp:M_MAX for that table's own, or
# model:tp:M_MAX:M_MIN for the buckets above M_MIN up to M_MAX), the others kept as
# committed; BENCH_MS=none: no bench)
# Bring back OUT/tables.tgz (its t/*.json go to tuning/tables/ and src/indexer_q/tables/, with
# the tuner's logs) and OUT/b/bench.*: the device tool returns at most 8 files a call, and
# the tables and logs alone are 9 (the eleventh session lost v4-pro tp8's file that way).
set -uo pipefail
out=$1; commit=${2:-unknown}; mkdir -p "$out/t" "$out/b"
export INDEXER_Q_CACHE_DIR=/tmp/iq_cache
t0=$SECONDS
for mt in ${TABLES:-v4-pro:1 v4-flash:1 v4-pro:8 v4-flash:8}; do
  IFS=: read -r model tp table_m_max m_min <<< "$mt"
  m_max=${table_m_max:-${M_MAX:-}}
  if [ -n "$m_max$m_min" ]; then cp "tuning/tables/NVIDIA_H200_${model}_tp$tp.json" "$out/t/"; fi
  python3 -m tuning.tune --model "$model" --tp "$tp" --out "$out/t/NVIDIA_H200_${model}_tp$tp.json" \
    ${m_max:+--m-max $m_max} ${m_min:+--m-min $m_min} > "$out/t/${model}_tp$tp.log" 2>&1
  echo "tune $model tp$tp rc=$? at $((SECONDS - t0)) s"
done
cp "$out"/t/NVIDIA_H200_v4-*.json tuning/tables/ && python3 -m tuning.tune --merge tuning/tables/NVIDIA_H200_v4-*_tp*.json
cp src/indexer_q/tables/NVIDIA_H200.json "$out/t/"
tar czf "$out/tables.tgz" -C "$out" t && rm -rf "$out/t"
[ "${BENCH_MS:-}" = none ] && exit 0
INDEXER_Q_COMMIT=$commit timeout $((590 - (SECONDS - t0))) python3 -m tuning.bench --m ${BENCH_MS:-1 2 3 4 8 13 16 24 32 48 64 96 128 192 256 384 512} --no-plots --out "$out/b/bench" > "$out/b/bench.log" 2>&1
echo "bench rc=$? at $((SECONDS - t0)) s"
