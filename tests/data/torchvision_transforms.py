"""torchvision's side of test_image_transforms_torch: the bytes its transforms give.

usage: torchvision_transforms.py CASES OUT

CASES holds one line per image: PATH TOP LEFT HEIGHT WIDTH SIZE SHORTER. OUT gets, image
after image, the CHW bytes of
    F.resized_crop(img, TOP, LEFT, HEIGHT, WIDTH, [SIZE, SIZE])   (RandomResizedCrop's work
                                                                  once its box is drawn)
then of
    Compose([Resize(SHORTER), CenterCrop(SIZE)])(img)
for img = Image.open(PATH).convert("RGB"), as torchvision's ImageFolder loads it.
"""
import sys

import numpy as np
from PIL import Image
from torchvision import transforms as T
from torchvision.transforms import functional as F


def chw(img):
    return np.asarray(img, dtype=np.uint8).transpose(2, 0, 1).tobytes()


def main():
    cases, out = sys.argv[1], sys.argv[2]
    with open(cases) as f, open(out, "wb") as o:
        for line in f:
            path, top, left, height, width, size, shorter = line.split()
            img = Image.open(path).convert("RGB")
            size = int(size)
            crop = F.resized_crop(img, int(top), int(left), int(height), int(width), [size, size],
                                  T.InterpolationMode.BILINEAR)
            o.write(chw(crop))
            o.write(chw(T.Compose([T.Resize(int(shorter)), T.CenterCrop(size)])(img)))


if __name__ == "__main__":
    main()
