#!/usr/bin/python3
"""Baseline for allgather_bench: torch.distributed gloo all_gather among
`--ranks` processes on 127.0.0.1, each rank contributing `--bytes_per_rank`
bytes of fp16 (Debian's gloo has no bf16; the bytes are what matter).

Each repeat: barrier, all_gather into a list, then the slowest rank's time
(all_reduce MAX). Prints one line rank 0 measured:
  gloo_allgather ranks=R bytes_per_rank=B median_s=X best_s=Y repeats=N
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, args):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                            world_size=args.ranks)
    numel = args.bytes_per_rank // 2
    mine = torch.full((numel,), float(rank), dtype=torch.float16)
    out = [torch.empty(numel, dtype=torch.float16) for _ in range(args.ranks)]
    times = []
    for r in range(args.repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        dist.all_gather(out, mine)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if r > 0:  # r = 0 warms up
            times.append(elapsed.item())
    for i, t in enumerate(out):
        assert t[0].item() == float(i) and t[-1].item() == float(i), "wrong all_gather result"
    if rank == 0:
        print(f"gloo_allgather ranks={args.ranks} bytes_per_rank={numel * 2} "
              f"median_s={statistics.median(times):.6f} best_s={min(times):.6f} repeats={len(times)}",
              flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--bytes_per_rank", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--port", type=int, default=29511)
    args = parser.parse_args()
    mp.spawn(worker, args=(args,), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
