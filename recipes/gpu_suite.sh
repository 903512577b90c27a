#!/usr/bin/env bash
# The GPU suite in one device call (issue 43): install the carried wheels and this package, then
# run every section of lightning_dvi_benchmarks.gpu_suite (about 7.5 minutes at most, the install
# included in the 8). Run from the repository root ON THE DEVICE MACHINE, after
# recipes/gpu_wheels.sh here; the device call names wheels in its `carry` (docs/benchmarks.md):
#
#   bash recipes/gpu_suite.sh [suite arguments, e.g. --sections speed --budget speed=400]
#
# Writes $OUT/gpu_suite.json (rewritten as the sections go) and $OUT/gpu_suite.log; the exit status
# is the suite's (1 if a section failed or ran out of time).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-outputs/gpu_suite}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
start=$SECONDS

shopt -s nullglob
wheels=(wheels/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
  # Dependencies come from the image or wheels/, never a registry (there is none).
  "$PY" -m pip install --quiet --no-index --no-cache-dir --find-links wheels "${wheels[@]}" \
    || { echo "[gpu_suite.sh] installing wheels/ failed" >&2; exit 3; }
else
  echo "[gpu_suite.sh] no wheels/*.whl: run recipes/gpu_wheels.sh first and carry wheels" >&2
fi
# The package and the benchmarks distribution (benchmarks/), without their dependencies (pyro-ppl
# is not on the suite's path); the `lightning-dvi` console script lands next to $PY. If that fails
# the suite still runs from the checkout (python -m lightning_dvi.cli instead of the script, and
# benchmarks/ on PYTHONPATH below).
"$PY" -m pip install --quiet --no-index --no-deps --no-build-isolation --no-cache-dir . ./benchmarks \
  || echo "[gpu_suite.sh] installing the package failed: running from the checkout" >&2
echo "[gpu_suite.sh] installed in $((SECONDS - start)) s"

PYTHONPATH="benchmarks${PYTHONPATH:+:$PYTHONPATH}" \
  "$PY" -m lightning_dvi_benchmarks.gpu_suite --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_suite.log"
exit "${PIPESTATUS[0]}"
