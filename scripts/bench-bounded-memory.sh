#!/usr/bin/env bash
# A streamed run over data several times larger than the memory it may use: WebDataset
# shards of ImageNet-sized JPEGs (400 generated images packed by mtrain-pack, the shards
# copied until they hold --times x --limit bytes), one epoch of mtrain-train
# (simplecnn, --random-resized-crop 32, batches of 32, 2 loader workers) inside a memory cgroup of --limit
# (cgroup v2 memory.max or v1 memory.limit_in_bytes; needs root). The resident set is read
# every 2 s; prints the dataset's size, the limit, the resident set at 10 %, 50 % and 90 %
# of the run and its peak, and the cgroup's peak (page cache included).
#
#   scripts/bench-bounded-memory.sh [--limit-mib 512] [--times 4] [--bin-dir DIR]
#
# Results go in docs/benchmarks.md.
set -euo pipefail

limit_mib=512 times=4
bin_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/build/bin
while (($#)); do
  case $1 in
    --limit-mib) limit_mib=$2; shift 2 ;;
    --times) times=$2; shift 2 ;;
    --bin-dir) bin_dir=$2; shift 2 ;;
    -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "bench-bounded-memory.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
[[ $(id -u) == 0 ]] || { echo "bench-bounded-memory.sh: needs root, to make a memory cgroup" >&2; exit 2; }

work=$(mktemp -d)
cgroup=
cleanup() {
  [[ -n $cgroup && -d $cgroup ]] && rmdir "$cgroup" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then
  cgroup=/sys/fs/cgroup/mtrain-bounded-$$
  mkdir "$cgroup" && echo $((limit_mib << 20)) > "$cgroup/memory.max"
  peak_file=$cgroup/memory.peak
elif [[ -d /sys/fs/cgroup/memory ]]; then
  cgroup=/sys/fs/cgroup/memory/mtrain-bounded-$$
  mkdir "$cgroup" && echo $((limit_mib << 20)) > "$cgroup/memory.limit_in_bytes"
  peak_file=$cgroup/memory.max_usage_in_bytes
else
  echo "bench-bounded-memory.sh: no memory cgroup (neither v2 nor v1 is mounted)" >&2; exit 2
fi

/usr/bin/python3 "$(dirname "${BASH_SOURCE[0]}")/make_jpegs.py" "$work/photos" 400 40 fixed
"$bin_dir/mtrain-pack" --from "$work/photos" --to "$work/packed" --shard-size 100 > /dev/null
mkdir -p "$work/shards/train"
cp -r "$work/packed/val" "$work/shards/val"
target=$(((limit_mib << 20) * times))
copies=0 bytes=0
while ((bytes < target)); do
  for shard in "$work"/packed/train/*.tar; do
    cp "$shard" "$work/shards/train/train-$(printf '%06d' $copies).tar"
    bytes=$((bytes + $(stat -c %s "$shard"))) copies=$((copies + 1))
  done
done
rm -rf "$work/photos" "$work/packed"
sync
echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
echo "bench-bounded-memory: $copies shards, $((bytes >> 20)) MiB of JPEGs, under a limit of $limit_mib MiB ($(awk -v a=$bytes -v b=$((limit_mib << 20)) 'BEGIN { printf "%.1f", a / b }')x)"

start=$(date +%s)
sh -c "echo \$\$ > '$cgroup/cgroup.procs' 2>/dev/null || echo \$\$ > '$cgroup/tasks'; exec '$bin_dir/mtrain-train' \
  --model simplecnn --dataset webdataset --data-dir '$work/shards' --random-resized-crop 32 --random-flip \
  --batch-size 32 --epochs 1 --threads 2 --loader-workers 2 --log-every 100 --metrics '$work/m.jsonl'" \
  > "$work/log" 2>&1 &
pid=$!
: > "$work/rss"
while kill -0 $pid 2>/dev/null; do
  awk '/VmRSS/ { print $2 }' /proc/$pid/status >> "$work/rss" 2>/dev/null || true
  sleep 2
done
wait $pid || { echo "bench-bounded-memory: the run failed:" >&2; tail -5 "$work/log" >&2; exit 1; }
seconds=$(($(date +%s) - start))
grep -E "train set|epoch 1," "$work/log" | sed 's/^\[[^]]*\] \[[a-z]*\] //'
awk -v s=$seconds -v peak=$(cat "$peak_file") '{ v[NR] = $1; if ($1 > m) m = $1 }
  END { printf "resident set (MiB): %.0f at 10%%, %.0f at 50%%, %.0f at 90%% of %d s; peak %.0f; cgroup peak %.0f (page cache included)\n",
        v[int(NR * 0.1) + 1] / 1024, v[int(NR * 0.5) + 1] / 1024, v[int(NR * 0.9) + 1] / 1024, s, m / 1024, peak / 1048576 }' "$work/rss"
