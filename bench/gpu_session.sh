#!/usr/bin/env bash
# One GPU session of bench/gpu.py in about 9 minutes: each section in its own process under
# its own time limit (a slow or failing section cannot eat the others' time), the logs under
# $OUT (or ./gpu_logs), a short digest on stdout. Run from the repository root:
#
#   PYTHONPATH=. bash bench/gpu_session.sh
#
# tokamax, when it is not installed: put its wheel and those of einshape, pydantic,
# pydantic-core, annotated-types, typing-inspection, typing-extensions, qwix, immutabledict
# and tensorboardx in .whl/ (pip download --no-deps --only-binary=:all: --python-version
# 3.12 ...); this script installs them into /tmp/site with a stand-in module for xprof
# (100 MB; tokamax imports xprof.cli.tools.get_kernel_stats_tool at import time, for
# profiling that bench/gpu.py never does).
set -uo pipefail
out="${OUT:-gpu_logs}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ! python3 -c "import tokamax" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  mkdir -p /tmp/site/xprof/cli
  touch /tmp/site/xprof/__init__.py /tmp/site/xprof/cli/__init__.py
  printf 'def get_kernel_stats_tool(*a, **k):\n  raise RuntimeError("xprof stand-in")\n' \
    >/tmp/site/xprof/cli/tools.py
  export PYTHONPATH="${PYTHONPATH:-.}:/tmp/site"
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used --format=csv,noheader || true

section() {  # name, seconds, extra arguments
  local name=$1 limit=$2 t0
  shift 2
  t0=$(date +%s)
  timeout "$limit" python3 bench/gpu.py --sections "$name" "$@" >"$out/$name.log" 2>&1
  echo "== $name rc=$? $(($(date +%s) - t0)) s"
  grep -E "^\|.*(ok|FAIL)|^# (backend|fp8)|Error" "$out/$name.log" | grep -v "^|---" | cut -c1-230
}

section attention 190 --head-dims 128 --lengths 4096,16384 --reps 5 --json "$out/attention.json"
section sigmoid 50
section fp8 40
section autotune 70 --lengths 4096 --reps 3
section fox 45
section extras 70
section linear 50
section ce 45
