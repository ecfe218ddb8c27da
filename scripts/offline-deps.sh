#!/usr/bin/env bash
# Downloads the Debian packages mtrain builds against (those scripts/setup.sh installs
# that a build host may lack) into DIR, for scripts/build-offline.sh on a host that has
# a C++ compiler, CMake, Ninja and, for the GPU path, CUDA with cuDNN and NCCL, but
# neither these packages nor a network: a GPU node, say. About 11 MB.
#
#   scripts/offline-deps.sh [DIR]          (default: .deps in the project root)
#
# Run it where apt can reach Debian 12's archive (this project's CI image); it needs no
# root and installs nothing. Open MPI is left out: the mpi backend is optional, and a
# cluster's own Open MPI is what its ranks must use anyway.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$root/.deps}

# The build dependencies, their shared libraries and what those link (Gloo: ibverbs,
# hiredis, netlink); not the base system a compiler toolchain always brings (libc,
# libstdc++, libgomp).
packages=(
  catch2 libcxxopts-dev nlohmann-json3-dev
  libspdlog-dev libspdlog1.10 libfmt-dev libfmt9
  libdnnl-dev libdnnl2 ocl-icd-opencl-dev ocl-icd-libopencl1 opencl-c-headers
  opencl-clhpp-headers opencl-headers
  libgloo-dev libgloo0 libhiredis-dev libhiredis0.14 libibverbs-dev libibverbs1
  libnl-3-200 libnl-3-dev libnl-route-3-200 libnl-route-3-dev
  zlib1g-dev zlib1g
  libpng-dev libpng16-16 libturbojpeg0-dev libturbojpeg0
)

command -v apt-get >/dev/null || { echo "offline-deps.sh: apt-get not found; run this on a Debian or Ubuntu machine" >&2; exit 2; }
mkdir -p "$dir"
cd "$dir"
rm -f ./*.deb
if ! apt-get download "${packages[@]}" >download.log 2>&1; then
  echo "offline-deps.sh: apt-get download failed (see $dir/download.log):" >&2
  tail -5 download.log >&2
  exit 1
fi
count=$(find . -maxdepth 1 -name '*.deb' | wc -l)
if ((count != ${#packages[@]})); then
  echo "offline-deps.sh: expected ${#packages[@]} packages, found $count in $dir (see download.log)" >&2
  exit 1
fi
echo "offline-deps.sh: $count packages ($(du -sh . | cut -f1)) in $dir"
