"""Process groups for data parallelism (DDP) and expert parallelism (EP), from torchrun's environment.

With W ranks and ep_size M (M | W): EP groups are the blocks of M consecutive ranks [g*M, (g+1)*M);
each holds all experts, sharded. The expert-data-parallel groups join the ranks holding the same experts
({r, r+M, r+2M, ...}); expert gradients are reduced over those, dense gradients over all W by DDP.
"""
import gc
import json
import os
from dataclasses import dataclass

import torch.distributed as dist


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    ep_size: int = 1
    ep_group: object = None
    expert_dp_group: object = None

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def distributed(self):
        return self.world_size > 1


def init_distributed(ep_size, device_type):
    """Initialise torch.distributed when launched by torchrun (WORLD_SIZE > 1); NCCL on CUDA, gloo on CPU.

    Raises ValueError when ep_size < 1 or does not divide the world size.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if ep_size < 1:
        raise ValueError(f"--ep_size must be >= 1, got {ep_size}")
    if world % ep_size:
        raise ValueError(f"--ep_size {ep_size} must divide the world size {world} "
                         f"(launch with torchrun --nproc_per_node a multiple of {ep_size})")
    if world == 1:
        return DistContext()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    rank = dist.get_rank()
    ctx = DistContext(rank=rank, world_size=world, local_rank=int(os.environ.get("LOCAL_RANK", "0")), ep_size=ep_size)
    for g in range(world // ep_size):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(g * ep_size, (g + 1) * ep_size)))
        if rank // ep_size == g:
            ctx.ep_group = group
    for r in range(ep_size):
        group = dist.new_group(list(range(r, world, ep_size)))
        if rank % ep_size == r:
            ctx.expert_dp_group = group
    return ctx


def check_same_on_all_ranks(ctx, what, value):
    """Raise ValueError on every rank if `value` (JSON-able dict) differs between ranks, naming the keys."""
    if not ctx.distributed:
        return
    values = [None] * ctx.world_size
    dist.all_gather_object(values, json.dumps(value, sort_keys=True, default=str))
    ref = json.loads(values[0])
    for r, v in enumerate(values[1:], 1):
        other = json.loads(v)
        diff = sorted(k for k in set(ref) | set(other) if ref.get(k) != other.get(k))
        if diff:
            raise ValueError(f"{what} differs between rank 0 and rank {r} in {diff}: "
                             f"{[(ref.get(k), other.get(k)) for k in diff]}")


def barrier(ctx):
    if ctx.distributed:
        dist.barrier()


def shutdown(ctx, wait_for_peers=True):
    """Tear the process groups down. On a normal exit all ranks wait for each other first: a rank that
    leaves while a peer is still inside a collective can make gloo abort the peer at exit."""
    if ctx.distributed and dist.is_initialized():
        gc.collect()  # groups held in reference cycles (EP dispatchers) go now, not at interpreter exit
        if wait_for_peers:
            dist.barrier()
        dist.destroy_process_group()
