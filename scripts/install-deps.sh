#!/usr/bin/env bash
# Installs the Debian packages dmuon needs, only those missing. Idempotent and non-interactive:
# `apt-get update` runs at most once, and only when something has to be installed.
# --fuzz: also clang and libFuzzer (make fuzz); the test suite never needs them.
set -euo pipefail

packages=(
  build-essential cmake pkg-config
  libopenblas-dev            # BLAS (sgemm, ssyrk)
  libdnnl-dev                # oneDNN: bfloat16 Newton-Schulz on the CPU (optional to the build)
  ocl-icd-opencl-dev         # OpenCL headers: Debian's oneDNN CMake config requires them (only recommended)
  libopenmpi-dev openmpi-bin # transport
  coinor-libcbc-dev          # MILP solver for the planner
  nlohmann-json3-dev         # JSON (caches, plans, --json output)
  libcli11-dev               # command line
  libgtest-dev libgmock-dev  # tests
  python3-venv python3-dev   # the virtual environment the Makefile makes for python/dmuon (torch from PyPI)
  libbenchmark-dev           # microbenchmarks
  gnuplot-nox                # PNG plots
  fortunes                   # default training corpus (English text)
)
if [ "${1:-}" = "--fuzz" ]; then
  packages+=(clang-14 libclang-rt-14-dev)  # libFuzzer, ASan and UBSan runtimes for clang
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-deps: done"
