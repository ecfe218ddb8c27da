"""A DDP training script written the way PyTorch's DDP tutorial writes it: env://
rendezvous, DistributedSampler, DistributedDataParallel, nothing launcher-specific.
Rank 0 prints one line per step, "step N loss L", with the loss in full precision, so
two launchers' runs can be compared exactly.

    torchrun --nproc_per_node 2 ddp_tutorial.py [--steps 5] [--fail-once-on-rank R]

--fail-once-on-rank R: rank R raises on the first attempt (TORCHELASTIC_RESTART_COUNT 0),
so a launcher with --max_restarts must run the script again.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


@record
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--fail-once-on-rank", type=int, default=-1)
    args = ap.parse_args()

    dist.init_process_group("gloo")  # env:// from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank = dist.get_rank()
    if rank == args.fail_once_on_rank and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        raise RuntimeError(f"rank {rank} fails on purpose on the first attempt")

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 8), torch.randint(0, 3, (256,)))
    sampler = DistributedSampler(data, shuffle=True, seed=1)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    sampler.set_epoch(0)
    for step, (x, y) in enumerate(loader):
        if step == args.steps:
            break
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        # The mean over the ranks, so every launcher's rank 0 prints the same number.
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step} loss {mean.item() / dist.get_world_size():.9f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
