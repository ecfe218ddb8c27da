"""PyTorch's dist.all_reduce (backend gloo) measured like mtrain-bench: float32 sum,
inputs rewritten before each iteration, only the collective timed, result checked after
it, rows in mtrain-bench's format on rank 0. Started by scripts/bench-collectives.sh
with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (env:// initialisation).

usage: bench-collectives-torch.py <min bytes> <max bytes> <warmup> <iters> [--median]
(--median: report the median iteration time instead of the mean, as mtrain-bench)
"""
import statistics
import sys
import time

import torch
import torch.distributed as dist


def main():
    min_bytes, max_bytes, warmup, iters = (int(a) for a in sys.argv[1:5])
    median = sys.argv[5:] == ["--median"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print("# %12s %12s %12s %12s %12s  %s" % ("bytes", "count", "time_us", "algbw_GB/s", "busbw_GB/s", "check"))
    failures = 0
    size = min_bytes
    while size <= max_bytes:
        count = size // 4
        index = torch.arange(count, dtype=torch.int64)
        buffer = torch.empty(count, dtype=torch.float32)
        seconds, wrong = [], 0
        for it in range(warmup + iters):
            # Same pattern as mtrain-bench: (rank + 1) * (1..13), exact sums.
            pattern = ((index * 7 + it * 3) % 13 + 1).to(torch.float32)
            buffer.copy_(pattern * (rank + 1))
            start = time.perf_counter()
            dist.all_reduce(buffer)
            if it >= warmup:
                seconds.append(time.perf_counter() - start)
            wrong += int((buffer != pattern * (world * (world + 1) / 2)).sum())
        failures += wrong != 0
        if rank == 0:
            t = statistics.median(seconds) if median else sum(seconds) / iters
            algbw = size / t / 1e9
            print("  %12d %12d %12.1f %12.3f %12.3f  %s"
                  % (size, count, t * 1e6, algbw, algbw * 2 * (world - 1) / world, "FAIL" if wrong else "OK"),
                  flush=True)
        size *= 2
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
