#!/usr/bin/env bash
# Bench rows of every flow for checking the simulator's predictions per flow (`kvferry bench
# predict`): TP 1->1, 2->1 and 1->2, 2,048 and 8,192-token qwen3-8b rooms, one room or a batch of
# INFLIGHT in flight, both processes on one GPU. No fit has seen these rows (h100-nixl was fitted
# on TP 1->1 direct/ring and TP 2->1 ring rows with one room in flight), so their error is held out.
# Same set-up and output as gpu_run.sh (bench/gpu_common.sh): results in $OUT/results.tgz.
#   INFLIGHT=1 bash bench/gpu_cal_flows.sh; INFLIGHT=8 bash bench/gpu_cal_flows.sh
#   MEM=DRAM TOKS="32 128" OUT=/tmp/calf bash bench/gpu_cal_flows.sh   # a CPU dry run
set -u
source "$(dirname "$0")/gpu_common.sh"
INFLIGHT=${INFLIGHT:-1}
TOKS=${TOKS:-"2048 8192"}
FLOWS=${FLOWS:-direct,ring,pinned,push,pull,layerwise}
ENGINE=${ENGINE:-python}
CFGS=${CFGS:-'tp1->1 nhd,tp2->1 nhd,tp1->2 nhd'}
mkdir -p "$R/cal"
IFS=, read -r -a cfgs <<<"$CFGS"
for cfg in "${cfgs[@]}"; do
  tag=$(echo "$cfg" | tr -dc '0-9')
  for tok in $TOKS; do
    for flow in ${FLOWS//,/ }; do
      name="flows-i$INFLIGHT-$tag-$tok-$flow"
      step "$name" 120 /tmp/kv bench nixl --mem "$MEM" --tokens "$tok" --rooms 2 --inflight "$INFLIGHT" \
        --config "$cfg" --flow "$flow" --engine "$ENGINE" --json
      cat "$R/$name.out" >>"$R/cal/bench-flows.jsonl"
    done
  done
done
