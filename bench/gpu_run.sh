#!/usr/bin/env bash
# Every GPU measurement issue 10 still needs, in one device call (device time is the scarce part):
# the room timeline at real size, the bench rows per TP pair and flow with 1 and 8 rooms in
# flight (8: with 1 and 4 chunks in flight per worker), and the two-process e2e and pull/push
# tests on VRAM. Results land in $OUT (JSON lines
# and logs), one file per step, so a step that fails or runs out of time leaves the others.
#
# On the device, from the repository root, with the wheels of README "GPU runs" in .whl/:
#   bash bench/gpu_run.sh            # MEM=VRAM TOKENS=4096 by default
# A dry run of the same steps on a CPU machine (small rooms, DRAM):
#   MEM=DRAM TOKENS=64 OUT=/tmp/gpu_run bash bench/gpu_run.sh
set -u
MEM=${MEM:-VRAM}
TOKENS=${TOKENS:-4096}
OUT=${OUT:?set OUT to a folder for the results}
mkdir -p "$OUT"
REPO=$(pwd)
if ! python3 -c 'import nixl, msgspec, simpy, zmq' 2>/dev/null; then  # the device image lacks them
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
KVFERRY_CONTROL_KEY=${KVFERRY_CONTROL_KEY:-$(python3 -c 'import os; print(os.urandom(32).hex())')}
export KVFERRY_CONTROL_KEY
# Run from outside the checkout (and with -P) so its kvferry/ folder does not shadow the
# installed package; child processes inherit the working directory.
cd /tmp || exit 1
kv() { python3 -P -c "import sys; from kvferry.cli import main; sys.argv[0] = 'kvferry'; main()" "$@"; }
step() {  # step NAME COMMAND...: stdout to NAME.out, stderr to NAME.log, a line per step
  local name=$1
  shift
  local t0=$SECONDS
  "$@" >"$OUT/$name.out" 2>"$OUT/$name.log"
  echo "step $name: exit $? in $((SECONDS - t0)) s"
}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

for flow in direct ring; do
  step "timeline-$flow" python3 -P "$REPO/bench/room_timeline.py" --mem "$MEM" --model qwen3-8b \
    --tokens "$TOKENS" --rooms 25 --flow "$flow" --json
done
step bench-x1 kv bench nixl --mem "$MEM" --tokens "$TOKENS" --rooms 2 --flow direct,ring,pinned,pull,push --json
# Eight rooms in flight, with a worker's writes one chunk at a time (seed 000's pacing) and four.
for chunks in 1 4; do
  step "bench-x8-w$chunks" kv bench nixl --mem "$MEM" --tokens "$TOKENS" --rooms 2 --inflight 8 \
    --worker-chunks "$chunks" --flow direct,ring --json
done
if [ "$MEM" = VRAM ]; then
  export KVFERRY_E2E_MEM=VRAM KVFERRY_TEST_DEVICE=cuda
fi
step e2e python3 -P -m pytest -q -p no:cacheprovider --rootdir "$REPO" "$REPO/tests/test_nixl_e2e.py" \
  "$REPO/tests/test_nixl_pull_push.py" "$REPO/tests/test_runtime.py"
