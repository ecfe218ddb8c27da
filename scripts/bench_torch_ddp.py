#!/usr/bin/env python3
"""PyTorch DDP reference for scripts/bench-ddp.sh: data-parallel CPU training speed of
the same models as mtrain (d2l LeNet, d2l ResNet-18 with a 3x3 stem, defined once in
scripts/bench_torch_train.py) on the same data, one worker per rank under torchrun.

    torchrun --nproc_per_node N --no_python /usr/bin/python3 scripts/bench_torch_ddp.py \
        --model resnet18 --batch-size 64 --warmup 2 --steps 4

Backend gloo, --threads intra-op threads per rank, DistributedDataParallel, plain SGD
(lr 0.1, no momentum). Rank r trains on the r-th of each group of WORLD_SIZE consecutive
batches of the shipped Fashion-MNIST subset in file order, so the ranks see disjoint data
as mtrain's sampler gives them. Rank 0 prints one JSON line with the GLOBAL images per
second over the timed steps: WORLD_SIZE x batch x steps / (sum of rank 0's step times),
and each of rank 0's step times (step_s), from which scripts/bench-ddp.sh takes medians.
A step is forward, loss, zero_grad, backward (with DDP's gradient all-reduce) and the
SGD update, as in mtrain-train.
"""
import argparse
import importlib.util
import json
import os
import pathlib
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

HERE = pathlib.Path(__file__).resolve().parent


def load_single_process_bench():
    # The models and the IDX reader live in the single-process reference; loading it by
    # path keeps one definition of each without making scripts/ a package.
    spec = importlib.util.spec_from_file_location("bench_torch_train", HERE / "bench_torch_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="lenet | resnet18")
    ap.add_argument("--batch-size", type=int, default=256, help="images per step per rank")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--amp", choices=["off", "bf16"], default="off",
                    help="bf16: forward and loss under torch.autocast('cpu', dtype=torch.bfloat16)")
    ap.add_argument("--data-dir", default=str(HERE.parent / "data" / "fashion-mnist-mini"))
    args = ap.parse_args()
    for name in ("batch_size", "threads", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} expects a positive integer, got {getattr(args, name)}")
    if args.warmup < 0:
        ap.error(f"--warmup expects a non-negative integer, got {args.warmup}")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit("bench_torch_ddp.py: RANK/WORLD_SIZE not set; start it under torchrun")

    ref = load_single_process_bench()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    d = pathlib.Path(args.data_dir)
    images = ref.read_idx(d / "train-images-idx3-ubyte.gz")  # uint8; see ref.as_float_batch
    labels = ref.read_idx(d / "train-labels-idx1-ubyte.gz").long()
    n, b = images.shape[0], args.batch_size
    if n < b:
        raise SystemExit(f"bench_torch_ddp.py: --batch-size {b} exceeds the {n} training images")

    # Same seed on every rank, and DDP broadcasts rank 0's parameters anyway.
    model = DistributedDataParallel(ref.build(args.model))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()

    # Rank r trains on the r-th of each group of `world` consecutive batches.
    times = ref.timed_steps(model, opt, loss_fn, images, labels, b, args.warmup, args.steps,
                            batch_start=lambda step: (step * world + rank) * b, amp=args.amp)

    dist.barrier()
    if rank == 0:
        total = sum(times)
        print(json.dumps({"framework": "pytorch-ddp", "version": torch.__version__, "model": args.model,
                          "world_size": world, "batch_size_per_rank": b, "threads": args.threads, "amp": args.amp,
                          "steps": args.steps, "median_step_s": round(statistics.median(times), 5),
                          "img_per_s": round(world * b * args.steps / total, 1),
                          "step_s": [round(t, 5) for t in times]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
