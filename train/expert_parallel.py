"""Expert parallelism (EP): experts sharded over the ranks of an EP group, tokens moved by all-to-all.

Rank r of an EP group of size M owns the contiguous experts [r*E/M, (r+1)*E/M). `install` replaces each
MoE layer's dispatcher (model/dispatch.py) by an AllToAllDispatcher, which wraps the layer's own (sorted
or row-map) dispatcher, sized for the rank's experts, for the rows it receives. Per MoE layer:

    dispatch: permute by destination rank -> all-to-all (x rows, combine weights, local expert ids)
              -> the local dispatcher's dispatch of the received rows
    experts:  the layer's experts, the rank's own only (handle.first_expert)
    combine:  the local dispatcher's combine -> all-to-all back -> add the partial sums per source token

A token is sent once per destination rank even when several of its top-k experts live there: the
receiver sums those experts' weighted outputs and returns one row (Megatron-LM's alltoall dispatcher
and DeepEP send one copy per rank as well). The split sizes and per-expert counts are exchanged with one
small all-to-all and read to the host once per layer, like the single-process layer's one read.

Rows arrive grouped by source rank, each group in ascending token order, so when the EP group holds
the whole data-parallel batch (world size == ep_size) every expert sees exactly the rows, in the order,
that one process sees on the concatenated batch, and its outputs and parameter gradients are bitwise
the single-process ones. The combine adds each destination rank's partial sum in ascending rank
(= ascending expert) order, which equals the single-process summation for k <= 2.
"""
import dataclasses
import warnings

import torch
import torch.distributed as dist

with warnings.catch_warnings():  # the autograd all-to-all is the documented one on gloo; its successor is not
    warnings.simplefilter("ignore", FutureWarning)
    from torch.distributed.nn.functional import all_to_all_single as _all_to_all_autograd

from model.dispatch import DispatchHandle, RowLayout
from model.moe import MOEFeedForward
from model.router import tokens_per_expert


def all_to_all_autograd(output, input, output_split_sizes, input_split_sizes, group):
    """Uneven all-to-all whose backward is the reverse all-to-all (torch.distributed.nn)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return _all_to_all_autograd(output, input, output_split_sizes, input_split_sizes, group=group)


@dataclasses.dataclass(kw_only=True)
class AllToAllHandle(DispatchHandle):
    local: DispatchHandle  # the local dispatcher's handle of the received rows
    send_token: torch.Tensor  # [n_send] token of each sent row, grouped by destination rank
    send_rows: list  # rows sent to each rank (host ints)
    recv_rows: list  # rows received from each rank
    shape_TD: tuple


class AllToAllDispatcher:
    """Expert-parallel token dispatcher (see the module docstring); installed as `MOEFeedForward.dispatcher`.

    AllToAllDispatcher(ep_group, num_experts, single_process): single_process is the layer's own
    dispatcher (for all E experts); a copy of it sized for this rank's E / ep_size experts (`local`)
    dispatches the received rows. Attributes: ep_size, ep_rank, experts_per_rank, first_expert, and the
    counters `bytes_sent` (x bytes this rank dispatched) and `bytes_k_copies` (what one copy per routed
    (token, slot) pair would have cost).

    dispatch(x_TD [T, D], topk_idx_TK int64 [T, K] in [-1, E), topk_weight_TK [T, K], layout=None,
    permute=True) -> (rows, tokens_per_expert, handle) of the local dispatcher for the received rows
    (layout.pad_to scaled by ep_size: each source rank may fill a capacity), with handle.first_expert
    = this rank's first expert and handle.tokens_per_expert_E this rank's routed pairs per global expert.
    combine(rows_out, handle) -> y_TD [T, D]. Every rank of the group must call both (collectives).

    Raises ValueError when ep_size does not divide num_experts.
    """

    def __init__(self, ep_group, num_experts, single_process):
        self.group = ep_group
        self.ep_size = dist.get_world_size(ep_group)
        self.ep_rank = dist.get_rank(ep_group)
        if num_experts % self.ep_size:
            raise ValueError(f"ep_size={self.ep_size} must divide num_experts={num_experts}")
        self.num_experts = num_experts
        self.experts_per_rank = num_experts // self.ep_size
        self.first_expert = self.ep_rank * self.experts_per_rank
        self.single_process = single_process
        self.local = dataclasses.replace(single_process, num_experts=self.experts_per_rank)
        self.bytes_sent = 0
        self.bytes_k_copies = 0

    def owns(self, expert):
        return self.first_expert <= expert < self.first_expert + self.experts_per_rank

    def _exchange_counts(self, topk_idx_TK, send_TM):
        """All-to-all of the rows per destination rank and the pairs per expert; the layer's one host read.
        Returns tokens_per_expert_E [E] (device), send_rows, recv_rows, pairs received per local expert,
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

    def dispatch(self, x_TD, topk_idx_TK, topk_weight_TK, layout=None, permute=True):
        T, D = x_TD.shape
        M, L, dev = self.ep_size, self.experts_per_rank, x_TD.device
        valid_TK = topk_idx_TK >= 0
        dest_TK = torch.where(valid_TK, topk_idx_TK.div(L, rounding_mode="floor"), M)  # M = nowhere
        send_TM = torch.zeros(T, M + 1, dtype=torch.bool, device=dev).scatter_(1, dest_TK, True)[:, :M]
        pairs_E, send_rows, recv_rows, recv_per_local_expert, pairs_sent = self._exchange_counts(topk_idx_TK, send_TM)
        n_send, n_recv = sum(send_rows), sum(recv_rows)

        # Permute: one row per (token, destination rank), ordered by rank, then token (argsort of a unique
        # key, no sync); each row carries the slots of that rank's experts (local ids), the others -1.
        t_T1 = torch.arange(T, device=dev)[:, None]
        key_TM = torch.where(send_TM, torch.arange(M, device=dev)[None, :] * T + t_T1, M * T + t_T1)
        order = torch.argsort(key_TM.reshape(-1))[:n_send]
        send_token, send_dest = order // M, order % M
        local_send = torch.where(dest_TK[send_token] == send_dest[:, None],
                                 topk_idx_TK[send_token] - send_dest[:, None] * L, -1)
        w_send = torch.where(local_send >= 0, topk_weight_TK[send_token], 0.0)
        x_send = x_TD[send_token]
        self.bytes_sent += n_send * D * x_TD.element_size()
        self.bytes_k_copies += pairs_sent * D * x_TD.element_size()

        x_recv = all_to_all_autograd(x_send.new_empty(n_recv, D), x_send, recv_rows, send_rows, group=self.group)
        w_recv = all_to_all_autograd(w_send.new_empty(n_recv, w_send.shape[1]), w_send.contiguous(), recv_rows,
                                     send_rows, group=self.group)
        idx_recv = local_send.new_empty(n_recv, local_send.shape[1])
        dist.all_to_all_single(idx_recv, local_send.contiguous(), recv_rows, send_rows, group=self.group)

        layout = layout or RowLayout()
        pad_to = layout.pad_to * M if layout.pad_to is not None else None  # each source rank may fill the capacity
        rows, tokens_per_expert_, local = self.local.dispatch(
            x_recv, idx_recv, w_recv, RowLayout(pad_to, layout.alignment, may_drop=True), permute,
            host_tokens_per_expert=recv_per_local_expert)
        handle = AllToAllHandle(
            row_weight_P=local.row_weight_P, first_expert=self.first_expert, row_map=local.row_map,
            permuted=local.permuted, out_dtype=x_TD.dtype, tokens_per_expert_E=pairs_E,
            padded_tokens_per_expert_E=local.padded_tokens_per_expert_E, local=local, send_token=send_token,
            send_rows=send_rows, recv_rows=recv_rows, shape_TD=(T, D))
        return rows, tokens_per_expert_, handle

    def combine(self, rows_out, handle):
        y_recv = self.local.combine(rows_out, handle.local)
        y_send = all_to_all_autograd(y_recv.new_empty(sum(handle.send_rows), y_recv.shape[1]), y_recv,
                                     handle.send_rows, handle.recv_rows, group=self.group)
        # Add the partial sums in ascending destination rank. Empty slices are added too: the output must
        # reach every all-to-all even when this rank sent nothing, because backward runs the same
        # collectives on every rank of the group.
        y_TD = torch.zeros(handle.shape_TD, dtype=handle.out_dtype, device=y_send.device)
        start = 0
        for n in handle.send_rows:
            y_TD = y_TD.index_add(0, handle.send_token[start:start + n], y_send[start:start + n])
            start += n
        return y_TD


def moe_layers(model):
    """Every MOEFeedForward of `model`, in module order."""
    return [m for m in model.modules() if isinstance(m, MOEFeedForward)]


def install(model, ep_group, num_experts):
    """Make every MoE layer of `model` dispatch through an AllToAllDispatcher over `ep_group` (wrapping its
    own dispatcher). Returns the dispatchers. Raises ValueError when ep_size does not divide num_experts."""
    for moe in moe_layers(model):
        if not isinstance(moe.dispatcher, AllToAllDispatcher):
            moe.dispatcher = AllToAllDispatcher(ep_group, num_experts, moe.dispatcher)
    return ep_dispatchers(model)


def uninstall(model):
    """Give every MoE layer back its single-process dispatcher."""
    for moe in moe_layers(model):
        if isinstance(moe.dispatcher, AllToAllDispatcher):
            moe.dispatcher = moe.dispatcher.single_process


def ep_dispatchers(model):
    """The AllToAllDispatcher of every MoE layer that has one (e.g. for their byte counters)."""
    return [m.dispatcher for m in moe_layers(model) if isinstance(m.dispatcher, AllToAllDispatcher)]


def expert_param_names(model):
    """Names of every expert parameter (handled by EP, not DDP)."""
    return [n for n, _ in model.named_parameters() if ".experts." in n]


def local_expert_params(model):
    """The parameters of the experts this rank owns (all of them where EP is not installed)."""
    out = []
    for moe in moe_layers(model):
        d = moe.dispatcher if isinstance(moe.dispatcher, AllToAllDispatcher) else None
        for e, expert in enumerate(moe.experts):
            if d is None or d.owns(e):
                out.extend(expert.parameters())
    return out


def reduce_expert_grads(model, expert_dp_group, world_size):
    """Sum each owned expert's grads over the ranks holding the same experts and divide by the world
    size: the DDP-consistent mean over all ranks (each local grad already sums its EP group's tokens)."""
    for p in local_expert_params(model):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if dist.get_world_size(expert_dp_group) > 1:
            dist.all_reduce(p.grad, group=expert_dp_group)
        p.grad.div_(world_size)


def clip_grad_norm_ep(model, max_norm, ep_group):
    """Global grad-norm clipping when experts are sharded: dense grads are identical on every rank,
    each expert's grad lives on its owner, so norm^2 = dense^2 + (sum over the EP group of owned^2)."""
    owned = {id(p) for p in local_expert_params(model)}
    expert_names = set(expert_param_names(model))
    dense = [p for n, p in model.named_parameters() if n not in expert_names and p.grad is not None]
    local = [p for p in model.parameters() if id(p) in owned and p.grad is not None]
    dev = next(model.parameters()).device
    dense_sq = sum((p.grad.float().pow(2).sum() for p in dense), torch.zeros((), device=dev))
    expert_sq = sum((p.grad.float().pow(2).sum() for p in local), torch.zeros((), device=dev))
    dist.all_reduce(expert_sq, group=ep_group)
    total = (dense_sq + expert_sq).sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in dense + local:
        p.grad.mul_(scale)
    return total


@torch.no_grad()
def gather_experts(model, optimizer, ep_group):
    """Make every rank's expert weights (and AdamW state) the owners' current ones, so any rank holds
    the full single-process state_dict: checkpoints stay independent of the EP size."""
    ranks = dist.get_process_group_ranks(ep_group)
    for moe in moe_layers(model):
        d = moe.dispatcher
        if not isinstance(d, AllToAllDispatcher):
            continue
        for e, expert in enumerate(moe.experts):
            src = ranks[e // d.experts_per_rank]
            for p in expert.parameters():
                dist.broadcast(p.data, src=src, group=ep_group)
                if optimizer is None:
                    continue
                state = optimizer.state[p]
                if not state:  # never stepped here: make room for the owner's state
                    state.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(p),
                                 exp_avg_sq=torch.zeros_like(p))
                for key in ("exp_avg", "exp_avg_sq"):
                    dist.broadcast(state[key], src=src, group=ep_group)
                step = state["step"].to(p.device)
                dist.broadcast(step, src=src, group=ep_group)
                state["step"].copy_(step)
