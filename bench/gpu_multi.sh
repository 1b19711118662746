#!/usr/bin/env bash
# Prefill and decode on their own GPUs of one host (a machine of 4 or more GPUs): TP 2 -> 2 on
# GPUs 0,1 -> 2,3, TP 1 -> 2 on 0 -> 2,3, TP 2 -> 1 on 0,1 -> 2, and TP 2 -> 2 sharing GPUs 0,1;
# direct (8 in flight) and ring, each row under both executors, against raw NIXL and a torch p2p
# copy of the same bytes between the same GPUs in the same run; bytes checked in every row. Then
# the native e2e and differential tests on VRAM. With fewer than 4 GPUs it says so and stops.
#
# On the device, from the repository root, with the wheels of bench/gpu_common.sh in .whl/:
#   bash bench/gpu_multi.sh
set -u
source "$(dirname "$0")/gpu_common.sh"
n=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$R/gpu.txt"
nvidia-smi topo -m | tee "$R/topo.txt"
if [ "$n" -lt 4 ]; then echo "gpu_multi: needs 4 GPUs, this machine has $n"; exit 2; fi
step build 60 python3 -P -m kvferry.backends.native.build --out /tmp/kvf_engine.so
export KVFERRY_NATIVE_LIB=/tmp/kvf_engine.so
B=(/tmp/kv bench nixl --mem VRAM --tokens "$TOKENS" --json)
row() {  # row NAME CONFIG PREFILL_GPUS DECODE_GPUS FLOW EXTRA...
  local name=$1 config=$2 pg=$3 dg=$4 flow=$5
  shift 5
  for e in python native; do
    step "$name-$flow-$e" 90 "${B[@]}" --config "$config" --prefill-gpus "$pg" --decode-gpus "$dg" \
      --flow "$flow" --engine "$e" "$@"
  done
}
row tp22 'tp2->2 nhd' 0,1 2,3 direct --rooms 2 --inflight 8
row tp12 'tp1->2 nhd' 0 2,3 ring --rooms 3
row tp21 'tp2->1 nhd' 0,1 2 ring --rooms 3
row tp22shared 'tp2->2 nhd' 0,1 0,1 direct --rooms 2 --inflight 8
export KVFERRY_E2E_MEM=VRAM KVFERRY_TEST_DEVICE=cuda
step e2e-native 200 python3 -P -m pytest -q -n 8 -p no:cacheprovider --rootdir "$REPO" \
  "$REPO/tests/test_native_e2e.py" "$REPO/tests/test_native_differential.py" --durations=5
grep -h . "$R/steps.txt"
for f in "$R"/*.out; do echo "== $f"; tail -c 1500 "$f"; done
