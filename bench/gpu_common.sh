# The set-up both device scripts share (sourced by gpu_run.sh and gpu_diag.sh, from the repository
# root): wheels into /tmp/site when the image lacks them, kvferry from the checkout, a control key,
# the /tmp/kv CLI wrapper, and step(), which runs one timed step and packs /tmp/r into
# $OUT/results.tgz after it.
# The wheels in .whl/ (carried: `pip download --no-deps --only-binary=:all: --python-version 3.12
# --implementation cp --platform manylinux_2_28_x86_64 -d .whl nixl-cu13==1.5.1 nixl==1.5.1 msgspec
# simpy pyzmq`), then `python bench/slim_wheels.py .whl`: the device tool carries 64 MiB in all and
# the full NIXL wheel (59 MB) left less than 1 MiB for the tree.
# shellcheck shell=bash
MEM=${MEM:-VRAM}
TOKENS=${TOKENS:-4096}
OUT=${OUT:?set OUT to a folder for the results}
mkdir -p "$OUT"
REPO=$(pwd)
if ! python3 -c 'import nixl, msgspec, simpy, zmq' 2>/dev/null; then  # the device image lacks them
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
if ! python3 -P -c 'import kvferry' 2>/dev/null; then
  # kvferry from the checkout, no build: its package folder plus the top-level core/ backends/ sim/
  mkdir -p /tmp/kvpkg && cp -r kvferry /tmp/kvpkg/
  for d in core backends sim; do ln -sfn "$REPO/$d" "/tmp/kvpkg/kvferry/$d"; done
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/kvpkg
fi
export PYTHONUNBUFFERED=1
KVFERRY_CONTROL_KEY=${KVFERRY_CONTROL_KEY:-$(python3 -c 'import os; print(os.urandom(32).hex())')}
export KVFERRY_CONTROL_KEY
R=${R:-/tmp/r}  # a dry run beside others on a shared box names its own
mkdir -p "$R/trace"
# A script, not a shell function, so that `timeout` can run it. Run from outside the checkout (and
# with -P) so its kvferry/ folder does not shadow the package; child processes inherit the cwd.
printf '#!/usr/bin/env bash\nexec python3 -P -c "import sys; from kvferry.cli import main; sys.argv[0] = %s; main()" "$@"\n' \
  "'kvferry'" >/tmp/kv
chmod +x /tmp/kv
cd /tmp || exit 1
step() {  # step NAME SECONDS COMMAND...: stdout to NAME.out, stderr to NAME.log, a line per step
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$R/$name.out" 2>"$R/$name.log"
  echo "step $name: exit $? in $((SECONDS - t0)) s" | tee -a "$R/steps.txt"
  pack
}
pack() {  # $R into $OUT/results.tgz; renamed into place so a call killed mid-pack keeps the last whole one
  tar czf "$OUT/results.part.tgz" -C "$R" . && mv -f "$OUT/results.part.tgz" "$OUT/results.tgz"
}
