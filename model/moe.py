"""The mixture-of-experts feed-forward: route -> capacity policy -> dispatch -> experts -> combine.

Shape legend: B batch, S sequence, T = B*S tokens, D hidden size, E experts, K experts per token (top-k),
F expert intermediate size, P dispatched rows.

    1. route     (here; losses in model/router.py) softmax router, top-k, router losses, load counting
    2. capacity  (model/dispatch.py: drop_and_pad) padding tokens and over-capacity pairs go to no expert
    3. dispatch  (model/dispatch.py) rows grouped by expert                self.dispatcher.dispatch
    4. experts   (here: ExpertLoop) E SwiGLU FFNs, each on its rows        self.experts
    5. combine   (model/dispatch.py) each token's weighted sum of its rows self.dispatcher.combine

moe_impl "sorted" (the default) is bitwise the per-expert masked loop (MiniMind's layer, kept as the
reference in scripts/moe_reference.py) with one host sync per layer; "fused" builds the layout on the
device (no host sync) and applies the routing weights inside the experts.
The engines of steps 3-5 are chosen when the layer is built: `experts` (ExpertLoop here, one nn.Linear
chain per expert; kernels/experts.py: GroupedExperts) and the fused path's dispatcher (RowMapDispatcher,
or kernels/permute.py's); model/engines.py names them, kernels/engines.py picks the ones that pay.
Expert parallelism wraps the dispatcher (train/parallel.py).
"""
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.dispatch import RowMapDispatcher, SortedDispatcher, drop_and_pad
from model.router import expert_bias_update, router_losses, tokens_per_expert

_warned_no_router_grad = False  # the k=1 warning below is given once per process


class FeedForward(nn.Module):
    """SwiGLU FFN: down(silu(gate(x)) * up(x)). x [..., D] -> [..., D]. Names match HF (`gate_proj`...).
    linear: the class of its three bias-free projections (nn.Linear or a subclass, e.g. kernels' oneDNN one)."""

    def __init__(self, hidden_size: int, intermediate_size: int, linear=nn.Linear):
        super().__init__()
        self.gate_proj = linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ExpertLoop(nn.ModuleList):
    """The routed experts: a list of FeedForward modules (`experts.{e}.{gate,up,down}_proj.weight`) and
    the plain engine that runs them, one nn.Linear chain per expert.

    forward(rows_PD [P, D], tokens_per_expert int64 [E'] (a CPU tensor, or on the device: then read to the
    host once), row_weight_P [P] or None, first_expert=0) -> [P, D]: expert first_expert + e on its
    tokens_per_expert[e] rows, in order (E' = all experts, or under expert parallelism the rank's); each
    row scaled by row_weight_P (when given) before the down projection. Each expert runs on a fresh copy
    of its rows (a view at an offset may round differently in the GEMM, and the sorted path must match the
    masked loop's gathers bit for bit). In eval an expert without rows is skipped; in training it runs on
    zero rows, so it gets a zero gradient (DDP needs every gradient)."""

    def forward(self, rows_PD, tokens_per_expert, row_weight_P=None, first_expert=0):
        outs, start = [], 0
        for e, n in enumerate(tokens_per_expert.tolist()):
            expert = self[first_expert + e]
            if n == 0 and not self.training:
                continue
            x_e = rows_PD[start:start + n].clone()
            if row_weight_P is None:
                outs.append(expert(x_e))
            else:  # the routing weight before the down projection (linear: the same sum up to rounding)
                h_nF = F.silu(expert.gate_proj(x_e)) * expert.up_proj(x_e)
                outs.append(expert.down_proj(h_nF * row_weight_P[start:start + n, None].to(h_nF.dtype)))
            start += n
        return torch.cat(outs) if outs else rows_PD[:0].clone()


@dataclass
class MoEStats:
    """The last forward (`layer.stats`): tokens_per_expert int64 [E] routed pairs per expert after
    padding and capacity drops (on the device; under EP this rank's tokens); padded_tokens_per_expert rows
    per expert incl. padding rows, None without padding; balance_loss, z_loss (None in eval / when off)."""
    tokens_per_expert: torch.Tensor | None = None
    padded_tokens_per_expert: torch.Tensor | None = None
    balance_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None


class MOEFeedForward(nn.Module):
    """Top-k softmax-routed mixture of SwiGLU experts (MiniMind / Qwen3-MoE).

    forward(x [B, S, D], token_mask [B, S] bool or None) -> y [B, S, D] of x's dtype. token_mask False
    marks padding: it goes to no expert (output 0) and counts in no router statistic. After a
    training-mode call `aux_loss` is this layer's balance loss plus z-loss (zero in eval) and `stats` an
    MoEStats. Parameters: `gate.weight` [E, D], `experts.{e}.{gate,up,down}_proj.weight`, with
    n_shared_experts > 0 `shared_experts.{gate,up,down}_proj.weight` (one dense SwiGLU of width
    shared_expert_intermediate_size added for every token, ungated: DeepSeekMoE), and the fp32
    buffer `expert_bias` [E] only with router_bias_update_rate > 0. In training every expert runs, maybe
    on no rows, so idle experts get a zero gradient (DDP with find_unused_parameters=False needs it).
    The router's choices per expert (real tokens, before capacity) add up until `pop_load()`.
    """

    def __init__(self, config, experts=ExpertLoop, row_map_dispatcher=RowMapDispatcher, linear=nn.Linear):
        super().__init__()
        self.config = config
        E = config.num_experts
        self.gate = nn.Linear(config.hidden_size, E, bias=False)
        self.experts = experts(FeedForward(config.hidden_size, config.moe_intermediate_size) for _ in range(E))
        self.shared_experts = FeedForward(config.hidden_size, config.shared_expert_intermediate_size, linear) \
            if config.n_shared_experts else None
        if config.router_bias_update_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.dispatcher = row_map_dispatcher(E) if config.moe_impl == "fused" else SortedDispatcher(E)
        self.aux_loss = torch.zeros(())
        self.stats = MoEStats()
        self._load_E = None  # router choices per expert since the last pop_load()

    def forward(self, x, token_mask=None):
        B, S, D = x.shape
        x_TD = x.reshape(-1, D)
        token_mask_T = None if token_mask is None else token_mask.reshape(-1).to(device=x.device, dtype=torch.bool)
        topk_idx_TK, topk_weight_TK, balance_loss, z_loss = self.route(x_TD, token_mask_T, B)
        topk_idx_TK, layout = drop_and_pad(self.config, topk_idx_TK, topk_weight_TK, token_mask_T)
        dispatched = self.dispatcher.dispatch(x_TD, topk_idx_TK, topk_weight_TK, layout)
        rows_out_PD = self.experts(dispatched.rows_PD, dispatched.tokens_per_expert, dispatched.row_weight_P,
                                   dispatched.first_expert)
        y_TD = self.dispatcher.combine(rows_out_PD, dispatched)
        self.stats = MoEStats(dispatched.routed_E, dispatched.tokens_per_expert if dispatched.padded else None,
                              balance_loss, z_loss)
        if self.shared_experts is not None:  # every token, padding too (its output is never trained on)
            y_TD = y_TD + self.shared_experts(x_TD).to(y_TD.dtype)
        return y_TD.view(B, S, D)

    def extra_repr(self):
        return f"moe_impl={self.config.moe_impl}, dispatcher={type(self.dispatcher).__name__}"

    def router_logits(self, x_TD):
        """Gate logits [T, E]: in autocast's dtype (the reference), or fp32 with router_dtype="float32"
        (Megatron-LM's moe_router_dtype: bf16 logits can flip near-tied top-k choices)."""
        if self.config.router_dtype == "float32":
            with torch.autocast(x_TD.device.type, enabled=False):
                return F.linear(x_TD.float(), self.gate.weight.float())
        return self.gate(x_TD)

    def route(self, x_TD, token_mask_T=None, num_sequences=1):
        """Softmax over the gate logits, top-k, optional renormalisation; in training also the router losses
        (into self.aux_loss) and the load. With aux-loss-free balancing the top-k choice uses scores +
        expert_bias and the weights are the unbiased scores of the chosen experts. Returns topk_idx_TK
        int64 [T, K] (unordered), topk_weight_TK [T, K] (the scores' dtype), balance_loss, z_loss."""
        logits_TE = self.router_logits(x_TD)
        scores_TE = F.softmax(logits_TE, dim=-1)
        K = self.config.num_experts_per_tok
        if self.expert_bias is None:
            topk_weight_TK, topk_idx_TK = torch.topk(scores_TE, k=K, dim=-1, sorted=False)
        else:
            _, topk_idx_TK = torch.topk(scores_TE.float() + self.expert_bias, k=K, dim=-1, sorted=False)
            topk_weight_TK = scores_TE.gather(-1, topk_idx_TK)
        if self.config.norm_topk_prob:
            topk_weight_TK = topk_weight_TK / (topk_weight_TK.sum(dim=-1, keepdim=True) + 1e-20)
        if self.config.routed_scaling_factor != 1.0:
            topk_weight_TK = topk_weight_TK * self.config.routed_scaling_factor
        balance_loss = z_loss = None
        if self.training and x_TD.shape[0] > 0:
            self._warn_if_router_gets_no_lm_gradient()
            balance_loss, z_loss = router_losses(self.config, logits_TE, scores_TE, topk_idx_TK, token_mask_T,
                                                 num_sequences)
            with torch.no_grad():
                load_E = tokens_per_expert(topk_idx_TK, self.config.num_experts, token_mask_T)
                self._load_E = load_E if self._load_E is None else self._load_E + load_E
        aux_loss = balance_loss if balance_loss is not None else scores_TE.new_zeros((), dtype=torch.float32)
        self.aux_loss = aux_loss if z_loss is None else aux_loss + z_loss
        return topk_idx_TK, topk_weight_TK, balance_loss, z_loss

    def pop_load(self):
        """Router choices per expert (int64 [E]) summed since the last call, then reset; None if none."""
        load, self._load_E = self._load_E, None
        return load

    @torch.no_grad()
    def update_expert_bias(self, load_E):
        """Aux-loss-free balancing after an optimizer step (load_E: the step's pairs per expert, all ranks)."""
        if self.expert_bias is not None:
            expert_bias_update(self.expert_bias, load_E.to(self.expert_bias.device), self.config.router_bias_update_rate)

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()  # the bias stays fp32 under .half() / .bfloat16()
        return out

    def __getstate__(self):  # deepcopy / pickle: leave out the last forward's results (not graph leaves)
        return {**super().__getstate__(), "aux_loss": torch.zeros(()), "stats": MoEStats(), "_load_E": None}

    def _warn_if_router_gets_no_lm_gradient(self):
        global _warned_no_router_grad
        if self.config.num_experts_per_tok == 1 and self.config.norm_topk_prob and not _warned_no_router_grad:
            _warned_no_router_grad = True
            warnings.warn("MoE with num_experts_per_tok=1 and norm_topk_prob=True: every combine weight is "
                          "exactly 1, so the router gets no gradient from the language-model loss (only from "
                          "the aux / z losses). Set norm_topk_prob=False or use k >= 2.", stacklevel=4)
