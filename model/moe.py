"""The mixture-of-experts feed-forward: route -> capacity policy -> dispatch -> experts -> combine.

Shape legend: B batch, S sequence, T = B*S tokens, D hidden size, E experts, K experts per token
(top-k), F expert intermediate size, P dispatched rows.

    1. route     (here; losses in model/router.py) softmax router, top-k, router losses, load counting
    2. capacity  (model/dispatch.py: drop_and_pad) padding tokens and over-capacity pairs go to no expert
    3. dispatch  (model/dispatch.py) rows grouped by expert                self.dispatcher.dispatch
    4. experts   (here: Experts) E SwiGLU FFNs, stacked weights, each on its rows   self.experts
    5. combine   (model/dispatch.py) each token's weighted sum of its rows self.dispatcher.combine

moe_impl "sorted" (the default) is bitwise the per-expert masked loop (MiniMind's layer, kept as the
reference in scripts/moe_reference.py) with one host sync per layer; "fused" builds the layout on
the device (no host sync) and applies the routing weights inside the experts.
What runs steps 3-5 is chosen when the layer is built: the experts' engine (`expert_loop` here; the
kernels' in kernels/experts.py) and the fused path's row movers (model/dispatch.py's plain ones, or
kernels/permute.py's); model/engines.py names them, train/engines.py picks the ones that pay.
Expert parallelism wraps the dispatcher (train/parallel.py).
"""
import contextlib
import functools
import math
import threading
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.dispatch import (PLAIN_MOVERS, RowMapDispatcher, SortedDispatcher, drop_and_pad,
                            order_slots)
from model.router import expert_bias_update, router_losses, tokens_per_expert

_warned_no_router_grad = False  # the k=1 warning below is given once per process


class FeedForward(nn.Module):
    """SwiGLU FFN: down(silu(gate(x)) * up(x)). x [..., D] -> [..., D]. Names match HF
    (`gate_proj`...). linear: the class of its three bias-free projections (nn.Linear or a subclass,
    e.g. kernels' oneDNN one)."""

    def __init__(self, hidden_size: int, intermediate_size: int, linear=nn.Linear):
        super().__init__()
        self.gate_proj = linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def swiglu(x, w_gate_FD, w_up_FD, w_down_DF):
    """down(silu(gate(x)) * up(x)) for one expert's weights in nn.Linear's layout: x [..., D] ->
    [..., D]."""
    return F.linear(F.silu(F.linear(x, w_gate_FD)) * F.linear(x, w_up_FD), w_down_DF)


def expert_loop(rows_PD, tokens_per_expert, row_weight_P, w_gate_up_E2FD, w_down_EDF):
    """The plain experts engine: one nn.Linear-style chain (`swiglu`) per expert, in a Python loop.

    rows_PD [P, D]; tokens_per_expert int64 [E'] (a CPU tensor, or on the device: then read to the
    host once); row_weight_P [P] or None; w_gate_up_E2FD [E', 2F, D], w_down_EDF [E', D, F] the
    experts' stacked weights -> [P, D]: expert e on its tokens_per_expert[e] rows, in order, each
    row scaled by row_weight_P (when given) before the down projection. Each expert runs on a fresh
    copy of its rows (a view at an offset may round differently in the GEMM, and the sorted path
    must match the masked loop's gathers bit for bit) and on weight views at the offsets `Expert`
    uses. An expert without rows still runs (on zero rows) while autograd records, so the gradient
    is the same whatever the routing."""
    # in the rows' dtype (a no-op but where a fused layer's rows come in autocast's dtype and the
    # weights in another than fp32, which autocast would leave as they are)
    w_gate_up_E2FD, w_down_EDF = w_gate_up_E2FD.to(rows_PD.dtype), w_down_EDF.to(rows_PD.dtype)
    w_gate_EFD, w_up_EFD = w_gate_up_E2FD.unflatten(1, (2, -1)).unbind(1)
    # unbind: the backward stacks the E experts' gradients once (a select per expert would add E
    # full-size zero tensors)
    weights = zip(w_gate_EFD.unbind(0), w_up_EFD.unbind(0), w_down_EDF.unbind(0))
    outs, start = [], 0
    for n, (w_gate, w_up, w_down) in zip(tokens_per_expert.tolist(), weights):
        if n == 0 and not torch.is_grad_enabled():
            continue
        x_e = rows_PD[start:start + n].clone()
        # (swiglu's ops, inline: one frame less)
        h_nF = F.silu(F.linear(x_e, w_gate)) * F.linear(x_e, w_up)
        # the routing weight before the down projection (linear: the same sum)
        if row_weight_P is not None:
            h_nF = h_nF * row_weight_P[start:start + n, None].to(h_nF.dtype)
        outs.append(F.linear(h_nF, w_down))
        start += n
    if start < rows_PD.shape[0]:  # rows of no expert (the fused path's holes): zero, as elsewhere
        like = outs[-1] if outs else rows_PD
        outs.append(like.new_zeros(rows_PD.shape[0] - start, rows_PD.shape[1]))
    return torch.cat(outs) if outs else rows_PD[:0].clone()


DECODE_TOKENS = 64  # at most this many tokens a call, outside autograd, on the CPU: `routed_loop`


def routed_loop(x_TD, topk_idx_TK, topk_weight_TK, w_gate_up_E2FD, w_down_EDF, weight_first):
    """Steps 3-5 for the few tokens of a decode step (MOEFeedForward.decodes), outside autograd
    on the CPU: each expert some token routes to, in ascending id, on its tokens' rows
    (ascending token) through the SwiGLU on views of the stacked weights; no sort, no row map,
    no layout, nothing for the experts no token picked; one token goes slot by slot, without row
    gathers. x_TD [T, D]; topk_idx_TK int64 [T, K] in [-1, E) (-1: no expert; read on the host);
    topk_weight_TK [T, K]; the stacked weights as `Experts` holds them -> y_TD [T, D] in x's dtype.
    The dispatchers' arithmetic: weight_first (the fused path) runs gate and up as one GEMM,
    scales the hidden rows before the down projection and sums each token's slots in fp32, else
    (the sorted path: expert_loop's ops on the same rows, bitwise) the outputs are scaled, cast to
    x's dtype and summed in it; slots in ascending expert id."""
    (T, K), D = topk_idx_TK.shape, x_TD.shape[1]
    topk_idx_TK, topk_weight_TK = order_slots(topk_idx_TK, topk_weight_TK)
    sum_dtype = (torch.promote_types(x_TD.dtype, torch.float32) if weight_first
                 else x_TD.dtype)
    w_gate_EFD, w_up_EFD = w_gate_up_E2FD.unflatten(1, (2, -1)).unbind(1)

    def expert(e, x_nD, weight_n1):
        if weight_first:
            gate_nF, up_nF = F.linear(x_nD, w_gate_up_E2FD[e]).chunk(2, dim=-1)
            hidden_nF = F.silu(gate_nF) * up_nF
            return F.linear(hidden_nF * weight_n1.to(hidden_nF.dtype), w_down_EDF[e]).to(sum_dtype)
        hidden_nF = F.silu(F.linear(x_nD, w_gate_EFD[e])) * F.linear(x_nD, w_up_EFD[e])
        return (F.linear(hidden_nF, w_down_EDF[e]) * weight_n1).to(sum_dtype)

    if T == 1:  # (the slots' sum in the same order as the rows' below)
        y_1D = x_TD.new_zeros(1, D, dtype=sum_dtype)
        for slot, e in enumerate(topk_idx_TK[0].tolist()):
            if e >= 0:
                y_1D = y_1D + expert(e, x_TD, topk_weight_TK[:, slot, None])
        return y_1D.to(x_TD.dtype)
    out_TKD = x_TD.new_zeros(T, K, D, dtype=sum_dtype)
    for e in sorted(set(topk_idx_TK.flatten().tolist()) - {-1}):
        token, slot = (topk_idx_TK == e).nonzero(as_tuple=True)
        # (a fresh copy of the rows, as expert_loop's: the sorted path's bits)
        out_TKD[token, slot] = expert(e, x_TD[token], topk_weight_TK[token, slot, None])
    y_TD = out_TKD[:, 0]
    for j in range(1, K):
        y_TD = y_TD + out_TKD[:, j]
    return y_TD.to(x_TD.dtype)


class Expert(nn.Module):
    """Expert e of an `Experts` as a module of its own, what iterating the Experts gives (the masked
    reference loop of the user's acceptance test iterates and calls these): forward(x [..., D]) ->
    [..., D] the SwiGLU FFN on views into the stacked weights, so gradients flow into them;
    parameters() yields the views gate [F, D], up [F, D], down [D, F]. It holds no parameter of its
    own: the weights stay the stack's (train, clip or freeze the stack, `Experts.parameters()`: the
    views are no leaves)."""

    def __init__(self, experts, index):
        super().__init__()
        object.__setattr__(self, "stack", experts)  # a plain attribute, not a submodule
        self.index = index

    def weights(self):
        w_gate_up_2FD, F_ = self.stack.gate_up_proj[self.index], self.stack.down_proj.shape[2]
        return w_gate_up_2FD[:F_], w_gate_up_2FD[F_:], self.stack.down_proj[self.index]

    def parameters(self, recurse=True):
        return iter(self.weights())

    def forward(self, x):
        return swiglu(x, *self.weights())

    def extra_repr(self):
        return f"index={self.index}"


class Experts(nn.Module):
    """The routed experts: E SwiGLU FFNs with their weights stacked (as torchtitan and transformers
    5 keep them), gate_up_proj [E, 2F, D] (each expert's gate_proj rows, then its up_proj rows;
    nn.Linear layout) and down_proj [E, D, F], and `engine`, the function that runs them, chosen
    when the model is built (model/engines.py: Engines.experts; `expert_loop` by default). Every
    engine reads the stacked tensors as they are: no per-expert copy, concatenation or stack of
    weights.

    forward(rows_PD [P, D], tokens_per_expert int64 [E'], row_weight_P [P] or None) -> [P, D]: the
    stack's experts (E' = all, or under expert parallelism the rank's) on their rows in order, as
    `expert_loop` documents. Under expert parallelism (train/parallel.py) the stacked weights are
    DTensors sharded on the expert dimension and the engine reads this rank's shard. Iterated, it
    gives one `Expert` module per expert (global ids). state_dict: one entry per expert and
    projection, `{e}.{gate,up,down}_proj.weight` (views into the stack): the keys of E separate
    FeedForward modules (HF's layout); `stacked_names()` keeps the stacked ones (checkpoints);
    load_state_dict takes either. Initialised as E FeedForwards would be (the same draws, in the
    same order)."""

    def __init__(self, num_experts, hidden_size, intermediate_size, engine=expert_loop):
        super().__init__()
        E, D, F_ = num_experts, hidden_size, intermediate_size
        self.engine = engine
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * F_, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, F_))
        # nn.Linear's own init
        self.reset_each(lambda w: nn.init.kaiming_uniform_(w, a=math.sqrt(5)))
        self.register_state_dict_post_hook(_per_expert_state_dict)
        self.register_load_state_dict_pre_hook(_stacked_state_dict)

    def __len__(self):
        return self.gate_up_proj.shape[0]

    def __iter__(self):
        return (Expert(self, e) for e in range(len(self)))

    @torch.no_grad()
    def reset_each(self, init):
        """init(weight) on each expert's gate, up and down weight view in turn (FeedForward's
        order)."""
        for expert in self:
            for w in expert.weights():
                init(w)

    def forward(self, rows_PD, tokens_per_expert, row_weight_P=None):
        return self.engine(rows_PD, tokens_per_expert, row_weight_P, local_shard(self.gate_up_proj),
                           local_shard(self.down_proj))

    def extra_repr(self):
        (E, F2, D) = self.gate_up_proj.shape
        return f"{E} x SwiGLU({D} -> {F2 // 2} -> {D}), engine={self.engine.__name__}"


def local_shard(weight):
    """This rank's part of a weight sharded over ranks (under expert parallelism a DTensor: the
    rank's experts), else the weight itself."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


_names = threading.local()


@contextlib.contextmanager
def stacked_names():
    """Within, every Experts' state_dict keeps its stacked tensors (`gate_up_proj`, `down_proj`)
    under their own names: what checkpoints hold (train/checkpoint.py)."""
    _names.stacked = True
    try:
        yield
    finally:
        _names.stacked = False


PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def per_expert_entries(experts, prefix=""):
    """(state_dict key, stacked parameter's name, index into it) of each expert's gate, up and down
    weight, in E FeedForward modules' order: how the stack stands for them (state_dict)."""
    F_ = experts.down_proj.shape[2]
    for e in range(len(experts)):
        where = (("gate_up_proj", (e, slice(None, F_))), ("gate_up_proj", (e, slice(F_, None))),
                 ("down_proj", (e,)))
        for projection, (name, index) in zip(PROJECTIONS, where):
            yield f"{prefix}{e}.{projection}.weight", name, index


def _per_expert_state_dict(module, state_dict, prefix, local_metadata):
    """Experts' state_dict hook: the stacked tensors -> one view per expert and projection (not
    within `stacked_names`)."""
    if getattr(_names, "stacked", False):
        return
    stacked = {name: state_dict.pop(prefix + name) for name in ("gate_up_proj", "down_proj")}
    for key, name, index in per_expert_entries(module, prefix):
        state_dict[key] = stacked[name][index]


def _stacked_state_dict(module, state_dict, prefix, local_metadata, strict, missing_keys,
                        unexpected_keys, error_msgs):
    """Experts' load_state_dict pre-hook: per-expert entries -> the stacked tensors, each entry
    copied into its place: in a new stack of the entries' (promoted) dtype when all are given and
    fit (what assign=True takes), else in a copy of the current one. A misshapen entry is a
    size-mismatch error naming its key (the others load into the copy, as torch loads the tensors
    that fit); absent experts' keys are reported missing (strict: an error): their weights stay."""
    current = {name: getattr(module, name) for name in ("gate_up_proj", "down_proj")}
    # key -> (its entry, the shape the entry must have)
    given = {key: (state_dict.pop(key), current[name][index].shape)
             for key, name, index in per_expert_entries(module, prefix) if key in state_dict}
    if not given:
        return  # (the stacked tensors themselves, or nothing of this module)
    whole = len(given) == 3 * len(module) and all(t.shape == must for t, must in given.values())
    # the entries' promoted dtype, as torch.cat would give
    dtype = functools.reduce(torch.promote_types, [t.dtype for t, _ in given.values()])
    device = next(iter(given.values()))[0].device
    stacked = {name: (torch.empty(t.shape, dtype=dtype, device=device) if whole
                      else t.detach().clone()) for name, t in current.items()}
    for key, name, index in per_expert_entries(module, prefix):
        if key not in given:
            missing_keys.append(key)
            continue
        tensor, shape = given[key]
        if tensor.shape != shape:
            error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                              f"{tuple(tensor.shape)} from checkpoint, the shape in current model "
                              f"is {tuple(shape)}.")
        else:
            stacked[name][index].copy_(tensor)
    for name, value in stacked.items():
        state_dict[prefix + name] = value


@dataclass
class MoEStats:
    """The last forward (`layer.stats`): tokens_per_expert int64 [E] routed pairs per expert after
    padding and capacity drops (on the device; under EP this rank's tokens);
    padded_tokens_per_expert rows per expert incl. padding rows, None without padding; balance_loss,
    z_loss (None in eval / when off)."""
    tokens_per_expert: torch.Tensor | None = None
    padded_tokens_per_expert: torch.Tensor | None = None
    balance_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None


class MOEFeedForward(nn.Module):
    """Top-k softmax-routed mixture of SwiGLU experts (MiniMind / Qwen3-MoE).

    forward(x [B, S, D], token_mask [B, S] bool or None) -> y [B, S, D] of x's dtype. token_mask
    False marks padding: it goes to no expert (output 0) and counts in no router statistic. After a
    training-mode call `aux_loss` is this layer's balance loss plus z-loss (zero in eval) and
    `stats` an MoEStats. Parameters: `gate.weight` [E, D], the stacked `experts.gate_up_proj`
    [E, 2F, D] and `experts.down_proj` [E, D, F] (state_dict:
    `experts.{e}.{gate,up,down}_proj.weight`; see Experts), with n_shared_experts > 0
    `shared_experts.{gate,up,down}_proj.weight` (one dense SwiGLU of width
    shared_expert_intermediate_size added for every token, ungated: DeepSeekMoE), and the fp32
    buffer `expert_bias` [E] only with router_bias_update_rate > 0. In training every expert runs,
    maybe on no rows, so idle experts get a zero gradient (DDP with find_unused_parameters=False
    needs it).
    The router's choices per expert (real tokens, before capacity) add up until `pop_load()`.
    """

    def __init__(self, config, experts=expert_loop, movers=PLAIN_MOVERS, linear=nn.Linear):
        super().__init__()
        self.config = config
        E = config.num_experts
        self.gate = nn.Linear(config.hidden_size, E, bias=False)
        self.experts = Experts(E, config.hidden_size, config.moe_intermediate_size, experts)
        self.shared_experts = (FeedForward(config.hidden_size,
                                           config.shared_expert_intermediate_size, linear)
                               if config.n_shared_experts else None)
        if config.router_bias_update_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.dispatcher = (RowMapDispatcher(E, movers) if config.moe_impl == "fused"
                           else SortedDispatcher(E))
        self.aux_loss = torch.zeros((), device="cpu")  # (a real zero even in a model built on meta)
        self.stats = MoEStats()
        self._load_E = None  # router choices per expert since the last pop_load()

    def forward(self, x, token_mask=None):
        B, S, D = x.shape
        x_TD = x.reshape(-1, D)
        token_mask_T = (None if token_mask is None
                        else token_mask.reshape(-1).to(device=x.device, dtype=torch.bool))
        topk_idx_TK, topk_weight_TK, balance_loss, z_loss = self.route(x_TD, token_mask_T, B)
        topk_idx_TK, layout = drop_and_pad(self.config, topk_idx_TK, topk_weight_TK, token_mask_T)
        if self.decodes(x_TD, layout):
            y_TD = routed_loop(x_TD, topk_idx_TK, topk_weight_TK, self.experts.gate_up_proj,
                               self.experts.down_proj, self.config.moe_impl == "fused")
            self.stats = MoEStats(tokens_per_expert(topk_idx_TK, self.config.num_experts), None,
                                  balance_loss, z_loss)
        else:
            dispatched = self.dispatcher.dispatch(x_TD, topk_idx_TK, topk_weight_TK, layout)
            rows_out_PD = self.experts(dispatched.rows_PD, dispatched.tokens_per_expert,
                                       dispatched.row_weight_P)
            y_TD = self.dispatcher.combine(rows_out_PD, dispatched)
            self.stats = MoEStats(dispatched.routed_E,
                                  dispatched.tokens_per_expert if dispatched.padded else None,
                                  balance_loss, z_loss)
        # every token, padding too (its output is never trained on)
        if self.shared_experts is not None:
            y_TD = y_TD + self.shared_experts(x_TD).to(y_TD.dtype)
        return y_TD.view(B, S, D)

    def decodes(self, x_TD, layout):
        """Whether this call takes `routed_loop`: at most DECODE_TOKENS tokens on the CPU outside
        autograd (a decode step), a local dispatcher (not expert parallelism's), no padding rows."""
        return (x_TD.shape[0] <= DECODE_TOKENS and x_TD.device.type == "cpu"
                and not torch.is_grad_enabled() and not layout.pads
                and isinstance(self.dispatcher, (SortedDispatcher, RowMapDispatcher)))

    def extra_repr(self):
        local = isinstance(self.dispatcher, (SortedDispatcher, RowMapDispatcher))
        return (f"moe_impl={self.config.moe_impl}, dispatcher={self.dispatcher!r}"
                + (f", decode=routed_loop up to {DECODE_TOKENS} tokens on CPU" if local else ""))

    def router_logits(self, x_TD):
        """Gate logits [T, E]: in autocast's dtype (the reference), or fp32 with
        router_dtype="float32" (Megatron-LM's moe_router_dtype: bf16 logits can flip near-tied top-k
        choices)."""
        if self.config.router_dtype == "float32":
            with torch.autocast(x_TD.device.type, enabled=False):
                return F.linear(x_TD.float(), self.gate.weight.float())
        return self.gate(x_TD)

    def route(self, x_TD, token_mask_T=None, num_sequences=1):
        """Softmax over the gate logits, top-k, optional renormalisation; in training also the
        router losses (into self.aux_loss) and the load. With aux-loss-free balancing the top-k
        choice uses scores + expert_bias and the weights are the unbiased scores of the chosen
        experts. Returns topk_idx_TK int64 [T, K] (unordered), topk_weight_TK [T, K] (the scores'
        dtype), balance_loss, z_loss."""
        logits_TE = self.router_logits(x_TD)
        scores_TE = F.softmax(logits_TE, dim=-1)
        K = self.config.num_experts_per_tok
        if self.expert_bias is None:
            topk_weight_TK, topk_idx_TK = torch.topk(scores_TE, k=K, dim=-1, sorted=False)
        else:
            _, topk_idx_TK = torch.topk(scores_TE.float() + self.expert_bias, k=K,
                                        dim=-1, sorted=False)
            topk_weight_TK = scores_TE.gather(-1, topk_idx_TK)
        if self.config.norm_topk_prob:
            topk_weight_TK = topk_weight_TK / (topk_weight_TK.sum(dim=-1, keepdim=True) + 1e-20)
        if self.config.routed_scaling_factor != 1.0:
            topk_weight_TK = topk_weight_TK * self.config.routed_scaling_factor
        balance_loss = z_loss = None
        if self.training and x_TD.shape[0] > 0:
            self._warn_if_router_gets_no_lm_gradient()
            balance_loss, z_loss = router_losses(self.config, logits_TE, scores_TE, topk_idx_TK,
                                                 token_mask_T, num_sequences)
            with torch.no_grad():
                load_E = tokens_per_expert(topk_idx_TK, self.config.num_experts, token_mask_T)
                self._load_E = load_E if self._load_E is None else self._load_E + load_E
        aux_loss = (balance_loss if balance_loss is not None
                    else scores_TE.new_zeros((), dtype=torch.float32))
        self.aux_loss = aux_loss if z_loss is None else aux_loss + z_loss
        return topk_idx_TK, topk_weight_TK, balance_loss, z_loss

    def pop_load(self):
        """Router choices per expert (int64 [E]) summed since the last call, then reset; None if
        none."""
        load, self._load_E = self._load_E, None
        return load

    @torch.no_grad()
    def update_expert_bias(self, load_E):
        """Aux-loss-free balancing after an optimizer step (load_E: the step's pairs per expert, all
        ranks)."""
        if self.expert_bias is not None:
            expert_bias_update(self.expert_bias, load_E.to(self.expert_bias.device),
                               self.config.router_bias_update_rate)

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            # the bias stays fp32 under .half() / .bfloat16()
            self.expert_bias = self.expert_bias.float()
        return out

    # deepcopy / pickle: leave out the last forward's results (not graph leaves)
    def __getstate__(self):
        return {**super().__getstate__(), "aux_loss": torch.zeros(()), "stats": MoEStats(),
                "_load_E": None}

    def _warn_if_router_gets_no_lm_gradient(self):
        global _warned_no_router_grad
        if (self.config.num_experts_per_tok == 1 and self.config.norm_topk_prob
                and not _warned_no_router_grad):
            _warned_no_router_grad = True
            warnings.warn("MoE with num_experts_per_tok=1 and norm_topk_prob=True: every combine "
                          "weight is exactly 1, so the router gets no gradient from the "
                          "language-model loss (only from the aux / z losses). "
                          "Set norm_topk_prob=False or use k >= 2.", stacklevel=4)
