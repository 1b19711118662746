#!/usr/bin/env bash
# Where a room's fixed cost goes on the GPU machine, and the rows `kvferry calibrate` refits the
# h100-nixl profile from, in one device call:
#   - wake-up latency of thread and process hand-offs (bench/wake_probe.py);
#   - traced TP 1->1 direct rooms at Python's default switch interval and at 200 us;
#   - a py-spy --gil profile (only samples that hold the GIL) of the same rooms;
#   - TP 1->1 direct and ring at 512-8192 tokens with NIXL telemetry, TP 2->1 ring at 2048, and
#     the kernel bench: the inputs of docs/fidelity.md's calibrate command.
# Same set-up and output as gpu_run.sh (bench/gpu_common.sh): results in $OUT/results.tgz.
#   bash bench/gpu_diag.sh
#   MEM=DRAM TOKENS=64 OUT=/tmp/gpu_diag bash bench/gpu_diag.sh   # a CPU dry run
set -u
source "$(dirname "$0")/gpu_common.sh"
mkdir -p "$R/cal"
step wake 60 python3 -P "$REPO/bench/wake_probe.py" --n 2000
for si in 0 200; do
  step "hops-si$si" 60 /tmp/kv bench nixl --mem "$MEM" --tokens "$TOKENS" --rooms 10 --config 'tp1->1 nhd' \
    --flow direct,ring --switch-interval-us "$si" --trace "$R/trace-si$si" --json
done
if command -v py-spy >/dev/null; then
  step gil-spy 90 py-spy record --gil --threads --subprocesses --format raw -r 2000 -o "$R/gil.raw" -- \
    /tmp/kv bench nixl --mem "$MEM" --tokens "$TOKENS" --rooms 30 --config 'tp1->1 nhd' --flow direct --json
  step gil-summary 30 python3 -P "$REPO/bench/spy_summary.py" "$R/gil.raw"
fi
for flow in direct ring; do
  for tok in 512 1024 2048 4096 8192; do
    t=$tok
    [ "$MEM" = DRAM ] && t=$((tok / 64))
    step "cal-$flow-$tok" 60 /tmp/kv bench nixl --mem "$MEM" --tokens "$t" --rooms 3 --config 'tp1->1 nhd' \
      --flow "$flow" --telemetry "$R/cal/h100.1-1.$flow.$tok.json" --json
    cat "$R/cal-$flow-$tok.out" >>"$R/cal/bench.jsonl"
  done
done
step cal-ring-21 60 /tmp/kv bench nixl --mem "$MEM" --tokens "$((TOKENS / 2))" --rooms 3 --config 'tp2->1 nhd' \
  --flow ring --telemetry "$R/cal/h100.2-1.ring.2048.json" --json
cat "$R/cal-ring-21.out" >>"$R/cal/bench.jsonl"
if [ "$MEM" = VRAM ]; then
  step kernels 120 python3 -P "$REPO/bench/kernel_bench.py" --reps 10 --fallback-reps 2 --json "$R/cal/kernels.json"
fi
