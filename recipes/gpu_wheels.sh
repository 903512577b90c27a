#!/usr/bin/env bash
# Prepare, HERE (with network access), the wheels the GPU suite needs on the device machine,
# which has no package registry (issue 43; docs/benchmarks.md, "The GPU suite").
#
#   recipes/gpu_wheels.sh [PYTHON]        # from the repository root; PYTHON defaults to .venv/bin/python
#
# The device image already holds torch, Triton, lightning, torchmetrics, numpy, pyarrow, pandas,
# matplotlib, scikit-learn, PyYAML and typing-extensions (the device tool's list of kinds). The
# suite's import path (python -m lightning_dvi_benchmarks.gpu_suite, and `lightning-dvi fit`) adds
# only jsonargparse[signatures]: jsonargparse, docstring-parser and typeshed-client, pure-Python
# wheels of about 1 MiB together. pyro-ppl is a dependency of the package but no section imports
# it, so it is not carried (the package is installed with --no-deps). Each wheel is the version
# this checkout's environment has, so the device runs what the tests here ran.
#
# The wheels land in wheels/ (gitignored; name it in the device call's `carry`), with
# wheels/COMMIT: the commit measured, for the suite's JSON (the device copy has no git history).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
PACKAGES=(jsonargparse docstring-parser typeshed-client)

mkdir -p wheels
rm -f wheels/*.whl
for name in "${PACKAGES[@]}"; do
  version=$("$PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$name")
  # Pure-Python wheels; the platform tags only let pip accept them for the device's CPython 3.12.
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d wheels "$name==$version"
done

commit=$(git rev-parse HEAD)
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  commit="$commit (with uncommitted changes)"
fi
echo "$commit" > wheels/COMMIT
ls -l wheels
du -ch wheels/*.whl | tail -1
