"""The processes of a run: torchrun's environment -> process groups and DeviceMeshes (`DistContext`), what
every rank must agree on, rank 0 first, the end; and the two things a step does differently when the ranks
hold parts of the model (gradient sync off between micro-steps, the clip over the ranks' parts).
Expert parallelism and FSDP2 on the model itself: train/parallel.py.
"""
import contextlib
import json
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    ep_size: int = 1
    ep_mesh: object = None         # 1-D DeviceMesh of this rank's EP group: the experts are sharded over it
    expert_dp_mesh: object = None  # 1-D: the ranks holding the same experts; FSDP2 shards them over it
    dp_mesh: object = None         # 2-D (replicate, shard) of every rank: FSDP2's mesh for the rest
    cpu_group: object = None  # every rank, gloo: host-side values (the loop's clock and stop signals) beside NCCL

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def distributed(self):
        return self.world_size > 1


def init_distributed(ep_size, device_type, fsdp=False):
    """Initialise torch.distributed when launched by torchrun (WORLD_SIZE > 1); NCCL on CUDA, gloo on CPU.
    The meshes (DeviceMesh): a 2-D one (expert_dp, ep) of shape (W / ep_size, ep_size), rows the EP groups
    (blocks of consecutive ranks), columns the ranks holding the same experts; and a 2-D one (replicate,
    shard) of all ranks, (1, W) with --fsdp (FSDP2 shards over all) or (W, 1) (FSDP2 replicates).

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
    experts = init_device_mesh(device_type, (world // ep_size, ep_size), mesh_dim_names=("expert_dp", "ep"))
    return DistContext(rank=dist.get_rank(), world_size=world, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                       ep_size=ep_size, ep_mesh=experts["ep"], expert_dp_mesh=experts["expert_dp"],
                       dp_mesh=init_device_mesh(device_type, (1, world) if fsdp else (world, 1),
                                                mesh_dim_names=("replicate", "shard")),
                       cpu_group=dist.new_group(backend="gloo"))


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


class PeerFailed(Exception):
    """Another rank failed in a step this one waited for; that rank reports the error."""


def main_rank_first(ctx, fn):
    """fn() on rank 0 first, then on the others (rank 0 builds caches / the run folder). When it fails on
    rank 0, the others learn it from one broadcast and raise PeerFailed instead of hanging at a barrier."""
    if not ctx.distributed:
        return fn()
    failure = [None]
    if ctx.is_main:
        try:
            result = fn()
        except BaseException as e:
            dist.broadcast_object_list([" ".join(f"{type(e).__name__}: {e}".split())], src=0)
            raise
        dist.broadcast_object_list(failure, src=0)
        return result
    dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise PeerFailed(f"rank 0 failed ({failure[0]})")
    return fn()


def shutdown(ctx, wait_for_peers=True):
    """Tear the process groups down. On a normal exit all ranks wait for each other first: a rank that
    leaves while a peer is still inside a collective can make gloo abort the peer at exit."""
    if ctx.distributed and dist.is_initialized():
        if wait_for_peers:
            dist.barrier()
        dist.destroy_process_group()


@contextlib.contextmanager
def no_grad_sync(train_model):
    """Within: backward keeps the grads on this rank (a micro-step before the last of gradient accumulation):
    DDP's no_sync, FSDP2's set_requires_gradient_sync(False)."""
    module = getattr(train_model, "_orig_mod", train_model)
    if not isinstance(module, FSDPModule):
        with module.no_sync():
            yield
        return
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


# The experts' norm is summed over both dimensions of their mesh, one all-reduce each (torch warns it could be
# one); every rank ends with the same bits: each all-reduce gives its group one result.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def clip_grad_norm_sharded(model, max_norm):
    """Clip every grad to the global norm when the ranks hold parts (FSDP's shards, EP's experts): the
    grads are DTensors, grouped by mesh (the experts' and the rest's), each group's norm taken over its
    ranks (DTensor), norm = sqrt of the sum of their squares. Returns the norm before clipping."""
    groups = {}
    for p in model.parameters():
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    squares = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float().pow(2))
    total = torch.stack(squares).sum().sqrt() if squares else torch.zeros(())
    for params in groups.values():  # (apart: torch's foreach ops take the DTensors of one mesh at a time)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
