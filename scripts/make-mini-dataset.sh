#!/usr/bin/env bash
# Regenerates data/fashion-mnist-mini/: the first 6,000 training and the first 1,000
# test images (with their labels) of the official Fashion-MNIST files, as IDX gz files
# under the official names.
#
#   scripts/make-mini-dataset.sh [SOURCE_DIR] [DEST_DIR]
#
# SOURCE_DIR holds the four official .gz files (default: data/fashion-mnist, where
# `scripts/get-data.sh fashion-mnist` puts them); their MD5s are checked first, so the
# output depends only on the official bytes. DEST_DIR defaults to data/fashion-mnist-mini.
#
# Reproducibility: `gzip -n -9` stores no file name and mtime 0, so the same gzip
# version writes the same bytes every time (the README lists the resulting MD5s).
set -euo pipefail

readonly TRAIN_COUNT=6000
readonly TEST_COUNT=1000

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
src_dir="${1:-${repo_root}/data/fashion-mnist}"
dest_dir="${2:-${repo_root}/data/fashion-mnist-mini}"

die() {
  echo "make-mini-dataset: error: $*" >&2
  exit 1
}

declare -A official_md5=(
  [train-images-idx3-ubyte.gz]=8d4fb7e6c68d591d4c3dfef9ec88bf0d
  [train-labels-idx1-ubyte.gz]=25c81989df183df01b3e8a0aad5dffbe
  [t10k-images-idx3-ubyte.gz]=bef4ecab320f06d8554ea6380940ec79
  [t10k-labels-idx1-ubyte.gz]=bb300cfdad3c16e7a12a480ee83cd310
)

for name in "${!official_md5[@]}"; do
  path="${src_dir}/${name}"
  [[ -f "${path}" ]] || die "missing ${path}; run 'scripts/get-data.sh fashion-mnist' or pass the directory holding the official files"
  actual="$(md5sum "${path}" | cut -d' ' -f1)"
  [[ "${actual}" == "${official_md5[${name}]}" ]] ||
    die "${path}: expected MD5 ${official_md5[${name}]} (official file), found ${actual}"
done

# The 4-byte big-endian count as printf escapes, e.g. 6000 -> \x00\x00\x17\x70.
be32_escapes() {
  local hex
  hex="$(printf '%08x' "$1")"
  printf '\\x%s\\x%s\\x%s\\x%s' "${hex:0:2}" "${hex:2:2}" "${hex:4:2}" "${hex:6:2}"
}

# slice KIND(images|labels) SOURCE_GZ COUNT OUT_GZ: rewrites the header with COUNT and
# keeps the first COUNT items. Images: magic, count, rows, cols (16 bytes) then 784
# bytes per item; labels: magic, count (8 bytes) then 1 byte per item.
slice() {
  local kind="$1" source="$2" count="$3" out="$4"
  local header_bytes item_bytes magic
  if [[ "${kind}" == images ]]; then
    header_bytes=16 item_bytes=784 magic='\x00\x00\x08\x03'
  else
    header_bytes=8 item_bytes=1 magic='\x00\x00\x08\x01'
  fi
  local tmp="${out}.tmp"
  {
    # shellcheck disable=SC2059  # the format is built from fixed escapes only
    printf "${magic}$(be32_escapes "${count}")"
    if [[ "${kind}" == images ]]; then
      # shellcheck disable=SC2059
      printf "$(be32_escapes 28)$(be32_escapes 28)"
    fi
    # Decompressed to a file first and cut with `head` reading a file: a pipeline that
    # stops reading early would kill the writer with SIGPIPE, which pipefail reports.
    gzip -dc "${source}" >"${work_dir}/whole"
    head -c "$((header_bytes + count * item_bytes))" "${work_dir}/whole" | tail -c +"$((header_bytes + 1))"
  } | gzip -n -9 >"${tmp}"
  mv "${tmp}" "${out}"
}

work_dir="$(mktemp -d)"
trap 'rm -rf "${work_dir}"; rm -f "${dest_dir}"/*.tmp' EXIT

mkdir -p "${dest_dir}"
slice images "${src_dir}/train-images-idx3-ubyte.gz" "${TRAIN_COUNT}" "${dest_dir}/train-images-idx3-ubyte.gz"
slice labels "${src_dir}/train-labels-idx1-ubyte.gz" "${TRAIN_COUNT}" "${dest_dir}/train-labels-idx1-ubyte.gz"
slice images "${src_dir}/t10k-images-idx3-ubyte.gz" "${TEST_COUNT}" "${dest_dir}/t10k-images-idx3-ubyte.gz"
slice labels "${src_dir}/t10k-labels-idx1-ubyte.gz" "${TEST_COUNT}" "${dest_dir}/t10k-labels-idx1-ubyte.gz"

# Sizes are checked here rather than trusted: a short read above would otherwise
# produce a plausible-looking but truncated file.
check_size() {
  local path="$1" expected="$2" actual
  actual="$(gzip -dc "${path}" | wc -c)"
  [[ "${actual}" -eq "${expected}" ]] || die "${path}: expected ${expected} uncompressed bytes, wrote ${actual}"
}
check_size "${dest_dir}/train-images-idx3-ubyte.gz" "$((16 + TRAIN_COUNT * 784))"
check_size "${dest_dir}/train-labels-idx1-ubyte.gz" "$((8 + TRAIN_COUNT))"
check_size "${dest_dir}/t10k-images-idx3-ubyte.gz" "$((16 + TEST_COUNT * 784))"
check_size "${dest_dir}/t10k-labels-idx1-ubyte.gz" "$((8 + TEST_COUNT))"

echo "wrote ${dest_dir}:"
(cd "${dest_dir}" && md5sum train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz \
  t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz)
