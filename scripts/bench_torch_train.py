#!/usr/bin/env python3
"""PyTorch reference for scripts/bench-train.sh: single-process CPU training speed of
the same models (d2l LeNet, d2l ResNet-18 with a 3x3 stem, torchvision's ResNet-34/50) on
the same data (the shipped Fashion-MNIST subset, file order, or --shape's random images),
batch size and thread count. With --device cuda (scripts/bench-imagenet.sh) the images and
the model live on the GPU, each step's time ends with a synchronisation, and --amp bf16
and --channels-last are PyTorch's usual GPU set-up.

Prints one line: {"framework": "pytorch", "model": ..., "img_per_s": <median>, ...}.
The median is over timed steps after warm-up; a step is forward, loss, zero_grad,
backward and an SGD update, as in mtrain-train.
"""
import argparse
import gzip
import json
import pathlib
import statistics
import struct
import time

import torch
from torch import nn


def read_idx(path: pathlib.Path) -> torch.Tensor:
    data = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    magic, = struct.unpack(">I", data[:4])
    ndim = magic & 0xFF
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    body = data[4 + 4 * ndim:]
    return torch.frombuffer(bytearray(body), dtype=torch.uint8).reshape(dims)


class Residual(nn.Module):  # d2l's residual block, same attribute names as mtrain
    def __init__(self, cin, cout, use_1x1conv=False, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1, stride=stride)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.conv3 = nn.Conv2d(cin, cout, 1, stride=stride) if use_1x1conv else None
        self.bn1 = nn.BatchNorm2d(cout)
        self.bn2 = nn.BatchNorm2d(cout)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        if self.conv3 is not None:
            x = self.conv3(x)
        return torch.relu(y + x)


def resnet_stage(cin, cout, first):
    blocks = []
    for i in range(2):
        if i == 0 and not first:
            blocks.append(Residual(cin, cout, use_1x1conv=True, stride=2))
        else:
            blocks.append(Residual(cout, cout))
    return nn.Sequential(*blocks)


def build(name: str) -> nn.Module:
    if name == "lenet":
        return nn.Sequential(
            nn.Conv2d(1, 6, 5, padding=2), nn.Sigmoid(), nn.AvgPool2d(2, 2),
            nn.Conv2d(6, 16, 5), nn.Sigmoid(), nn.AvgPool2d(2, 2), nn.Flatten(),
            nn.Linear(400, 120), nn.Sigmoid(), nn.Linear(120, 84), nn.Sigmoid(),
            nn.Linear(84, 10))
    if name == "resnet18":
        b1 = nn.Sequential(nn.Conv2d(1, 64, 3, stride=1, padding=1), nn.BatchNorm2d(64), nn.ReLU())
        return nn.Sequential(b1, resnet_stage(64, 64, True), resnet_stage(64, 128, False),
                             resnet_stage(128, 256, False), resnet_stage(256, 512, False),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 10))
    if name in ("resnet34", "resnet50"):  # torchvision's, as mtrain's --model resnet34|50
        import torchvision
        return getattr(torchvision.models, name)(num_classes=10)
    raise SystemExit(f"unknown model {name!r}: expected lenet, resnet18, resnet34 or resnet50")


def as_float_batch(pixels: torch.Tensor) -> torch.Tensor:
    """[B, H, W] uint8 pixels as the [B, 1, H, W] float32 batch in [0, 1] the models take.
    The training set stays uint8 and each batch is converted as it is taken, as
    torchvision's datasets (ToTensor per sample) and mtrain's loader both do: converting
    the whole set up front would hold 4x its size (188 MB for Fashion-MNIST) and inflate
    the memory figure."""
    x = pixels.float().div_(255)
    return x.unsqueeze(1) if x.dim() == 3 else x


def timed_steps(model, opt, loss_fn, images, labels, batch, warmup, steps, batch_start, amp="off",
                channels_last=False):
    """Seconds of each of `steps` training steps after `warmup` untimed ones. Step k
    trains on the `batch` images from batch_start(k) (wrapped to stay in range). With
    amp="bf16" forward and loss run under torch.autocast(dtype=torch.bfloat16) on the
    images' device, PyTorch's mixed precision (no loss scaling is needed for bfloat16). On a
    GPU a step's time ends when the GPU has run it."""
    n = images.shape[0]
    cuda = images.device.type == "cuda"
    times = []
    for step in range(warmup + steps):
        start = batch_start(step) % (n - batch + 1)
        x, y = as_float_batch(images[start:start + batch]), labels[start:start + batch]
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=amp == "bf16"):
            loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--momentum", type=float, default=0.9,
                    help="SGD momentum (0.9 = mtrain-train's default, so both do the same update)")
    ap.add_argument("--shape", help="CxHxW: random uint8 images of that shape instead of Fashion-MNIST")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--amp", choices=["off", "bf16"], default="off")
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--data-dir", default=str(pathlib.Path(__file__).resolve().parent.parent
                                              / "data" / "fashion-mnist-mini"))
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.shape:
        c, h, w = (int(v) for v in args.shape.split("x"))
        n = 2 * args.batch_size
        images = torch.randint(0, 256, (n, c, h, w), dtype=torch.uint8)
        labels = torch.randint(0, 10, (n,))
    else:
        d = pathlib.Path(args.data_dir)
        images = read_idx(d / "train-images-idx3-ubyte.gz")  # uint8; see as_float_batch
        labels = read_idx(d / "train-labels-idx1-ubyte.gz").long()
    device = torch.device(args.device)
    images, labels = images.to(device), labels.to(device)
    model = build(args.model).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=args.momentum)
    loss_fn = nn.CrossEntropyLoss()
    b = args.batch_size
    times = timed_steps(model, opt, loss_fn, images, labels, b, args.warmup, args.steps,
                        batch_start=lambda step: step * b, amp=args.amp, channels_last=args.channels_last)
    med = statistics.median(times)
    print(json.dumps({"framework": "pytorch", "version": torch.__version__, "model": args.model,
                      "device": args.device, "amp": args.amp, "channels_last": args.channels_last,
                      "batch_size": b, "threads": args.threads, "steps": args.steps,
                      "median_step_s": round(med, 5), "img_per_s": round(b / med, 1)}))


if __name__ == "__main__":
    main()
