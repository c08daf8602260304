#!/usr/bin/env bash
# Prepare .gpu/ for benchmarks/gpu_check.sh on a lent GPU machine, here, before any device time is
# spent. From the repo root:
#
#     bash benchmarks/gpu_prepare.sh [SHARED]     # SHARED: the shared folder (default ../shared)
#
# The device machine gets the checkout, not ../shared, and has no package registry: its Python has
# torch but not pydantic. This copies the CIFAR-10 archive and the MobiPerf trace into .gpu/ (which
# .git/info/exclude ignores, so it travels only when named in `carry`), downloads the wheels felix
# needs there into .gpu/whl/ (CPython 3.12, manylinux x86-64, the versions installed here), and
# prints the one command to run there with `carry: [".gpu"]`.
set -euo pipefail
SHARED=${1:-../shared}
for f in "$SHARED/data/cifar10-jpeg.tar.gz" "$SHARED/traces/mobiperf-300.json"; do
  [ -f "$f" ] || { echo "gpu_prepare: $f not found (pass the shared folder as the argument)" >&2; exit 2; }
done
mkdir -p .git/info .gpu/whl
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
cp "$SHARED/data/cifar10-jpeg.tar.gz" "$SHARED/traces/mobiperf-300.json" .gpu/

# pydantic and what it needs, at the versions this environment runs (typing-extensions is there).
pkgs=()
for name in pydantic pydantic-core annotated-types typing-inspection; do
  version=$(python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  pkgs+=("$name==$version")
done
rm -f .gpu/whl/*.whl
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/whl "${pkgs[@]}"
du -sh .gpu
cat <<'EOF'
gpu_prepare: ready. On the device (run, carry [".gpu"], timeout_s 540):
python3 -m pip install -q --no-index --no-deps --no-compile --target .gpu/site .gpu/whl/*.whl && export PYTHONPATH=$PWD/.gpu/site && OUT=$OUT bash benchmarks/gpu_check.sh
EOF
