"""A tiny multi-host job for the emulated-cluster tests: one gloo all_reduce, checked.

Run under torchrun (or with RANK/WORLD_SIZE/MASTER_ADDR set); prints one JSON line per rank.
"""

import json
import os
import socket

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.full((1000,), float(rank + 1))
    dist.all_reduce(x)
    expected = world * (world + 1) / 2
    assert torch.all(x == expected), f"rank {rank}: got {x[0].item()}, expected {expected}"
    print(json.dumps({"rank": rank, "world": world, "sum": x[0].item(), "host": os.environ.get("EMUCLUSTER_HOST"),
                      "ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "hostname": socket.gethostname()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
