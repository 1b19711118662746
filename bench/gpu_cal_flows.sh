#!/usr/bin/env bash
# Bench rows of every flow for checking the simulator's predictions per flow (`kvferry bench
# predict`): TP 1->1, 2->1 and 1->2 qwen3-8b rooms, one room or a batch of INFLIGHT in flight, both
# processes on one GPU. Same set-up and output as gpu_run.sh (bench/gpu_common.sh): results in
# $OUT/results.tgz, the rows in cal/bench-flows.jsonl inside it.
#   INFLIGHT=1 bash bench/gpu_cal_flows.sh; INFLIGHT=8 bash bench/gpu_cal_flows.sh (2,048 and 8,192 tokens)
#   MEM=DRAM TOKS="32 128" OUT=/tmp/calf bash bench/gpu_cal_flows.sh   # a CPU dry run (PART=... too,
#   with TOKS=32 TRACE_TOKS=32 INFLIGHT=2)
# Fresh rows that no fit has seen (h100-nixl is fitted on the rows and telemetry in
# bench/calibration/h100-nixl/), one device call each (about 5 and 6 minutes on an H100):
#   PART=fresh1 bash bench/gpu_cal_flows.sh   # 4,096 tokens, one room, every flow, 3 TP pairs, telemetry
#   PART=fresh8 bash bench/gpu_cal_flows.sh   # 1,024 tokens, 8 in flight, every flow, 3 TP pairs,
#                                             # then one traced TP 2->1 ring batch of 8 (4,096 tokens)
# then, here: kvferry bench predict cal/bench-flows.jsonl --profile h100-nixl --held-out-tokens 1024,4096
# Run-to-run spread of the staged flows against direct (each row REPEAT times, each a fresh pair of
# processes; 3,072 tokens, a size no fit has seen), one device call each (about 8 minutes):
#   PART=repeat1 bash bench/gpu_cal_flows.sh   # one room in flight
#   PART=repeat8 bash bench/gpu_cal_flows.sh   # 8 in flight
# then, here: kvferry bench predict cal/bench-flows.jsonl --profile h100-nixl --held-out-tokens 3072
set -u
source "$(dirname "$0")/gpu_common.sh"
PART=${PART:-}
TELEMETRY=0
ROOMS=${ROOMS:-2}
REPEAT=1
case "$PART" in
  fresh1) TOKS=${TOKS:-4096} INFLIGHT=${INFLIGHT:-1} TELEMETRY=1 ;;
  fresh8) TOKS=${TOKS:-1024} INFLIGHT=${INFLIGHT:-8} ROOMS=1 ;;
  repeat1) TOKS=${TOKS:-3072} INFLIGHT=${INFLIGHT:-1} REPEAT=${REPEAT_N:-3} FLOWS=${FLOWS:-direct,ring,pinned} ;;
  repeat8) TOKS=${TOKS:-3072} INFLIGHT=${INFLIGHT:-8} ROOMS=1 REPEAT=${REPEAT_N:-3} FLOWS=${FLOWS:-direct,ring,pinned} ;;
  "") ;;
  *) echo "PART: fresh1, fresh8, repeat1, repeat8 or unset, got $PART" >&2; exit 2 ;;
esac
INFLIGHT=${INFLIGHT:-1}
TOKS=${TOKS:-"2048 8192"}
FLOWS=${FLOWS:-direct,ring,pinned,push,pull,layerwise}
ENGINE=${ENGINE:-python}
CFGS=${CFGS:-'tp1->1 nhd,tp2->1 nhd,tp1->2 nhd'}
mkdir -p "$R/cal"
IFS=, read -r -a cfgs <<<"$CFGS"
for rep in $(seq 1 "$REPEAT"); do
for cfg in "${cfgs[@]}"; do
  tag=$(echo "$cfg" | tr -dc '0-9')
  for tok in $TOKS; do
    for flow in ${FLOWS//,/ }; do
      name="flows-i$INFLIGHT-$tag-$tok-$flow"
      if [ "$REPEAT" -gt 1 ]; then name="$name-r$rep"; fi
      tel=()
      if [ "$TELEMETRY" = 1 ]; then tel=(--telemetry "$R/cal/h100.$tag.$flow.$tok.i$INFLIGHT.json"); fi
      step "$name" 120 /tmp/kv bench nixl --mem "$MEM" --tokens "$tok" --rooms "$ROOMS" --inflight "$INFLIGHT" \
        --config "$cfg" --flow "$flow" --engine "$ENGINE" "${tel[@]}" --json
      cat "$R/$name.out" >>"$R/cal/bench-flows.jsonl"
    done
  done
done
done
if [ "$PART" = fresh8 ]; then
  # Where a TP 2->1 ring batch of 8 spends its time (the row the model misses most): every engine
  # event and command of both sides, for the next model of the staged flow's per-chunk costs.
  step trace-ring-21-i8 120 /tmp/kv bench nixl --mem "$MEM" --tokens "${TRACE_TOKS:-4096}" --rooms 1 --inflight 8 \
    --config 'tp2->1 nhd' --flow ring --engine "$ENGINE" --trace "$R/trace" --json
fi
