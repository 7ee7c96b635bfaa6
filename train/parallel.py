"""Expert parallelism and FSDP2 on the model: the all-to-all dispatcher that shards the experts, the
model built where it will live, and `fully_shard` on every unit (model/ holds no distributed code; this
wraps its dispatchers and turns its stacked experts into DTensors; the process groups and meshes are
train/distributed.py's).

With W ranks and ep_size M (M | W), the EP groups are the blocks of M consecutive ranks; rank r of a group
holds experts [r*E/M, (r+1)*E/M) of every layer: the stacked expert weights are DTensors sharded on the
expert dimension over the `ep` mesh dimension (`install`), and nothing of the other experts exists on the
rank. The ranks holding the same experts form the expert-data-parallel mesh. Under EP or --fsdp FSDP2
carries every parameter (`shard`): each layer's experts sharded over their expert-data-parallel ranks
(so a rank holds 1/W of every expert weight, gradient and AdamW moment), each transformer block and the
root over all W ranks, sharded with --fsdp, else replicated (HSDP with shards of one rank: DDP's
all-reduce). Without EP or --fsdp, DDP. Per MoE layer: dispatch = rows by destination rank -> two
all-to-alls (the rows; their routing weights with local expert ids), torch's functional ones with autograd ->
the layer's own dispatcher on the received rows -> the rank's experts; combine = local combine -> all-to-all
back -> each token's partial sums added in ascending rank (one gather-sum, no loop over ranks).
A token goes once to each rank that holds one of its experts (as Megatron-LM's alltoall dispatcher and
DeepEP). Counts travel in one small all-to-all, read to the host once per layer; every rank runs the
same collectives whatever it receives, so backward always pairs up. Rows arrive grouped by source rank
in token order: with the whole batch in one EP group every expert sees the single-process rows in order
(bitwise the same outputs and gradients; the combine's for k <= 2). The layout follows torchtitan's
(experts as DTensors on the EP mesh, FSDP over the expert-data-parallel ranks).
"""
import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from model.dispatch import RowLayout, sum_rows
from model.model_minimind import init_weights
from model.moe import MOEFeedForward
from model.router import tokens_per_expert

class AllToAllDispatcher:
    """The expert-parallel token dispatcher (module doc), installed as `MOEFeedForward.dispatcher`; it
    wraps the layer's own (`single_process`), a copy of which sized for this rank's E / ep_size experts
    (`local`) dispatches the received rows. dispatch / combine as model/dispatch.py's, collectives on
    every rank of the group; counters `bytes_sent` (x bytes dispatched) and `bytes_k_copies` (what one copy
    per routed pair would cost). Raises ValueError when ep_size does not divide num_experts."""

    def __init__(self, ep_group, num_experts, single_process):
        self.group = ep_group
        self.ep_size, self.ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        if num_experts % self.ep_size:
            raise ValueError(f"ep_size={self.ep_size} must divide num_experts={num_experts}")
        self.num_experts = num_experts
        self.experts_per_rank = num_experts // self.ep_size
        self.first_expert = self.ep_rank * self.experts_per_rank
        self.single_process = single_process
        self.local = dataclasses.replace(single_process, num_experts=self.experts_per_rank)
        self.bytes_sent = self.bytes_k_copies = 0

    def _exchange_counts(self, topk_idx_TK, send_TM):
        """All-to-all of the rows per destination rank and the pairs per expert; the layer's one host read.
        Returns pairs per global expert [E] (device), send_rows, recv_rows, pairs received per local expert,
        pairs sent."""
        M, L = self.ep_size, self.experts_per_rank
        pairs_E = tokens_per_expert(topk_idx_TK, M * L)
        send_meta_ML1 = torch.cat([send_TM.sum(0, dtype=torch.int64)[:, None], pairs_E.view(M, L)], dim=1)
        recv_meta_ML1 = torch.empty_like(send_meta_ML1)
        dist.all_to_all_single(recv_meta_ML1.view(-1), send_meta_ML1.view(-1), group=self.group)
        host = torch.cat([send_meta_ML1.view(-1), recv_meta_ML1.view(-1)]).tolist()  # the layer's one host read
        send, recv = host[:M * (L + 1)], host[M * (L + 1):]
        recv_per_local_expert = [sum(recv[m * (L + 1) + 1 + l] for m in range(M)) for l in range(L)]
        pairs_sent = sum(send[m * (L + 1) + 1 + l] for m in range(M) for l in range(L))
        return pairs_E, send[0::L + 1], recv[0::L + 1], recv_per_local_expert, pairs_sent

    def dispatch(self, x_TD, topk_idx_TK, topk_weight_TK, layout=RowLayout()):
        T, D = x_TD.shape
        M, L, dev = self.ep_size, self.experts_per_rank, x_TD.device
        valid_TK = topk_idx_TK >= 0
        dest_TK = torch.where(valid_TK, topk_idx_TK.div(L, rounding_mode="floor"), M)  # M = nowhere
        send_TM = torch.zeros(T, M + 1, dtype=torch.bool, device=dev).scatter_(1, dest_TK, True)[:, :M]
        pairs_E, send_rows, recv_rows, recv_per_local_expert, pairs_sent = self._exchange_counts(topk_idx_TK, send_TM)
        n_send = sum(send_rows)
        # One row per (token, destination rank), ordered by rank, then token (argsort of a unique key, no
        # sync); each row carries the slots of that rank's experts (local ids), the others -1.
        t_T1 = torch.arange(T, device=dev)[:, None]
        key_TM = torch.where(send_TM, torch.arange(M, device=dev)[None, :] * T + t_T1, M * T + t_T1)
        order = torch.argsort(key_TM.reshape(-1))[:n_send]
        send_token, send_dest = order // M, order % M
        local_send = torch.where(dest_TK[send_token] == send_dest[:, None],
                                 topk_idx_TK[send_token] - send_dest[:, None] * L, -1)
        w_send = torch.where(local_send >= 0, topk_weight_TK[send_token], 0.0)
        self.bytes_sent += n_send * D * x_TD.element_size()
        self.bytes_k_copies += pairs_sent * D * x_TD.element_size()
        x_recv = all_to_all_single_autograd(x_TD[send_token], recv_rows, send_rows, self.group)
        # the routing weights and local ids travel together (ids as floats: exact below 2**24); the weights'
        # gradient comes back the same way
        K, meta_dtype = topk_idx_TK.shape[1], torch.promote_types(topk_weight_TK.dtype, torch.float32)
        meta_send = torch.cat([w_send.to(meta_dtype), local_send.to(meta_dtype)], dim=1)
        w_recv, idx_recv = all_to_all_single_autograd(meta_send, recv_rows, send_rows, self.group).split(K, dim=1)
        w_recv, idx_recv = w_recv.to(topk_weight_TK.dtype), idx_recv.long()
        # each source rank may fill its own capacity (from its own batch): pad to what arrives at most
        pad_to = max(layout.pad_to * M, *recv_per_local_expert) if layout.pad_to is not None else None
        local = self.local.dispatch(x_recv, idx_recv, w_recv, RowLayout(pad_to, layout.alignment, may_drop=True),
                                    host_tokens_per_expert=recv_per_local_expert)
        # where each token's rows come back: its destinations' rows in ascending rank (a row's index grows
        # with its rank), -1 first for the ranks it skips; min(K, M) columns
        row_of_key = torch.full((T * M,), -1, dtype=torch.int64, device=dev).scatter_(
            0, order, torch.arange(n_send, device=dev))
        row_TJ = row_of_key.view(T, M).sort(dim=1).values[:, M - min(K, M):]
        return dataclasses.replace(local, routed_E=pairs_E, state=AllToAllState(
            local, row_TJ, send_rows, recv_rows, x_TD.dtype))

    def combine(self, rows_out_PD, dispatched):
        state = dispatched.state
        y_recv = self.local.combine(rows_out_PD, state.local)
        y_send = all_to_all_single_autograd(y_recv, state.send_rows, state.recv_rows, self.group)
        # Each token's partial sums in ascending destination rank (fp32); a missing one reads an appended zero
        # row, which also keeps y_send in the graph when this rank sent nothing: backward must reach every
        # all-to-all on every rank.
        n_send = y_send.shape[0]
        rows_with_zero = torch.cat([y_send, y_send.new_zeros(1, y_send.shape[1])])
        return sum_rows(rows_with_zero, torch.where(state.row_TJ < 0, n_send, state.row_TJ), state.dtype,
                        has_holes=False)


@dataclass
class AllToAllState:
    """AllToAllDispatcher's combine metadata: local, the wrapped dispatcher's Dispatched (received rows);
    row_TJ int64 [T, min(K, M)] the rows sent for each token (ordered by destination rank, -1: none);
    send_rows / recv_rows: rows sent to / received from each rank of the group (host lists); dtype: x's."""
    local: object
    row_TJ: torch.Tensor
    send_rows: list
    recv_rows: list
    dtype: torch.dtype


def moe_layers(model):
    """Every MOEFeedForward of `model`, in module order."""
    return [m for m in model.modules() if isinstance(m, MOEFeedForward)]


def install(model, ep_mesh, num_experts):
    """Expert parallelism on every MoE layer of `model`: an AllToAllDispatcher over `ep_mesh`'s group
    (wrapping the layer's own), and the layer's stacked expert weights become DTensors sharded on the expert
    dimension over `ep_mesh`, this rank holding its E / ep_size experts (a copy: the whole stack is freed;
    moved to the mesh's device first; a model on the meta device gets this rank's share there, so
    `to_empty` never allocates the other ranks' experts). Returns the dispatchers. Raises ValueError when
    ep_size does not divide num_experts."""
    rank = ep_mesh.get_local_rank()
    for moe in moe_layers(model):
        if isinstance(moe.dispatcher, AllToAllDispatcher):
            continue
        moe.dispatcher = AllToAllDispatcher(ep_mesh.get_group(), num_experts, moe.dispatcher)
        for name in ("gate_up_proj", "down_proj"):
            whole = getattr(moe.experts, name)
            if isinstance(whole, DTensor):  # (installed on the meta device already)
                continue
            mine = whole.detach().chunk(ep_mesh.size(), dim=0)[rank].clone()
            setattr(moe.experts, name, nn.Parameter(experts_shard(mine, ep_mesh), requires_grad=whole.requires_grad))
    return ep_dispatchers(model)


@torch.no_grad()
def build_model(build, device, seed, ep_mesh=None):
    """`build()` (a MiniMindForCausalLM constructor) on the meta device, then made real on `device`: under
    expert parallelism (`ep_mesh`) each stacked expert weight as this rank's share only (`install`), never
    the whole; the weights then drawn by key (model_minimind.init_weights), so they are a function of `seed`
    alone at any world size, ep_size and FSDP layout (FSDP shards them afterwards)."""
    with torch.device("meta"):
        model = build()
    if ep_mesh is not None:
        install(model, ep_mesh, model.config.num_experts)
    model.to_empty(device=device)
    model.tie_weights()
    init_weights(model, model.config.initializer_range, seed)
    return model


def experts_shard(local, ep_mesh):
    """This rank's rows `local` of a stacked expert weight as the DTensor sharded on the expert dimension
    over `ep_mesh` (moved to the mesh's device first; on the meta device it stays there)."""
    local = local if local.is_meta else local.to(ep_mesh.device_type)
    return DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)


def ep_dispatchers(model):
    """The AllToAllDispatcher of every MoE layer that has one (e.g. for their byte counters)."""
    return [m.dispatcher for m in moe_layers(model) if isinstance(m.dispatcher, AllToAllDispatcher)]


def expert_params(model):
    """The routed experts' stacked parameters (under EP: DTensors, this rank's experts)."""
    return [p for moe in moe_layers(model) for p in moe.experts.parameters()]


def shard(model, ctx):
    """FSDP2 (`fully_shard`) on every parameter: each layer's experts sharded over the ranks holding the same
    experts (`ctx.expert_dp_mesh`; their gradients summed there and divided by the world size, not that
    mesh's size: each rank's loss is scaled for an average over all W ranks, as for DDP), each transformer
    block, then the rest (embeddings, final norm, the tied head) at the root over all ranks (`ctx.dp_mesh`:
    sharded with --fsdp, else replicated, DDP's arithmetic). Forward / backward gather a unit's weights just
    in time and reduce its grads (reduce-scatter, all-reduce across replicas)."""
    for moe in moe_layers(model):
        fully_shard(moe.experts, mesh=ctx.expert_dp_mesh)
        moe.experts.set_gradient_divide_factor(ctx.world_size)
        # gloo has no pre-scaled sum: a sum, then the division (not on one rank: torch divides as it copies)
        moe.experts.set_force_sum_reduction_for_comms(dist.get_backend() == "gloo" and ctx.expert_dp_mesh.size() > 1)
    for block in model.model.layers:
        fully_shard(block, mesh=ctx.dp_mesh)
    # (the root keeps its gathered weights from forward to backward, FSDP2's default: the LM loss's backward
    # reads the head's weight, which torch 2.11 would have freed; `evaluate` reshards it after evaluating)
    fully_shard(model, mesh=ctx.dp_mesh)
