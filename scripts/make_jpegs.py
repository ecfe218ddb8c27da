#!/usr/bin/env python3
"""Writes an image folder of generated JPEGs for the loader benchmarks
(scripts/bench-loader.sh, scripts/bench-bounded-memory.sh).

usage: make_jpegs.py ROOT TRAIN VAL SIZES

ROOT/train/c0..c9/NNNNNN.jpg (TRAIN images) and ROOT/val/... (VAL images), quality 90:
smooth colour fields with some texture, so a JPEG's size is near a photograph's (~100 KB
at 500x375). SIZES is "imagenet" (mostly 500x375 and 375x500, some 500x333 and 333x500, a
tenth anything from 200 to 1,200 pixels wide: about ImageNet's) or "fixed" (500x375, every
third 375x500).
"""
import os
import sys

import numpy as np
from PIL import Image


def imagenet_size(rng):
    u = rng.random()
    if u < 0.55:
        return 500, 375
    if u < 0.70:
        return 375, 500
    if u < 0.82:
        return 500, 333
    if u < 0.90:
        return 333, 500
    w = int(rng.integers(200, 1201))
    return w, max(100, int(w * rng.uniform(0.6, 1.4)))


def main():
    root, train, val, sizes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    rng = np.random.default_rng(0)
    for split, count in (("train", train), ("val", val)):
        for i in range(count):
            w, h = imagenet_size(rng) if sizes == "imagenet" else ((500, 375) if i % 3 else (375, 500))
            small = Image.fromarray(rng.integers(0, 256, (9, 12, 3), dtype=np.uint8)).resize((w, h), Image.BICUBIC)
            pixels = np.asarray(small, dtype=np.int16) + rng.normal(0, 10, (h, w, 3)).astype(np.int16)
            folder = os.path.join(root, split, f"c{i % 10}")
            os.makedirs(folder, exist_ok=True)
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(os.path.join(folder, f"{i:06d}.jpg"),
                                                                           quality=90)


if __name__ == "__main__":
    main()
