#!/usr/bin/env bash
# A whole calibration set of one card, in three device calls of under ten minutes each: the rows a
# profile is fitted from (fit1, fit2) and rows no fit may see (check). Same set-up and output as
# gpu_run.sh (bench/gpu_common.sh): results in $OUT/results.tgz, under cal/ inside it.
#   CARD=h200 PART=fit1 bash bench/gpu_cal_card.sh   # kernel bench; TP 1->1 direct and ring at
#       512-8192 tokens and TP 2->1 ring at 2,048 with NIXL telemetry; every flow at 2,048 tokens,
#       TP 1->1 / 2->1 / 1->2, one room in flight (telemetry for unequal-TP direct and pinned)
#   CARD=h200 PART=fit2 bash bench/gpu_cal_card.sh   # every flow at 8,192 tokens (one room) and at
#       2,048 tokens, 8 in flight (TP 1->1 / 2->1)
#   CARD=h200 PART=rows ROWS='bench-flows.jsonl 2048 8 1-1 ring 1;...' bash bench/gpu_cal_card.sh
#       or ROWS_FILE=path/rows.txt (from the repository root): one spec a line, '#' comments.
#       A spec's 7th field 'tel' records NIXL telemetry ('-': none); its 8th, 'rank' or 'side', runs
#       each TP rank in a process of its own or one process a side (default: $PROCS, else rank;
#       sets measured before 2026-12-03 ran one process a side, and their files have no suffix).
#       LIMIT_S=590: start no row that, as long as the longest row so far, would end past that many
#       seconds of the call (the device kills a command at 600 s, and a TP 2->1 row of 8 rooms takes
#       up to 77 s: a fixed STOP_S=540 lost one). STOP_S=540: start no row once the call has run
#       that long (a row takes 10-35 s, 33-77 s at TP 2->1 with descriptors per head; the device
#       allows 600 s a command). Each row done leaves a mark in $R/done/: the same command again on
#       the same (still warm) machine takes the rows after it, so one list spans two calls of one
#       machine; on a fresh machine it starts over (host.txt, one block a call, tells which).
#   CARD=h200 PART=check bash bench/gpu_cal_card.sh  # held out: every flow at 4,096 tokens (one room,
#       three TP pairs) and at 1,024 tokens (8 in flight, TP 1->1 / 2->1), 5 batches a row
#   CARD=h200 PART=trace TRACE_FLOWS=ring,pinned bash bench/gpu_cal_card.sh  # traced rooms (4,096 tokens,
#       3 rooms, TP 1->1 / 2->1 / 1->2 or TRACE_TP='1-1') on the same executor as the rows: cal/trace/, hop timelines in
#       trace.out; the step's log must say "executor: native" (a trace taken before the engine was
#       built fell back to the python executor unnoticed)
# ENGINE (default native) is the runtime's executor of NIXL commands. A CPU dry run:
#   MEM=DRAM TOKS_SCALE=64 OUT=/tmp/calc PART=fit1 bash bench/gpu_cal_card.sh
set -u
source "$(dirname "$0")/gpu_common.sh"
CARD=${CARD:-h200}
PART=${PART:?PART: fit1, fit2 or check}
ENGINE=${ENGINE:-native}
TOKS_SCALE=${TOKS_SCALE:-1}  # DRAM dry runs divide every size by this
FLOWS=(direct ring pinned pull push layerwise)
mkdir -p "$R/cal"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$R/gpu.txt"
# Which host ran the rows: calls on different machines differ by up to 2x on the same rows (batches
# of small rooms, descriptor posting), so each call names its CPU, clocks and driver beside the GPU.
# The identity lines (GPU uuid and serial, boot id, host name) tell one machine from another: the
# model lines alone read the same on every lent H200.
{ echo "call at $(date -u +%FT%TZ)"; grep -m1 'model name' /proc/cpuinfo; nproc; uname -r
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=driver_version,clocks.max.sm,clocks.sm,pstate --format=csv,noheader
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=uuid,serial,pci.bus_id --format=csv,noheader
  echo "boot_id $(cat /proc/sys/kernel/random/boot_id) host $(hostname)"
} >"$R/host.now.txt" 2>&1
cat "$R/host.now.txt" | tee -a "$R/host.txt"
if [ "$ENGINE" = native ]; then  # built from source here, as bench/gpu_native.sh does
  SO=${ENGINE_SO:-/tmp/kvf_engine.so}  # a dry run beside others on a shared box names its own
  step build 60 python3 -P -m kvferry.backends.native.build --out "$SO"
  if [ ! -s "$SO" ] && [ -s "$REPO/build/kvf_engine.so" ]; then
    cp "$REPO/build/kvf_engine.so" "$SO" && echo "engine: carried build" | tee -a "$R/steps.txt"
  fi
  export KVFERRY_NATIVE_LIB=$SO
fi

row() {  # row FILE TOKENS INFLIGHT CONFIG FLOW ROOMS [telemetry] [side|rank]: one bench row appended to cal/FILE
  local file=$1 tok=$2 inflight=$3 cfg=$4 flow=$5 rooms=$6 tel=${7:-} procs=${8:-${PROCS:-rank}}
  local tag name args=()
  [ "$tel" = - ] && tel=
  tag=$(echo "$cfg" | tr -dc '0-9' | sed 's/./&-/' )
  name="$CARD.$tag.$flow.$tok.i$inflight"
  if [ "$procs" = side ]; then name="$name.side"; args+=(--process-per-side); fi
  if [ -n "$tel" ]; then args+=(--telemetry "$R/cal/$name.json"); fi
  step "$name" 120 /tmp/kv bench nixl --mem "$MEM" --tokens "$((tok / TOKS_SCALE))" --rooms "$rooms" \
    --inflight "$inflight" --config "$cfg" --flow "$flow" --engine "$ENGINE" "${args[@]}" --json
  cat "$R/$name.out" >>"$R/cal/$file"
  pack  # again: step packed before the row reached cal/
}

case "$PART" in
  fit1)
    if [ "$MEM" = VRAM ]; then
      step kernels 120 python3 -P "$REPO/bench/kernel_bench.py" --reps 10 --fallback-reps 2 --json "$R/cal/kernels.json"
    fi
    for flow in direct ring; do
      for tok in 512 1024 2048 4096 8192; do row bench.jsonl "$tok" 1 'tp1->1 nhd' "$flow" 3 tel; done
    done
    row bench.jsonl 2048 1 'tp2->1 nhd' ring 3 tel
    for cfg in 'tp2->1 nhd' 'tp1->2 nhd' 'tp1->1 nhd'; do
      for flow in "${FLOWS[@]}"; do
        case "$cfg/$flow" in
          'tp1->1 nhd/direct' | 'tp1->1 nhd/ring') continue ;;  # rows of bench.jsonl
          'tp1->1 nhd/pinned' | 'tp2->1 nhd/direct' | 'tp1->2 nhd/direct') tel=tel ;;
          *) tel= ;;
        esac
        row bench-flows.jsonl 2048 1 "$cfg" "$flow" 2 $tel
      done
    done
    ;;
  fit2)
    for cfg in 'tp2->1 nhd' 'tp1->2 nhd' 'tp1->1 nhd'; do
      for flow in "${FLOWS[@]}"; do row bench-flows.jsonl 8192 1 "$cfg" "$flow" 2; done
    done
    for cfg in 'tp1->1 nhd' 'tp2->1 nhd'; do
      for flow in "${FLOWS[@]}"; do row bench-flows.jsonl 2048 8 "$cfg" "$flow" 1; done
    done
    ;;
  check)  # 5 batches a row: two rows of one or two batches differed by up to 42% (h200-nixl-rep)
    for cfg in 'tp1->1 nhd' 'tp2->1 nhd'; do
      for flow in "${FLOWS[@]}"; do row check-1024-i8.jsonl 1024 8 "$cfg" "$flow" 5; done
    done
    for cfg in 'tp1->1 nhd' 'tp2->1 nhd' 'tp1->2 nhd'; do
      for flow in "${FLOWS[@]}"; do row check-4096-i1.jsonl 4096 1 "$cfg" "$flow" 5; done
    done
    ;;
  rows)  # ROWS='FILE TOKENS INFLIGHT TP FLOW ROOMS [tel];...' (TP as 2-1): the rows a call left over
    if [ -n "${ROWS_FILE:-}" ]; then  # one spec a line, '#' comments (a list longer than a command)
      ROWS=$(grep -v '^[[:space:]]*\(#\|$\)' "$REPO/$ROWS_FILE" | paste -sd';')
    fi
    IFS=';' read -r -a specs <<<"${ROWS:?ROWS or ROWS_FILE: rows to take}"
    mkdir -p "$R/done"
    longest=20  # seconds: a row's least, until one is timed
    for i in "${!specs[@]}"; do
      [ -e "$R/done/$i" ] && continue  # taken by an earlier call on this machine
      if [ -n "${STOP_S:-}" ] && [ "$SECONDS" -ge "$STOP_S" ]; then
        echo "stopped at row $i of ${#specs[@]} after $SECONDS s (STOP_S=$STOP_S)" | tee -a "$R/steps.txt"
        break
      fi
      if [ -n "${LIMIT_S:-}" ] && [ $((SECONDS + longest)) -gt "$LIMIT_S" ]; then
        echo "stopped at row $i of ${#specs[@]} after $SECONDS s: the longest row so far ($longest s) would pass LIMIT_S=$LIMIT_S" | tee -a "$R/steps.txt"
        break
      fi
      read -r file tok inflight tp flow rooms tel procs <<<"${specs[$i]}"
      t0=$SECONDS
      row "$file" "$tok" "$inflight" "tp${tp/-/->} nhd" "$flow" "$rooms" "${tel:-}" "${procs:-}"
      [ $((SECONDS - t0)) -gt "$longest" ] && longest=$((SECONDS - t0))
      echo "${specs[$i]}" >"$R/done/$i"
    done
    pack
    ;;
  trace)
    configs=()  # TRACE_TP='1-1 2-1' (default: TP 1->1, 2->1 and 1->2)
    for tp in ${TRACE_TP:-1-1 2-1 1-2}; do configs+=(--config "tp${tp/-/->} nhd"); done
    step trace 300 /tmp/kv bench nixl --mem "$MEM" --tokens "$((4096 / TOKS_SCALE))" --rooms 3 "${configs[@]}" \
      --flow "${TRACE_FLOWS:-ring}" --engine "$ENGINE" --trace "$R/cal/trace" --json
    cp "$R/trace.out" "$R/cal/trace.out"
    grep -o 'executor[^,]*' "$R/trace.log" | sort | uniq -c
    pack
    ;;
  *) echo "PART: fit1, fit2, check, rows or trace, got $PART" >&2; exit 2 ;;
esac
