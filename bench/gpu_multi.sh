#!/usr/bin/env bash
# Prefill and decode on their own GPUs of one host (a machine of 4 or more GPUs), each row under
# both executors against raw NIXL and a torch p2p copy of the same bytes between the same GPUs in
# the same run, bytes checked in every row. Each part fits one device call of at most 10 minutes:
#   PART=placements  TP 2 -> 2 on 0,1 -> 2,3, TP 1 -> 2 on 0 -> 2,3, TP 2 -> 1 on 0,1 -> 2, TP 2 -> 2
#                    sharing 0,1; direct (8 in flight) and ring; then the native e2e tests on VRAM
#   PART=rows        TP 2 -> 2 on 0,1 -> 2,3 direct with 1, 8 and 32 rooms in flight, push and pull
#                    with 8; ring for TP 1 -> 2 and 2 -> 1 with 8; TP 2 -> 2 sharing 0,1 with 32
#   PART=more        llama-3.1-70b rooms (TP 2 -> 2 direct, TP 2 -> 1 ring, 8 in flight), pinned,
#                    telemetry of direct writes at four room sizes for `kvferry calibrate`, and the
#                    two-process e2e tests (aborts, killed peers, every flow) in each placement
#   PART=diag        traced TP 2 -> 2 rooms (hop timelines), native TP 2 -> 2 with 16 and 32 in flight
#   PART=final       layer-wise rows (1 and 8 in flight) and the VRAM e2e tests of both executors
# With fewer than 4 GPUs it says so and stops.
#
# On the device, from the repository root, with the wheels of bench/gpu_common.sh in .whl/:
#   PART=rows bash bench/gpu_multi.sh
set -u
source "$(dirname "$0")/gpu_common.sh"
PART=${PART:-placements}
n=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$R/gpu.txt"
nvidia-smi topo -m | tee "$R/topo.txt"
if [ "$n" -lt 4 ]; then echo "gpu_multi: needs 4 GPUs, this machine has $n"; exit 2; fi
step build 60 python3 -P -m kvferry.backends.native.build --out /tmp/kvf_engine.so
export KVFERRY_NATIVE_LIB=/tmp/kvf_engine.so
B=(/tmp/kv bench nixl --mem VRAM --tokens "$TOKENS" --json)
row() {  # row NAME CONFIG PREFILL_GPUS DECODE_GPUS FLOW ENGINES EXTRA...
  local name=$1 config=$2 pg=$3 dg=$4 flow=$5 engines=$6
  shift 6
  for e in $engines; do
    step "$name-$flow-$e" 120 "${B[@]}" --config "$config" --prefill-gpus "$pg" --decode-gpus "$dg" \
      --flow "$flow" --engine "$e" "$@"
  done
}
e2e() {  # e2e NAME PREFILL_GPUS DECODE_GPUS SECONDS PYTEST_ARGS...
  local name=$1
  KVFERRY_E2E_PREFILL_GPUS=$2 KVFERRY_E2E_DECODE_GPUS=$3 step "$name" "$4" python3 -P -m pytest -q -n 8 \
    -p no:cacheprovider -o pythonpath= --rootdir "$REPO" --durations=5 "${@:5}"
}
export KVFERRY_E2E_MEM=VRAM KVFERRY_TEST_DEVICE=cuda
both="python native"
case $PART in
placements)
  row tp22 'tp2->2 nhd' 0,1 2,3 direct "$both" --rooms 2 --inflight 8
  row tp12 'tp1->2 nhd' 0 2,3 ring "$both" --rooms 3
  row tp21 'tp2->1 nhd' 0,1 2 ring "$both" --rooms 3
  row tp22shared 'tp2->2 nhd' 0,1 0,1 direct "$both" --rooms 2 --inflight 8
  e2e e2e-native 0 0 200 "$REPO/tests/test_native_e2e.py" "$REPO/tests/test_native_differential.py"
  ;;
rows)
  row tp22x1 'tp2->2 nhd' 0,1 2,3 direct "$both" --rooms 5
  row tp22x8 'tp2->2 nhd' 0,1 2,3 direct "$both" --rooms 2 --inflight 8
  row tp22x32 'tp2->2 nhd' 0,1 2,3 direct "$both" --rooms 1 --inflight 32
  row tp22x8 'tp2->2 nhd' 0,1 2,3 push "$both" --rooms 2 --inflight 8
  row tp22x8 'tp2->2 nhd' 0,1 2,3 pull "$both" --rooms 2 --inflight 8
  row tp12x8 'tp1->2 nhd' 0 2,3 ring "$both" --rooms 2 --inflight 8
  row tp21x8 'tp2->1 nhd' 0,1 2 ring "$both" --rooms 2 --inflight 8
  row tp22sharedx32 'tp2->2 nhd' 0,1 0,1 direct "$both" --rooms 1 --inflight 32
  ;;
more)
  row l70-tp22x8 'tp2->2 nhd' 0,1 2,3 direct "$both" --rooms 2 --inflight 8 --model llama-3.1-70b
  row l70-tp21x8 'tp2->1 nhd' 0,1 2 ring python --rooms 2 --inflight 8 --model llama-3.1-70b
  row tp22x8 'tp2->2 nhd' 0,1 2,3 pinned python --rooms 2 --inflight 8
  for t in 1024 2048 4096 8192; do  # one room at a time: NIXL's own duration per write, four sizes
    step "cal-$t" 90 /tmp/kv bench nixl --mem VRAM --tokens "$t" --json --config 'tp2->2 nhd' \
      --prefill-gpus 0,1 --decode-gpus 2,3 --flow direct --rooms 4 --telemetry "$R/cal.tp22.direct.$t.json"
  done
  T=("$REPO/tests/test_nixl_e2e.py")
  e2e e2e-own 0,1 2,3 240 "${T[@]}" "$REPO/tests/test_nixl_pull_push.py" \
    -k "tp2to2 or tp2to1 or tp1to2 or killed or over_nixl"
  e2e e2e-shared 0,1 0,1 150 "${T[@]}" -k "tp2to2 or killed"
  e2e e2e-native-own 0,1 2,3 150 "$REPO/tests/test_native_e2e.py"
  ;;
diag)
  # Where a TP 2 -> 2 room's time goes (hop timelines of traced rooms), and the native engine's
  # 32-in-flight TP 2 -> 2 run that hung once: bracketed by 16 in flight, and, if it hangs again,
  # every thread's stack of both bench children (faulthandler on SIGABRT) in its log.
  row tp22x8trace 'tp2->2 nhd' 0,1 2,3 direct "$both" --rooms 2 --inflight 8 --trace "$R/trace22"
  row tp22x16 'tp2->2 nhd' 0,1 2,3 direct native --rooms 1 --inflight 16
  export PYTHONFAULTHANDLER=1
  (sleep 60; pkill -ABRT -f kvferry.tools.runtime_bench) &
  dog=$!
  row tp22x32 'tp2->2 nhd' 0,1 2,3 direct native --rooms 1 --inflight 32
  kill "$dog" 2>/dev/null  # finished in time: no stacks wanted
  unset PYTHONFAULTHANDLER
  ;;
final)
  # The layer-wise flow's rows, and the VRAM e2e tests (python and native executors, layer-wise
  # included) on the code as finally merged, prefill on 0,1 and decode on 2,3.
  row tp22x8 'tp2->2 nhd' 0,1 2,3 layerwise "$both" --rooms 2 --inflight 8
  row tp22x1 'tp2->2 nhd' 0,1 2,3 layerwise python --rooms 5
  e2e e2e-final 0,1 2,3 150 "$REPO/tests/test_nixl_e2e.py" "$REPO/tests/test_nixl_pull_push.py" \
    "$REPO/tests/test_layerwise_nixl.py" -k "tp2to2 or tp2to1 or tp1to2 or killed or over_nixl or layerwise"
  e2e e2e-native-final 0,1 2,3 100 "$REPO/tests/test_native_e2e.py" "$REPO/tests/test_native_differential.py"
  ;;
*) echo "gpu_multi: PART must be placements, rows, more, diag or final, got $PART"; exit 2 ;;
esac
grep -h . "$R/steps.txt"
cat "$R"/*.out | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        r = json.loads(line)
    except ValueError:
        continue
    if isinstance(r, dict) and "ratio" in r:
        print(r["gpus"], r["tp"], r["model"], r["flow"], r["engine"], r["inflight"], "%.1f/%.1f GB/s" %
              (r["kvferry_gbps"], r["raw_gbps"]), "ratio %.3f" % r["ratio"], "p2p", r["p2p_gbps"], r["bytes_ok"])'
grep -h "passed\|failed" "$R"/e2e*.out | tail -8
