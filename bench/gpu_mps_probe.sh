#!/usr/bin/env bash
# Does the ring's one room at TP 2->1 run slower than the simulator predicts because three
# processes time-slice the one GPU of the bench? The same rows with and without CUDA MPS (which
# lets the processes' kernels share the GPU instead of taking turns), alternating.
#   OUT=/tmp/o bash bench/gpu_mps_probe.sh    (device tool: carry .whl; writes $OUT/rows.jsonl)
# shellcheck shell=bash
set -u
source bench/gpu_common.sh
SO=/tmp/kvf_engine.so
python3 -P -m kvferry.backends.native.build --out "$SO" >"$OUT/build.log" 2>&1 && export KVFERRY_NATIVE_LIB=$SO
row() {  # row LABEL CONFIG FLOW INFLIGHT
  local t0=$SECONDS
  timeout 150 /tmp/kv bench nixl --mem VRAM --tokens 4096 --rooms 4 --inflight "$4" --config "$2" \
    --flow "$3" --engine native --json 2>>"$OUT/rows.log" | tail -1 |
    python3 -c "import json,sys; d=json.loads(sys.stdin.read()); d['probe']='$1'; print(json.dumps(d))" \
    >>"$OUT/rows.jsonl"
  echo "$1 $2 $3 i$4: exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/steps.txt"
}
mps_on() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && echo "mps: on" | tee -a "$OUT/steps.txt"
}
mps_off() {
  echo quit | nvidia-cuda-mps-control && echo "mps: off" | tee -a "$OUT/steps.txt"
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
nvidia-smi --query-gpu=uuid,compute_mode --format=csv,noheader >"$OUT/host.txt" 2>&1
echo "boot_id $(cat /proc/sys/kernel/random/boot_id)" >>"$OUT/host.txt"
for pass in 1 2; do
  row "plain-$pass" 'tp2->1 nhd' ring 1
  row "plain-$pass" 'tp1->1 nhd' ring 1
  if command -v nvidia-cuda-mps-control >/dev/null && mps_on; then
    row "mps-$pass" 'tp2->1 nhd' ring 1
    row "mps-$pass" 'tp1->1 nhd' ring 1
    mps_off
  else
    echo "mps: unavailable" | tee -a "$OUT/steps.txt"
  fi
done
