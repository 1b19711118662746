#!/usr/bin/env bash
# Every GPU throughput measurement, in one device call (device time is the scarce part):
# the two-process e2e and pull/push tests on VRAM, the bench rows per TP pair and flow with 1 and
# 8 rooms in flight, and the hop timelines of traced rooms (bench nixl --trace). Each step has its
# own time limit and writes its files under /tmp/r; after every step they are packed into
# $OUT/results.tgz (the device tool brings back at most 8 files), so a step that fails or runs out
# of time leaves the others.
#
# On the device, from the repository root, with the wheels of README "GPU runs" in .whl/ (nixl,
# nixl-cu13, msgspec, simpy, pyzmq; the image has torch, triton, pytest, pytest-xdist, hypothesis):
#   bash bench/gpu_run.sh                   # MEM=VRAM TOKENS=4096 by default
# A dry run of the same steps on a CPU machine (small rooms, DRAM; nixl installed):
#   MEM=DRAM TOKENS=64 OUT=/tmp/gpu_run bash bench/gpu_run.sh
set -u
source "$(dirname "$0")/gpu_common.sh"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$MEM" = VRAM ]; then
  export KVFERRY_E2E_MEM=VRAM KVFERRY_TEST_DEVICE=cuda
fi
# About 20 s a test on VRAM (CUDA contexts, Triton warm-up): 8 at once.
step e2e 240 python3 -P -m pytest -q -n 8 -p no:cacheprovider -o pythonpath= --rootdir "$REPO" \
  "$REPO/tests/test_nixl_e2e.py" "$REPO/tests/test_nixl_pull_push.py" "$REPO/tests/test_runtime.py" \
  "$REPO/tests/test_tracing.py" --durations=10
step bench-x1 200 /tmp/kv bench nixl --mem "$MEM" --tokens "$TOKENS" --rooms 10 --flow ring --trace "$R/trace" --json \
  --config 'tp1->1 nhd' --config 'tp2->1 nhd' --config 'tp1->2 nhd' --config 'tp4->2 nhd'
step bench-x1-11 60 /tmp/kv bench nixl --mem "$MEM" --tokens "$TOKENS" --rooms 10 --config 'tp1->1 nhd' \
  --flow direct,push --trace "$R/trace" --json
# Pull apart, with fewer rooms: on one H100 its READs took 1.5 s a room (no cuda_ipc for the GET).
step bench-x1-pull 40 /tmp/kv bench nixl --mem "$MEM" --tokens "$TOKENS" --rooms 2 --config 'tp1->1 nhd' \
  --flow pull --json
for chunks in 1 4; do
  step "bench-x8-w$chunks" 60 /tmp/kv bench nixl --mem "$MEM" --tokens "$TOKENS" --rooms 2 --inflight 8 \
    --worker-chunks "$chunks" --config 'tp1->1 nhd' --flow direct,ring --json
done
step bench-x8-hetero 60 /tmp/kv bench nixl --mem "$MEM" --tokens "$TOKENS" --rooms 2 --inflight 8 \
  --config 'tp2->1 nhd' --config 'tp1->2 nhd' --flow ring --json
if [ "$MEM" = VRAM ]; then
  step copy-probe 60 python3 -P "$REPO/bench/copy_post_probe.py" --tokens "$TOKENS"
fi
