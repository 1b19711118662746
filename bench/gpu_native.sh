#!/usr/bin/env bash
# The native engine on the device, both executors in the same call (each row's baseline is
# measured in its own run): bench nixl rows (TP 1 -> 1 direct and push, the hand-off row, 8 and 32
# rooms in flight, ring for the heterogeneous pairs) with --engine python and --engine native,
# traced rooms of each, and bench interference of each: PART=a (default). PART=ahead: the TP 1 -> 1
# direct rows (hand-off, open-to-Success, 8 and 32 in flight) and push, each engine without and
# with --ahead (every chunk's pages named before its send: planned and made ready at TransferInfo,
# posted by send; both variants in the same call), the hand-off ones traced. PART=ringtrace:
# traced ring rooms, TP 1->1, 2->1, 1->2, both executors. PART=ring2: ring rows of TP 1->1, 2->1,
# 1->2, one chunk and four, each engine without and with --ahead (issue 28). PART=launch: Triton's launcher against
# the kept compiled kernel (copy probe, ring rows, kernel tests on the GPU). PART=final: every
# flow's two-process VRAM tests and a 20,000-seed campaign. PART=close: a session's closing call
# (VRAM tests, issue 28's native rows, interference, fuzz). PART=threads: one progress thread per
# native rank against the control and data loops, alternating. PART=fences: the CUDA copy fences'
# tests on the GPU and ring rows of both engines. PART=asan: the engine under
# AddressSanitizer in its two-process DRAM tests. PART=b: the native e2e
# and differential tests (VRAM e2e). PART=ucx: which UCX transport a NIXL READ (the pull flow)
# and a WRITE take with both processes on one GPU and, where the host has two, on two GPUs
# (bench/ucx_read_probe.py and `bench nixl --flow pull,direct`, with UCX_PROTO_INFO=y and
# UCX_LOG_LEVEL=info: UCX's selection tables land in the steps' .log files). Each part fits one
# device call of at most 10 minutes.
#
# On the device, from the repository root, with the wheels of bench/gpu_common.sh in .whl/:
#   PART=a bash bench/gpu_native.sh
# The engine is built here from source (gcc), into /tmp, and found through KVFERRY_NATIVE_LIB.
set -u
source "$(dirname "$0")/gpu_common.sh"
PART=${PART:-a}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$R/gpu.txt"
step build 60 python3 -P -m kvferry.backends.native.build --out /tmp/kvf_engine.so
if [ ! -s /tmp/kvf_engine.so ] && [ -s "$REPO/build/kvf_engine.so" ]; then
  # No compiler on the image: the same source, built on the machine that sent this checkout.
  cp "$REPO/build/kvf_engine.so" /tmp/kvf_engine.so && echo "engine: carried build (no gcc here)" | tee -a "$R/steps.txt"
fi
export KVFERRY_NATIVE_LIB=/tmp/kvf_engine.so
step describe 60 python3 -P -c "from kvferry.backends.nixl.native import describe; print(describe())"
cat "$R/describe.out" "$R/build.log"
B=(/tmp/kv bench nixl --mem "$MEM" --tokens "$TOKENS" --json)
if [ "$PART" = a ] || [ "$PART" = rows ]; then
  for e in python native; do
    step "x1-$e" 120 "${B[@]}" --rooms 10 --config 'tp1->1 nhd' --flow direct,push --engine "$e" \
      --trace "$R/trace-$e"
    step "handoff-$e" 60 "${B[@]}" --rooms 10 --config 'tp1->1 nhd' --flow direct --engine "$e" --handoff
    step "x8-$e" 60 "${B[@]}" --rooms 3 --inflight 8 --config 'tp1->1 nhd' --flow direct --engine "$e"
    step "x32-$e" 90 "${B[@]}" --rooms 2 --inflight 32 --config 'tp1->1 nhd' --flow direct --engine "$e"
  done
  for e in python native; do
    [ "$PART" = rows ] && break  # PART=rows: the bench nixl rows only
    step "interference-$e" 100 /tmp/kv bench interference --engine "$e" --reps 5 --phase-s 2 --json
  done
  for e in python native; do
    step "ring-$e" 120 "${B[@]}" --rooms 5 --config 'tp2->1 nhd' --config 'tp1->2 nhd' --config 'tp4->2 nhd' \
      --flow ring --engine "$e"
  done
elif [ "$PART" = ahead ]; then
  for e in python native; do
    for a in no-ahead ahead; do
      step "handoff-$e-$a" 60 "${B[@]}" --rooms 10 --config 'tp1->1 nhd' --flow direct --engine "$e" --handoff \
        --"$a" --trace "$R/trace-handoff-$e-$a"
      step "x1-$e-$a" 90 "${B[@]}" --rooms 10 --config 'tp1->1 nhd' --flow direct,push --engine "$e" --"$a"
      step "x8-$e-$a" 60 "${B[@]}" --rooms 3 --inflight 8 --config 'tp1->1 nhd' --flow direct --engine "$e" --"$a"
      step "x32-$e-$a" 90 "${B[@]}" --rooms 2 --inflight 32 --config 'tp1->1 nhd' --flow direct --engine "$e" --"$a"
    done
  done
elif [ "$PART" = ringtrace ]; then
  # Where a ring room's time goes: traced ring rooms of each pair, both executors.
  for e in python native; do
    step "ring-$e" 240 "${B[@]}" --rooms 6 --config 'tp1->1 nhd' --config 'tp2->1 nhd' --config 'tp1->2 nhd' \
      --flow ring --engine "$e" --trace "$R/trace-ring-$e"
  done
elif [ "$PART" = ring2 ]; then
  # Issue 28, the ring's speed: TP 1->1, 2->1 and 1->2 ring rooms, one chunk and four 1,024-token
  # chunks (--chunk-tokens 1024 of 4,096), each engine without and with --ahead (every chunk's
  # pages named before its send: its staging space asked then; native: its send launches the
  # gather), each row against the raw write of the same bytes in the same run. Both engines take
  # 8 steps of about a minute each: one call per engine (ENGINES=native, then ENGINES=python)
  # stays within a call's 10 minutes.
  for e in ${ENGINES:-python native}; do
    for a in no-ahead ahead; do
      for ch in 0 1024; do
        step "ring2-$e-$a-c$ch" 140 "${B[@]}" --rooms 5 --config 'tp1->1 nhd' --config 'tp2->1 nhd' \
          --config 'tp1->2 nhd' --flow ring --engine "$e" --"$a" --chunk-tokens "$ch"
      done
    done
  done
  python3 - "$R" <<'PY' | tee "$R/ring2.txt"
import json, pathlib, sys
print("| engine | ahead | chunks | TP | ratio | kvferry ms | raw ms | bytes ok |")
print("|---|---|---|---|---:|---:|---:|---|")
for f in sorted(pathlib.Path(sys.argv[1]).glob("ring2-*.out")):
    parts = f.stem.split("-")  # ring2-ENGINE-[no-]ahead-cTOKENS
    a, ch = "-".join(parts[2:-1]), parts[-1]
    for line in f.read_text().splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            n = "one" if ch == "c0" else "4 x 1024"
            print(f"| {r['engine']} | {a} | {n} | {r['tp']} | {r['ratio']:.3f} | {r['kvferry_s'] * 1e3:.2f} | "
                  f"{r['raw_s'] * 1e3:.2f} | {r['bytes_ok']} |")
PY
elif [ "$PART" = launch ]; then
  # Triton's own launcher against the kept compiled kernel (KVFERRY_TRITON_DIRECT=0 / 1): the copy
  # executor's host time per submit, and ring rooms (one chunk, and four pipelined chunks), both
  # settings alternated in the same call; the kernel tests compiled on the GPU.
  KVFERRY_TEST_DEVICE=cuda step kernel-tests 240 python3 -P -m pytest -q -o pythonpath= --rootdir "$REPO" -p no:cacheprovider \
    "$REPO/tests/test_kernels.py" "$REPO/tests/test_kernels_planner.py"
  for d in 0 1 0 1; do
    KVFERRY_TRITON_DIRECT=$d step "probe-direct$d" 60 python3 -P "$REPO/bench/copy_post_probe.py" --tokens 4096 --reps 30
  done
  for d in 0 1; do
    KVFERRY_TRITON_DIRECT=$d step "ring-direct$d" 120 "${B[@]}" --rooms 6 --config 'tp1->1 nhd' \
      --config 'tp2->1 nhd' --flow ring --engine native
    KVFERRY_TRITON_DIRECT=$d step "ring4-direct$d" 120 "${B[@]}" --rooms 6 --config 'tp1->1 nhd' \
      --config 'tp2->1 nhd' --flow ring --engine native --chunk-tokens 1024
  done
elif [ "$PART" = ucx ]; then
  ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
  pairs=("0,0")
  [ "$ngpu" -ge 2 ] && pairs+=("0,1")
  for pair in "${pairs[@]}"; do
    tag=${pair/,/-}
    gpus=()
    [ "$MEM" = VRAM ] && gpus=(--prefill-gpus "${pair%,*}" --decode-gpus "${pair#*,}")
    # UCX logs to stdout unless told otherwise: a file per process keeps the JSON lines clean.
    UCX_PROTO_INFO=y UCX_LOG_LEVEL=info UCX_LOG_FILE="$R/ucx-probe-$tag-%p.log" step "probe-$tag" 120 \
      python3 -P "$REPO/bench/ucx_read_probe.py" --mem "$MEM" --gpus "$pair" --mb 256 --reps 5
    # UCX's own default for cuda_ipc GETs (kvferry sets "y" unless told otherwise: ucx_env.py).
    UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto step "probe-ucx-auto-$tag" 120 \
      python3 -P "$REPO/bench/ucx_read_probe.py" --mem "$MEM" --gpus "$pair" --mb 256 --reps 5
    UCX_PROTO_INFO=y UCX_LOG_LEVEL=info UCX_LOG_FILE="$R/ucx-pull-$tag-%p.log" step "pull-$tag" 150 \
      "${B[@]}" --rooms 2 --config 'tp1->1 nhd' --flow pull,direct "${gpus[@]}"
    # The transports each endpoint opened, and the selection tables of the one-sided ops.
    for f in "$R"/ucx-*-"$tag"-*.log; do
      echo "== $(basename "$f")"
      grep -h "ucp_worker.c.*cfg#\|ucp_context.c.*Version" "$f"
      grep -h -B2 -A10 "remote memory read\|remote memory write" "$f"
    done | sed 's/^\[[^]]*\] \[[^]]*\] *//' >"$R/ucx-selected-$tag.txt"
  done
  cat "$R"/probe-*.out
elif [ "$PART" = fences ]; then
  # The staged copies' ends watched by the engine (CUDA events, cuEventQuery on its thread): the
  # GPU fence tests (a fence reported only after its kernel, one forgotten while its kernel runs,
  # ring and pinned rooms on VRAM), the native ring/pinned e2e on VRAM, then ring rows of each
  # engine (native: the copies fenced; python: polled as before), one and four chunks.
  export KVFERRY_E2E_MEM=$MEM KVFERRY_TEST_DEVICE=cuda
  step fence-tests 240 python3 -P -m pytest -q -n 4 -p no:cacheprovider -o pythonpath= --rootdir "$REPO" \
    "$REPO/tests/test_native_fences_gpu.py" "$REPO/tests/test_native_e2e.py" -k "fence or ring or pinned"
  tail -3 "$R/fence-tests.out"
  for e in native python; do
    for ch in 0 1024; do
      step "fences-ring-$e-c$ch" 140 "${B[@]}" --rooms 5 --config 'tp1->1 nhd' --config 'tp2->1 nhd' \
        --config 'tp1->2 nhd' --flow ring --engine "$e" --chunk-tokens "$ch"
    done
  done
elif [ "$PART" = close ]; then
  # A session's closing device call in under 10 minutes: the VRAM tests of every flow (both
  # executors, killed peers, aborts, 32 in flight, the GPU copy fences), issue 28's rows on the
  # native engine with --ahead (hand-off, open-to-Success and push traced, 8 and 32 in flight), a
  # traced python row beside them, the interference bench of each engine and a fuzz campaign.
  export KVFERRY_E2E_MEM=$MEM KVFERRY_TEST_DEVICE=cuda
  step vram-tests 200 python3 -P -m pytest -q -n 8 -p no:cacheprovider -o pythonpath= --rootdir "$REPO" \
    "$REPO/tests/test_native_e2e.py" "$REPO/tests/test_native_differential.py" "$REPO/tests/test_nixl_e2e.py" \
    "$REPO/tests/test_ahead_runtime.py" "$REPO/tests/test_layerwise_nixl.py" "$REPO/tests/test_nixl_pull_push.py" \
    "$REPO/tests/test_native_fences_gpu.py"
  tail -2 "$R/vram-tests.out"
  step x1-native 90 "${B[@]}" --rooms 6 --config 'tp1->1 nhd' --flow direct,push --engine native --ahead \
    --trace "$R/trace-native"
  step handoff-native 60 "${B[@]}" --rooms 10 --config 'tp1->1 nhd' --flow direct --engine native --handoff \
    --ahead --trace "$R/trace-handoff-native"
  step x8-native 60 "${B[@]}" --rooms 3 --inflight 8 --config 'tp1->1 nhd' --flow direct --engine native --ahead
  step x32-native 90 "${B[@]}" --rooms 2 --inflight 32 --config 'tp1->1 nhd' --flow direct --engine native --ahead
  step x1-python 90 "${B[@]}" --rooms 6 --config 'tp1->1 nhd' --flow direct --engine python --trace "$R/trace-python"
  for e in native python; do
    step "interference-$e" 70 /tmp/kv bench interference --engine "$e" --reps "${IREPS:-5}" --phase-s 2 --json
  done
  step fuzz 100 /tmp/kv fuzz --seeds "${SEEDS:-0-2999}" --jobs 16 --json
  tail -c 400 "$R/fuzz.out"
elif [ "$PART" = threads ]; then
  # One progress thread per native-engine rank (KVFERRY_PROGRESS_THREADS=1) against
  # its control and data loops (=2), alternating, twice: the progress-thread tests and the native
  # e2e on VRAM first, then per design the TP 1 -> 1 direct and ring rows with --ahead, 8 in
  # flight, the interference bench and room_calls (calls, waits, threads' CPU per room).
  export KVFERRY_E2E_MEM=$MEM KVFERRY_TEST_DEVICE=cuda
  # TESTS=0 skips the tests, REPS / IREPS set the alternations and the interference repetitions,
  # ROOM_CALLS=0 skips room_calls (CPU counts): a shorter call when device time is short.
  if [ "${TESTS:-1}" = 1 ]; then
    step thread-tests 150 python3 -P -m pytest -q -n 8 -p no:cacheprovider -o pythonpath= --rootdir "$REPO" \
      "$REPO/tests/test_progress_thread.py" "$REPO/tests/test_native_e2e.py"
    tail -2 "$R/thread-tests.out"
  fi
  for rep in $(seq 1 "${REPS:-2}"); do
    for t in 1 2; do
      export KVFERRY_PROGRESS_THREADS=$t
      step "x1-t$t-$rep" 60 "${B[@]}" --rooms 6 --config 'tp1->1 nhd' --flow "${FLOWS:-direct,ring}" --engine native --ahead
      step "x8-t$t-$rep" 45 "${B[@]}" --rooms 3 --inflight 8 --config 'tp1->1 nhd' --flow direct --engine native \
        --ahead
      step "interference-t$t-$rep" 60 /tmp/kv bench interference --engine native --reps "${IREPS:-5}" --phase-s 2 --json
      if [ "${ROOM_CALLS:-1}" = 1 ]; then
        step "room-calls-t$t-$rep" 40 python3 -P "$REPO/bench/room_calls.py" --engine native --rooms 200
      fi
    done
  done
  unset KVFERRY_PROGRESS_THREADS
elif [ "$PART" = final ]; then
  # The closing checks of a session: the two-process tests of every flow on VRAM (both executors,
  # killed peers, aborts, 32 in flight), then a 20,000-seed simulator campaign on the 16 cores.
  export KVFERRY_E2E_MEM=$MEM KVFERRY_TEST_DEVICE=cuda
  step vram-tests 240 python3 -P -m pytest -q -n 8 -p no:cacheprovider -o pythonpath= --rootdir "$REPO" \
    "$REPO/tests/test_native_e2e.py" "$REPO/tests/test_native_differential.py" "$REPO/tests/test_nixl_e2e.py" \
    "$REPO/tests/test_ahead_runtime.py" "$REPO/tests/test_layerwise_nixl.py" "$REPO/tests/test_nixl_pull_push.py"
  step fuzz 330 /tmp/kv fuzz --seeds "${SEEDS:-0-19999}" --jobs 16 --json
  tail -c 600 "$R/fuzz.out"; tail -3 "$R/vram-tests.out"
elif [ "$PART" = asan ]; then
  # The engine under AddressSanitizer in every process of its two-process tests (DRAM). ASan keeps
  # freed memory in a quarantine (256 MB by default), which the soak test's RSS bound reads as a
  # leak: a small quarantine keeps the bound meaningful.
  step build-asan 120 python3 -P -m kvferry.backends.native.build --sanitize address --out /tmp/kvf_asan.so
  mkdir -p "$R/asan"
  # libstdc++ preloaded beside ASan: NIXL's UCX plugin throws C++ exceptions inside (a connect to
  # a killed peer), and ASan's __cxa_throw interceptor needs the real one present at its start.
  KVFERRY_NATIVE_LIB=/tmp/kvf_asan.so \
    LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)" \
    ASAN_OPTIONS=detect_leaks=0:quarantine_size_mb=16:log_path=$R/asan/asan:halt_on_error=1 step asan-tests 420 \
    python3 -P -m pytest -p no:xdist -q -p no:cacheprovider -o pythonpath= --rootdir "$REPO" \
    "$REPO/tests/test_native_e2e.py" "$REPO/tests/test_native_differential.py" \
    "$REPO/tests/test_native_engine.py" "$REPO/tests/test_ahead_runtime.py" -k "not describe and not missing and not fall"
  tail -3 "$R/asan-tests.out"; ls -la "$R/asan"
else
  export KVFERRY_E2E_MEM=$MEM KVFERRY_TEST_DEVICE=cuda
  step e2e-native 240 python3 -P -m pytest -q -n 8 -p no:cacheprovider -o pythonpath= --rootdir "$REPO" \
    "$REPO/tests/test_native_e2e.py" "$REPO/tests/test_native_differential.py" --durations=5
fi
grep -h . "$R/steps.txt"
