"""How long a run takes to start on WebDataset shards: listing their headers against reading
their index files (SHARD.tar.mtrain.idx, Note [Shard index files] in data/shard_index.cpp).

  python3 scripts/bench-shard-index.py BIN_DIR [--shards 64] [--samples 1000]
      [--image-bytes 110000] [--runs 5] [--work DIR] [--cold]

Writes SHARDS shards of SAMPLES samples each (a small JPEG padded after its end marker to
IMAGE_BYTES, ImageNet's mean, so headers lie as far apart as in ImageNet's shards; a label),
then times `mtrain-train --max-steps 1` on them with and without the index files, alternating,
RUNS times each. A run's time is the wall time from its start to its "train set:" log line
(the load, not the step). With --cold the page cache is dropped before every run (root only):
each header and label then comes from the disk. Prints each run and the medians:

  per run: listed 5.31 indexed 0.15 listed 5.03 indexed 0.15 ...
  median seconds to load 64000 samples (cold cache): listed 5.31, indexed 0.15; listed / indexed: 34.6
"""
import argparse
import io
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time


def small_jpeg():
    # An 8x8 baseline JPEG, made by Pillow.
    try:
        from PIL import Image
        out = io.BytesIO()
        Image.new("RGB", (8, 8), (120, 60, 30)).save(out, format="JPEG")
        return out.getvalue()
    except ImportError:
        sys.exit("bench-shard-index.py: needs Pillow (python3-pil) to write its JPEGs")


def write_shards(work, shards, samples, image_bytes):
    jpeg = small_jpeg()
    image = jpeg + bytes(max(0, image_bytes - len(jpeg)))  # decoders stop at the end marker
    folder = os.path.join(work, "train")
    os.makedirs(folder, exist_ok=True)
    for s in range(shards):
        with tarfile.open(os.path.join(folder, f"train-{s:06d}.tar"), "w", format=tarfile.USTAR_FORMAT) as tar:
            for k in range(samples):
                key = f"{s * samples + k:09d}"
                for name, data in ((key + ".jpg", image), (key + ".cls", str(k % 10).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return folder


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def seconds_to_load(trainer, folder, cold):
    if cold:
        drop_caches()
    cmd = [trainer, "--model", "simplecnn", "--dataset", "webdataset", "--data-dir", folder, "--resize", "8",
           "--no-eval", "--max-steps", "1", "--threads", "1", "--log-level", "info"]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    loaded = None
    for line in proc.stdout:
        if loaded is None and "train set:" in line:
            loaded = time.monotonic() - start
    if proc.wait() != 0 or loaded is None:
        sys.exit(f"bench-shard-index.py: {' '.join(cmd)} failed or printed no 'train set:' line")
    return loaded


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bin_dir")
    p.add_argument("--shards", type=int, default=64)
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--image-bytes", type=int, default=110000)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--work", help="where the shards go (default: a temporary folder, removed after)")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each run (root)")
    args = p.parse_args()
    trainer = os.path.join(args.bin_dir, "mtrain-train")
    pack = os.path.join(args.bin_dir, "mtrain-pack")
    work = args.work or tempfile.mkdtemp(prefix="bench-shard-index-")
    try:
        folder = write_shards(work, args.shards, args.samples, args.image_bytes)
        subprocess.run([pack, "--index", folder], check=True, stdout=subprocess.DEVNULL)
        indexes = [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".mtrain.idx")]
        aside = os.path.join(work, "indexes")
        os.makedirs(aside, exist_ok=True)
        listed, indexed = [], []
        for _ in range(args.runs):
            for f in indexes:
                shutil.move(f, aside)
            listed.append(seconds_to_load(trainer, folder, args.cold))
            for f in os.listdir(aside):
                shutil.move(os.path.join(aside, f), folder)
            indexed.append(seconds_to_load(trainer, folder, args.cold))
        print("per run: " + " ".join(f"listed {a:.2f} indexed {b:.2f}" for a, b in zip(listed, indexed)))
        ml, mi = statistics.median(listed), statistics.median(indexed)
        print(f"median seconds to load {args.shards * args.samples} samples{' (cold cache)' if args.cold else ''}: "
              f"listed {ml:.2f}, indexed {mi:.2f}; listed / indexed: {ml / mi:.1f}")
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
