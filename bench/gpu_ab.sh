#!/usr/bin/env bash
# The same bench rows on two trees of the real backend in one device call, in ABBA order, so that a
# card warming up (or cooling) across the call does not read as a difference between the trees.
# The old tree is this checkout with a patch reversed: make it here, before the call (ignored by
# git, carried with the wheels), from the revision to compare against:
#   mkdir -p .ab && git diff OLD_REV HEAD -- core backends > .ab/new.patch
# then on the device (carry .whl and .ab):
#   REPS=2 ROWS="--rooms 3 --inflight 8 --flow direct;--rooms 6 --flow direct" bash bench/gpu_ab.sh
# Each tree runs with the native engine built from its own engine.c (the C side changes with the
# Python side that drives it).
# Each row is `kvferry bench nixl --mem $MEM --tokens $TOKENS --config 'tp1->1 nhd' --engine
# native --ahead --json` plus its ROWS entry (CONFIG and ENGINE_ARGS replace those two parts).
# Output: $OUT/results.tgz with one NAME.out per run and ab.txt, one line per run in the order
# run: "rep order tree row kvferry_gbps raw_gbps ratio".
set -u
source "$(dirname "$0")/gpu_common.sh"
PATCH=${PATCH:-$REPO/.ab/new.patch}
[ -s "$PATCH" ] || { echo "no patch at $PATCH (see the header)" >&2; exit 2; }
CONFIG=${CONFIG:-tp1->1 nhd}
read -r -a ENGINE_ARGS <<<"${ENGINE_ARGS:---engine native --ahead}"
IFS=';' read -r -a rows <<<"${ROWS:?ROWS: bench nixl arguments of each row, separated by ;}"
# Two package folders side by side: the checkout's kvferry/ with its core/ and backends/ (new) or
# with the patch reversed (old); sim/ is the checkout's in both.
rm -rf /tmp/ab_old /tmp/kvnew /tmp/kvold && mkdir -p /tmp/ab_old /tmp/kvnew /tmp/kvold
cp -r "$REPO/core" "$REPO/backends" /tmp/ab_old/
(cd /tmp/ab_old && patch -s -p1 -R <"$PATCH") || { echo "the patch does not reverse on this tree" >&2; exit 2; }
for tree in new old; do
  cp -r "$REPO/kvferry" "/tmp/kv$tree/"
  src=$REPO
  if [ "$tree" = old ]; then src=/tmp/ab_old; fi
  ln -sfn "$src/core" "/tmp/kv$tree/kvferry/core"
  ln -sfn "$src/backends" "/tmp/kv$tree/kvferry/backends"
  ln -sfn "$REPO/sim" "/tmp/kv$tree/kvferry/sim"
done
SITE=$(echo "${PYTHONPATH:-}" | tr ':' '\n' | grep -vx '/tmp/kvpkg' | grep . | paste -sd:)  # the wheels, if any
NEW_PATH=/tmp/kvnew${SITE:+:$SITE}
OLD_PATH=/tmp/kvold${SITE:+:$SITE}
for tree in new old; do  # which core each tree imports, in the log; each tree's own engine
  p=$NEW_PATH
  if [ "$tree" = old ]; then p=$OLD_PATH; fi
  PYTHONPATH=$p python3 -P -c 'import kvferry.core.planner as m; print("tree:", m.__file__)' | tee -a "$R/steps.txt"
  # engine.c changes with the Python side that drives it: one library per tree
  PYTHONPATH=$p step "build-$tree" 60 python3 -P -m kvferry.backends.native.build --out "/tmp/kvf_engine_$tree.so"
done
: >"$R/ab.txt"
for rep in $(seq 1 "${REPS:-2}"); do
  order=(new old old new)  # ABBA: a drift in time weighs on both trees alike
  for i in "${!order[@]}"; do
    tree=${order[$i]}
    if [ "$tree" = old ]; then export PYTHONPATH=$OLD_PATH; else export PYTHONPATH=$NEW_PATH; fi
    export KVFERRY_NATIVE_LIB=/tmp/kvf_engine_$tree.so
    for r in "${!rows[@]}"; do
      read -r -a args <<<"${rows[$r]}"
      name="ab-$rep-$i-$tree-row$r"
      step "$name" 120 /tmp/kv bench nixl --mem "$MEM" --tokens "$TOKENS" --config "$CONFIG" "${ENGINE_ARGS[@]}" \
        --json "${args[@]}"
      python3 -P - "$R/$name.out" "$rep $i $tree row$r" >>"$R/ab.txt" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
for d in rows:
    print(sys.argv[2], d.get("flow"), round(d["kvferry_gbps"], 1), round(d["raw_gbps"], 1), round(d["ratio"], 3))
if not rows:
    print(sys.argv[2], "no result")
EOF
    done
  done
done
export PYTHONPATH=$NEW_PATH
cat "$R/ab.txt"
tar czf "$OUT/results.tgz" -C "$R" .
