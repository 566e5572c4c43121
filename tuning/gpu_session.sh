#!/bin/bash
# Everything that needs the GPU, in one go, logs and results under OUT (default
# /tmp/indexer_q_gpu). From the repository root on a machine with an H100/H200:
#   bash tuning/gpu_session.sh [OUT] [quick]
# Steps are independent: one failing does not stop the others; the exit status is the
# number of failed steps.
set -uo pipefail
out=${1:-/tmp/indexer_q_gpu}
quick=${2:-}
mkdir -p "$out"
export PYTHONWARNINGS=ignore INDEXER_Q_CACHE_DIR="$out/cache"
fails=0
step() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s: $(tail -1 "$out/$name.log")"
  [ $rc -eq 0 ] || fails=$((fails + 1))
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader > "$out/gpu.txt"
# every valid tactic x 8 numerics per (N, K): ~900-1100 kernels each, so one step a shape pair
for nk in 1024-1024 1024-1536 8192-1024 8192-1536; do
  step tests_criterion_$nk 590 python3 -m pytest -q -p no:cacheprovider tests/test_criterion_gpu.py -k "$nk"
done
step tests_swap_ab 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_sm90_swap_ab.py
step tests_kernel 420 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_sm90.py -k "not fp8"
step tests_op 300 python3 -m pytest -q -p no:cacheprovider tests/test_op_gpu.py
step tests_reliability 420 python3 -m pytest -q -p no:cacheprovider tests/test_reliability_gpu.py
step tests_peer 120 python3 -m pytest -q -p no:cacheprovider tests/test_peer_triton.py
step tests_tp 200 python3 -m pytest -q -p no:cacheprovider tests/test_tp_gpu.py  # skips below 2 GPUs
step host_overhead 120 python3 -m tuning.host_overhead 1
step tests_fp8 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_sm90.py -k fp8
if [ -z "$quick" ]; then
  step sanitize 600 bash tuning/sanitize.sh "$out/sanitize"
  step bench 590 python3 -m tuning.bench --no-plots --out "$out/bench"  # plots: tuning.bench.plot on the CPU
  step decode_parts 120 python3 -m tuning.decode_parts --m 1 8 16 --out "$out/decode_parts.jsonl"
  step tune_pro_tp1 590 python3 -m tuning.tune --model v4-pro --tp 1 --out "$out/H200_v4-pro_tp1.json"
  step tune_pro_tp8 590 python3 -m tuning.tune --model v4-pro --tp 8 --out "$out/H200_v4-pro_tp8.json"
  step tune_flash_tp1 590 python3 -m tuning.tune --model v4-flash --tp 1 --out "$out/H200_v4-flash_tp1.json"
  step tune_flash_tp8 590 python3 -m tuning.tune --model v4-flash --tp 8 --out "$out/H200_v4-flash_tp8.json"
else
  step bench 590 python3 -m tuning.bench --quick --out-format mxfp4 fp8 fp8-unscaled --shapes v4-pro --out "$out/bench"
fi
exit $fails
