#!/usr/bin/env bash
# The ways planner descriptors reach NIXL (RuntimeConfig.nixl_direct_post), side by side on the
# GPU machine: prepared lists with index runs (NIXL merges 18,432 page indices back into 72
# descriptors for a 4096-token TP 1 -> 1 room), one-shot rows (72 descriptors built per post),
# and auto (one-shot for long runs). Each row also carries "NIXL alone with the same
# descriptors", posted the same way. Alternating runs, so drift between steps shows as spread.
#   bash bench/gpu_post_paths.sh                         # on the device, from the repository root
#   HOWS="prepped oneshot" SLOW=1 bash bench/gpu_post_paths.sh   # + TP 2 -> 1 direct and pull rows
set -u
source "$(dirname "$0")/gpu_common.sh"
HOWS=${HOWS:-prepped auto}
for rep in 1 2; do
  for how in $HOWS; do
    step "x1-$how-$rep" 60 /tmp/kv bench nixl --mem "$MEM" --tokens "$TOKENS" --rooms 10 \
      --config 'tp1->1 nhd' --flow direct --direct-post "$how" --json
    step "x8-$how-$rep" 60 /tmp/kv bench nixl --mem "$MEM" --tokens "$TOKENS" --rooms 3 --inflight 8 \
      --config 'tp1->1 nhd' --flow direct --direct-post "$how" --json
  done
done
if [ "${SLOW:-0}" = 1 ]; then
  for how in $HOWS; do
    step "hetero-$how" 90 /tmp/kv bench nixl --mem "$MEM" --tokens "$TOKENS" --rooms 1 \
      --config 'tp2->1 nhd' --flow direct --direct-post "$how" --json
    step "pull-$how" 40 /tmp/kv bench nixl --mem "$MEM" --tokens "$TOKENS" --rooms 2 \
      --config 'tp1->1 nhd' --flow pull --direct-post "$how" --json
  done
fi
