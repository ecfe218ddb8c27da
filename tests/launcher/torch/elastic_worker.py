"""A PyTorch program written for torchrun's elastic features, run by
tests/launcher/test_launch_torch.cpp under mtrain-launch.

  --fail-rank R   rank R raises inside a function wrapped in torch's @record, which
                  writes the exception and its traceback to TORCHELASTIC_ERROR_FILE
  --wait-dir D    each rank writes D/ready_<rank>, then waits for SIGTERM; its handler
                  writes D/sigterm_<rank> and the rank dies of SIGTERM as it would
                  without a handler
"""
import argparse
import os
import signal
import time

from torch.distributed.elastic.multiprocessing.errors import record


def fail(rank):
    raise ValueError(f"rank {rank} failed on purpose")


@record
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--wait-dir", default="")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    print(f"rank {rank} of {world}", flush=True)
    if rank == args.fail_rank:
        fail(rank)
    if args.wait_dir:
        def on_sigterm(signum, frame):
            with open(os.path.join(args.wait_dir, f"sigterm_{rank}"), "w") as f:
                f.write("SIGTERM\n")
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, on_sigterm)
        open(os.path.join(args.wait_dir, f"ready_{rank}"), "w").close()
        time.sleep(120)


if __name__ == "__main__":
    main()
