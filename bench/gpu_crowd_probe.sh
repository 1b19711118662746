#!/usr/bin/env bash
# Why is every host hop of a ring room 1.3-2.4x as long at TP 2->1 as at TP 1->1, pure-Python
# planning included (docs/fidelity.md, the traces)? (Found later: the bench then ran both prefill
# ranks in one process; it now runs one process a rank, bench/calibration/h200-ranks/.) One
# device call: the same ring rooms (4,096 tokens, one in flight, 5 batches, native executor) alone
# and beside a third process of each kind, with the container's CPU quota and throttling and the
# bench processes' threads sampled while they run. Results in $OUT/results.tgz (cal/crowd.jsonl,
# crowd.txt).
#   bash bench/gpu_crowd_probe.sh
# A CPU dry run: MEM=DRAM TOKS_SCALE=64 OUT=/tmp/crowd bash bench/gpu_crowd_probe.sh
set -u
source "$(dirname "$0")/gpu_common.sh"
TOKS_SCALE=${TOKS_SCALE:-1}
BATCHES=${BATCHES:-5}
mkdir -p "$R/cal"
LOG=$R/crowd.txt
{ echo "call at $(date -u +%FT%TZ)"; grep -m1 'model name' /proc/cpuinfo; echo "nproc $(nproc)"
  echo "cpu.max $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo none)"
  echo "cpuset $(cat /sys/fs/cgroup/cpuset.cpus.effective 2>/dev/null || echo none)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,uuid,compute_mode --format=csv,noheader
} | tee -a "$LOG"
SO=/tmp/kvf_engine.so
step build 60 python3 -P -m kvferry.backends.native.build --out "$SO"
export KVFERRY_NATIVE_LIB=$SO

throttled() { awk '/^(nr_throttled|throttled_usec)/ {printf "%s=%s ", $1, $2}' /sys/fs/cgroup/cpu.stat 2>/dev/null; }

sample_threads() {  # every 3 s until the file $1 exists: the threads busiest over the last second
  while [ ! -e "$1" ]; do
    python3 "$REPO/bench/crowd_threads.py" >>"$LOG"
    sleep 2
  done
}

row() {  # row NAME CONFIG [background command]: a bench row, with a third process beside it if given
  local name=$1 cfg=$2 bg=${3:-}
  local bgpid=""
  if [ -n "$bg" ]; then
    bash -c "$bg" >"$R/$name.bg.log" 2>&1 &
    bgpid=$!
    sleep 3  # the third process is up (a CUDA context takes a second or two)
  fi
  echo "=== $name ($cfg) background: ${bg:-none}; before: $(throttled)" | tee -a "$LOG"
  rm -f "$R/row.done"
  sample_threads "$R/row.done" &
  local sampler=$!
  step "$name" 150 /tmp/kv bench nixl --mem "$MEM" --tokens "$((4096 / TOKS_SCALE))" --rooms "$BATCHES" \
    --inflight 1 --config "$cfg" --flow ring --engine native --json
  touch "$R/row.done"
  wait "$sampler" 2>/dev/null
  echo "after: $(throttled)" | tee -a "$LOG"
  if [ -n "$bgpid" ]; then kill -- "$bgpid" 2>/dev/null; pkill -f crowd_bg_marker 2>/dev/null; wait "$bgpid" 2>/dev/null; fi
  python3 - "$R/$name.out" "$name" >>"$R/cal/crowd.jsonl" <<'EOF'
import json, sys
path, name = sys.argv[1], sys.argv[2]
for line in open(path):
    line = line.strip()
    if line.startswith("{"):
        row = json.loads(line)
        row["crowd_probe"] = name
        print(json.dumps(row))
EOF
  grep -h '"kvferry_s"' "$R/$name.out" | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    b = r.get("kvferry_batches_s") or []
    print("  ms a batch: median %.3f, batches %s, executor %s" % (r["kvferry_s"] * 1e3,
          " ".join("%.2f" % (x * 1e3) for x in b), r.get("executor")))' | tee -a "$LOG"
  pack
}

# The markers name the background processes so pkill finds them (bash -c's child is python).
CPU_HOG='exec python3 -c "import sys; sys.argv.append(\"crowd_bg_marker\")
while True: pass"'
CUDA_IDLE='exec python3 -c "import sys, time, torch; sys.argv.append(\"crowd_bg_marker\"); torch.zeros(1, device=\"cuda\"); time.sleep(900)"'
CUDA_BUSY='exec python3 -c "import sys, torch; sys.argv.append(\"crowd_bg_marker\"); a = torch.randn(512, 512, device=\"cuda\")
while True: a = torch.tanh(a @ a)"'
CUDA_POLL='exec python3 -c "import sys, torch; sys.argv.append(\"crowd_bg_marker\"); a = torch.randn(64, 64, device=\"cuda\")
while True: a = torch.tanh(a); torch.cuda.synchronize()"'

row alone-1-1 'tp1->1 nhd'
row alone-2-1 'tp2->1 nhd'
if [ "$MEM" = VRAM ]; then
  row cuda-idle-1-1 'tp1->1 nhd' "$CUDA_IDLE"
  row cuda-poll-1-1 'tp1->1 nhd' "$CUDA_POLL"
  row cuda-busy-1-1 'tp1->1 nhd' "$CUDA_BUSY"
fi
row cpu-hog-1-1 'tp1->1 nhd' "$CPU_HOG"
row alone-1-1-again 'tp1->1 nhd'
pack
