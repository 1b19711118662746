#!/usr/bin/env bash
# How often the runtime polls NIXL while a room is in flight (RuntimeConfig.active_idle_max_s,
# `kvferry bench nixl --active-poll-us`), side by side on the GPU machine: the default 200 us,
# 20 us, and 0 (the data thread and a waiting worker spin). Alternating runs, so drift between
# steps shows as spread rather than as a difference.
#   bash bench/gpu_poll_interval.sh                  # on the device, from the repository root
#   POLLS="200 50" bash bench/gpu_poll_interval.sh
set -u
source "$(dirname "$0")/gpu_common.sh"
POLLS=${POLLS:-200 20 0}
for rep in 1 2; do
  for us in $POLLS; do
    step "x1-$us-$rep" 60 /tmp/kv bench nixl --mem "$MEM" --tokens "$TOKENS" --rooms 10 \
      --config 'tp1->1 nhd' --flow direct --active-poll-us "$us" --json
    step "x8-$us-$rep" 60 /tmp/kv bench nixl --mem "$MEM" --tokens "$TOKENS" --rooms 3 --inflight 8 \
      --config 'tp1->1 nhd' --flow direct --active-poll-us "$us" --json
  done
  for us in 200 0; do
    step "ring-$us-$rep" 60 /tmp/kv bench nixl --mem "$MEM" --tokens "$TOKENS" --rooms 10 \
      --config 'tp1->1 nhd' --flow ring --active-poll-us "$us" --json
  done
done
