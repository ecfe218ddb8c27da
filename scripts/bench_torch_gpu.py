#!/usr/bin/env python3
"""PyTorch reference for the GPU training benchmark (scripts/gpu-kit.sh, stage d2l):
d2l's ResNet-18 with a 3x3 stem (the model of scripts/bench_torch_train.py, the same as
mtrain's resnet18) on Fashion-MNIST, batch 256, plain SGD with lr 0.1, one process per
GPU under torchrun with DistributedDataParallel.

    torchrun --nproc_per_node 1 scripts/bench_torch_gpu.py --data-dir DIR \
        [--amp off|bf16] [--channels-last] [--cudnn-benchmark] [--compile] [--epochs 4]
        [--batch-size 256] [--log-steps [21:30]] [--no-eval]

The data pipeline follows mtrain's: the uint8 images stay in host memory, each epoch
visits them in a shuffled order (seeded by --seed + epoch), and every batch is gathered
and converted to float32 in [0, 1] on the host, pinned, and copied to the GPU without
blocking. (mtrain assembles its batches in loader threads one batch ahead; here they are
assembled in the training loop, which costs PyTorch a little host time per step.)
--compile compiles with dynamic=False: one graph per batch shape (256 and the last,
short batch of an epoch) instead of a dynamic-shape graph for all.
--amp bf16 runs forward and loss under torch.autocast(dtype=torch.bfloat16) (no loss
scaling is needed for bfloat16). --cudnn-benchmark sets torch.backends.cudnn.benchmark
(cuDNN times its algorithms for each new shape and keeps the fastest). Rank 0 prints one
JSON line per epoch: the training seconds of the epoch (the GPU synchronised at both
ends; evaluation excluded), images per second over all ranks, and the test accuracy
after it. With --log-steps FIRST:LAST (21:30 when given alone) rank 0 also prints one
line with "event": "step": the rate of those steps of the run (counted from 1 across
epochs), its own images over the seconds between the GPU synchronised after step
FIRST-1 and after step LAST, as mtrain's step events (after its first steps, which plan
or time every convolution); the epoch lines stay as they were. With --device cpu (gloo)
the script runs anywhere, which is how it is checked without a GPU (--max-steps keeps
that short).
"""
import argparse
import json
import os
import pathlib
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

# The model and the IDX reader are the CPU reference's (one definition of each).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_torch_train as ref  # noqa: E402


def batches(images, labels, batch, order, device, channels_last):
    """(x, y) on `device` for each batch of `order` (a permutation of the rows)."""
    for start in range(0, order.numel(), batch):
        rows = order[start:start + batch]
        x = images.index_select(0, rows).float().div_(255).unsqueeze(1)
        y = labels.index_select(0, rows)
        if device.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        x = x.to(device, non_blocking=True)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        yield x, y.to(device, non_blocking=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True, help="directory with the four Fashion-MNIST IDX files")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--amp", choices=["off", "bf16"], default="off")
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--cudnn-benchmark", action="store_true", help="torch.backends.cudnn.benchmark = True")
    ap.add_argument("--compile", action="store_true", help="torch.compile the DDP model")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=0, help="stop each epoch after this many steps (0 = all)")
    ap.add_argument("--no-eval", action="store_true", help="no test accuracy (test_acc null): only training kernels")
    ap.add_argument("--log-steps", nargs="?", const="21:30", default=None, metavar="FIRST:LAST",
                    help="also print the img/s of these steps of the run as a JSON line (default 21:30)")
    args = ap.parse_args()
    if args.epochs < 1 or args.batch_size < 1 or args.max_steps < 0:
        ap.error("--epochs and --batch-size expect positive integers, --max-steps a non-negative one")
    log_steps = None
    if args.log_steps is not None:
        try:
            log_steps = tuple(int(v) for v in args.log_steps.split(":"))
        except ValueError:
            log_steps = ()
        if len(log_steps) != 2 or not 1 <= log_steps[0] <= log_steps[1]:
            ap.error(f"--log-steps expects FIRST:LAST with 1 <= FIRST <= LAST, found '{args.log_steps}'")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit("bench_torch_gpu.py: RANK/WORLD_SIZE not set; start it under torchrun")

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    torch.manual_seed(args.seed)
    if args.cudnn_benchmark:
        torch.backends.cudnn.benchmark = True

    d = pathlib.Path(args.data_dir)
    train_x = ref.read_idx(d / "train-images-idx3-ubyte.gz")
    train_y = ref.read_idx(d / "train-labels-idx1-ubyte.gz").long()
    test_x = ref.read_idx(d / "t10k-images-idx3-ubyte.gz")
    test_y = ref.read_idx(d / "t10k-labels-idx1-ubyte.gz").long()

    model = ref.build("resnet18").to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    step_model = torch.compile(ddp, dynamic=False) if args.compile else ddp
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp == "bf16")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    run_step = 0  # steps of the run so far, across epochs
    window = None  # (perf_counter, the epoch's images, epoch) when the GPU finished step FIRST-1
    for epoch in range(args.epochs):
        # Rank r takes every world-th image of the epoch's order (DistributedSampler's
        # interleaving, without its padding).
        order = torch.randperm(train_x.shape[0], generator=torch.Generator().manual_seed(args.seed + epoch))
        order = order[rank::world]
        ddp.train()
        sync()
        start = time.perf_counter()
        images = 0
        for step, (x, y) in enumerate(batches(train_x, train_y, args.batch_size, order, device, args.channels_last)):
            if args.max_steps and step >= args.max_steps:
                break
            with autocast():
                loss = loss_fn(step_model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            images += x.shape[0]
            run_step += 1
            if log_steps and run_step == log_steps[0] - 1:
                sync()
                window = (time.perf_counter(), images, epoch)
            if log_steps and run_step == log_steps[1]:
                sync()
                # The window's start: after step FIRST-1, or the epoch's start for FIRST = 1.
                first = window if log_steps[0] > 1 else (start, 0, 0)
                if rank == 0 and first and first[2] == epoch:  # not across an epoch's end
                    sec = time.perf_counter() - first[0]
                    print(json.dumps({
                        "framework": "pytorch-ddp", "event": "step", "step": run_step,
                        "steps": f"{log_steps[0]}-{log_steps[1]}", "batch_size": args.batch_size,
                        "amp": args.amp, "channels_last": args.channels_last,
                        "cudnn_benchmark": args.cudnn_benchmark, "compile": args.compile,
                        "images": images - first[1], "sec": round(sec, 4),
                        "img_per_s": round((images - first[1]) / sec, 1)}), flush=True)
        sync()
        seconds = time.perf_counter() - start

        ddp.eval()
        correct = torch.zeros(2, dtype=torch.int64, device=device)
        with torch.no_grad(), autocast():
            test_order = torch.arange(rank, test_x.shape[0], world)
            for x, y in [] if args.no_eval else batches(test_x, test_y, 1024, test_order, device, args.channels_last):
                correct[0] += (step_model(x).argmax(1) == y).sum()
                correct[1] += y.numel()
        dist.all_reduce(correct)
        totals = torch.tensor([images], dtype=torch.int64, device=device)
        dist.all_reduce(totals)
        if rank == 0:
            print(json.dumps({
                "framework": "pytorch-ddp", "version": torch.__version__,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "amp": args.amp, "channels_last": args.channels_last, "cudnn_benchmark": args.cudnn_benchmark,
                "compile": args.compile, "world_size": world, "batch_size": args.batch_size, "epoch": epoch + 1,
                "sec": round(seconds, 3), "img_per_s": round(totals.item() / seconds, 1),
                "test_acc": None if args.no_eval else round(correct[0].item() / max(correct[1].item(), 1), 4)}),
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
