"""Writes an image folder with Pillow and the bytes torchvision's ImageFolder would train on.

usage: pil_image_folder.py DIR HEIGHT WIDTH MIXED

DIR/train/<class>/ and DIR/val/<class>/ get PNGs (RGB, RGB with a gamma chunk, L, RGBA,
LA, palette with transparency) and JPEGs (RGB 4:2:0, L), of mixed sizes when MIXED is 1, else all
HEIGHT x WIDTH. DIR/expected-train.bin and DIR/expected-val.bin then hold, image after
image in ImageFolder's order, the CHW bytes of
    Image.open(path).convert("RGB").resize((WIDTH, HEIGHT), Image.BILINEAR)
(the resize only where the size differs, as torchvision's Resize((H, W)) on a PIL image).
"""
import os
import random
import struct
import sys

from PIL import Image, PngImagePlugin


def noise_image(rng, mode, width, height):
    bands = {"RGB": 3, "L": 1, "RGBA": 4, "LA": 2}[mode]
    # A gradient plus noise: smooth enough for JPEG to matter, rough enough for resizing to.
    data = bytearray()
    for y in range(height):
        for x in range(width):
            for b in range(bands):
                v = (x * 255 // max(width - 1, 1) + y * 97 // max(height - 1, 1) + b * 60) % 256
                data.append((v + rng.randrange(-40, 41)) % 256)
    return Image.frombytes(mode, (width, height), bytes(data))


def write_split(rng, root, split, height, width, mixed):
    sizes = [(width, height)] * 8
    if mixed:
        sizes = [(23, 17), (40, 31), (8, 8), (width, height), (5, 50), (64, 48), (31, 33), (2, 3)]
    kinds = [("RGB", "png"), ("L", "png"), ("RGBA", "png"), ("LA", "png"), ("P", "png"), ("RGB", "jpg"),
             ("L", "jpg"), ("RGB", "png")]
    for cls in ("cat", "dog"):
        os.makedirs(os.path.join(root, split, cls), exist_ok=True)
        for i, ((w, h), (mode, ext)) in enumerate(zip(sizes, kinds)):
            path = os.path.join(root, split, cls, f"{i:02d}-{mode}.{ext}")
            if mode == "P":
                img = noise_image(rng, "RGB", w, h).quantize(colors=16)
                img.save(path, transparency=3)
            elif ext == "jpg":
                noise_image(rng, mode, w, h).save(path, quality=85)
            elif i == 0:
                gamma = PngImagePlugin.PngInfo()
                gamma.add(b"gAMA", struct.pack(">I", 100000))  # 1.0, far from sRGB's
                noise_image(rng, mode, w, h).save(path, pnginfo=gamma)
            else:
                noise_image(rng, mode, w, h).save(path)


def expected(root, split, height, width):
    out = bytearray()
    # torchvision's make_dataset: classes sorted, os.walk sorted, file names sorted.
    split_dir = os.path.join(root, split)
    for cls in sorted(os.listdir(split_dir)):
        for walk_root, _, names in sorted(os.walk(os.path.join(split_dir, cls))):
            for name in sorted(names):
                img = Image.open(os.path.join(walk_root, name)).convert("RGB")
                if img.size != (width, height):
                    img = img.resize((width, height), Image.BILINEAR)
                data = img.tobytes()
                for c in range(3):
                    out += data[c::3]
    with open(os.path.join(root, f"expected-{split}.bin"), "wb") as f:
        f.write(out)


def main():
    root, height, width, mixed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    rng = random.Random(7)
    for split in ("train", "val"):
        write_split(rng, root, split, height, width, mixed)
        expected(root, split, height, width)


main()
