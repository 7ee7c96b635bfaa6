"""The mixture-of-experts layer: route -> capacity / padding policy -> dispatch -> experts -> combine.

Shape legend: B batch, S sequence, T = B*S tokens, D hidden size, E experts, K experts per token (top-k),
F expert intermediate size, N = T*K routed (token, slot) pairs, P dispatched rows.

    1. route     (this file, model/router.py) softmax router, top-k; router losses and load counting
    2. capacity / padding policy (model/dispatch.py: drop_and_pad) padding tokens and over-capacity
                 pairs go to no expert (-1); how each expert's rows are padded
    3. dispatch  (model/dispatch.py) rows grouped by expert        self.dispatcher.dispatch
    4. experts   (model/experts.py)  E SwiGLU FFNs on their rows   self.experts
    5. combine   (model/dispatch.py) each token's weighted sum     self.dispatcher.combine

`moe_impl="sorted"` (default) pairs the SortedDispatcher with the per-expert loop: one host sync per layer,
bitwise the per-expert masked loop (MiniMind's original layer: `masked_expert_loop` below, with MiniMind's
routing in `scripts/moe_reference.py`).
`moe_impl="fused"` pairs the RowMapDispatcher with grouped GEMMs (or, on CPU, the oneDNN expert chains):
no host sync, equal up to rounding. `moe_impl="masked"` runs steps 3-5 as that masked loop
(`masked_expert_loop`, 3 host syncs per expert; for baselines and benchmarks only), with the same routing,
router losses, load telemetry and capacity / padding-token policy as the others. Expert parallelism
replaces `self.dispatcher` (train/expert_parallel.py).
"""
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.dispatch import RowMapDispatcher, SortedDispatcher, drop_and_pad
from model.experts import FeedForward, SwiGLUExperts  # noqa: F401  (FeedForward: re-exported)
from model.router import expert_bias_update, router_losses, tokens_per_expert

_warned_no_router_grad = False  # the k=1 warning below is given once per process


@dataclass
class MoEStats:
    """What the last forward of an MOEFeedForward saw (`layer.stats`), for tests and telemetry.

    tokens_per_expert: int64 [E] routed (token, slot) pairs per expert after padding masking and capacity
        dropping, on the layer's device (under expert parallelism: this rank's tokens, global expert ids).
    padded_tokens_per_expert: int64 rows each expert ran on, padding rows included ([E]; under expert
        parallelism the rank's own experts); None without padding. On the host for the sorted path.
    balance_loss, z_loss: this layer's router losses (scalars; None in eval or when off); the layer's
        `aux_loss` is their sum.
    """
    tokens_per_expert: torch.Tensor | None = None
    padded_tokens_per_expert: torch.Tensor | None = None
    balance_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None


class MOEFeedForward(nn.Module):
    """Top-k softmax-routed mixture of SwiGLU experts (MiniMind / Qwen3-MoE style).

    forward(x [B, S, D] float, token_mask [B, S] bool or None) -> y [B, S, D] of x's dtype. token_mask marks
    padding (False): padded positions go to no expert (their output is 0) and count in no router
    statistic. After a training-mode call `self.aux_loss` holds the router loss of this layer: the
    balance loss of type `router_aux_loss_type` plus the z-loss (a scalar; zero in eval). `self.stats`
    (MoEStats) describes the last call.

    Parameters and state_dict keys: `gate.weight` [E, D] and `experts.{e}.{gate,up,down}_proj.weight`,
    plus the buffer `expert_bias` [E] fp32 only when aux-loss-free balancing is on
    (router_bias_update_rate > 0). In training every expert runs, possibly on no rows, so experts that got
    no tokens still get a (zero) gradient, as DistributedDataParallel(find_unused_parameters=False)
    requires. In eval the sorted path skips them and their grads stay None.

    Components (public attributes): `dispatcher` (SortedDispatcher or RowMapDispatcher, by
    config.moe_impl; its `permute_backend` for the row-map one) and `experts` (SwiGLUExperts: `impl`
    "loop" for sorted and masked, "auto" for fused, and `gemm_backend`).

    Load telemetry: in training the router's choices per expert (real tokens only, before capacity
    dropping) are summed until `pop_load()` hands them over (train/ does, once per step).
    """

    def __init__(self, config):
        super().__init__()
        self.config = config
        E, fused = config.num_experts, config.moe_impl == "fused"
        self.gate = nn.Linear(config.hidden_size, E, bias=False)
        self.experts = SwiGLUExperts((FeedForward(config.hidden_size, config.moe_intermediate_size) for _ in range(E)),
                                     impl="auto" if fused else "loop")
        if config.router_bias_update_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.dispatcher = RowMapDispatcher(E) if fused else SortedDispatcher(E)
        self.aux_loss = torch.zeros(())
        self.stats = MoEStats()
        self._load_E = None  # router choices per expert since the last pop_load()

    def forward(self, x, token_mask=None):
        B, S, D = x.shape
        x_TD = x.reshape(-1, D)
        token_mask_T = None if token_mask is None else token_mask.reshape(-1).to(device=x.device, dtype=torch.bool)
        if x_TD.shape[0] == 0 and not self.training:  # no token: an empty output still tied to x's graph
            self.aux_loss, self.stats = x.new_zeros((), dtype=torch.float32), MoEStats()
            return x.clone()
        # 1. route (+ router losses and load)
        topk_idx_TK, topk_weight_TK, balance_loss, z_loss = self._route_and_account(x_TD, token_mask_T, B)
        # 2. capacity / padding policy: padding tokens and pairs over capacity go to no expert (-1)
        topk_idx_TK, layout = drop_and_pad(self.config, topk_idx_TK, topk_weight_TK, token_mask_T)
        if self.config.moe_impl == "masked":  # 3-5 as MiniMind's loop; row padding is the grouped paths' layout
            y_TD = masked_expert_loop(self.experts, x_TD, topk_idx_TK, topk_weight_TK, self.training)
            load_E = tokens_per_expert(topk_idx_TK, self.config.num_experts)
            self.stats = MoEStats(load_E, None, balance_loss, z_loss)
            return y_TD.view(B, S, D)
        # 3. dispatch (the CPU expert chains gather their own rows: then nothing is permuted)
        permute = not self.experts.gathers_own_rows(x_TD)
        rows, rows_per_expert, handle = self.dispatcher.dispatch(x_TD, topk_idx_TK, topk_weight_TK, layout, permute)
        # 4. experts
        rows = self.experts(rows, rows_per_expert, handle)
        # 5. combine
        y_TD = self.dispatcher.combine(rows, handle)
        self.stats = MoEStats(handle.tokens_per_expert_E, handle.padded_tokens_per_expert_E, balance_loss, z_loss)
        return y_TD.view(B, S, D)

    def router_logits(self, x_TD):
        """Gate logits [T, E]: in autocast's dtype (the reference), or fp32 with router_dtype="float32"
        (Megatron-LM's moe_router_dtype: bf16 logits can flip near-tied top-k choices)."""
        if self.config.router_dtype == "float32":
            with torch.autocast(x_TD.device.type, enabled=False):
                return F.linear(x_TD.float(), self.gate.weight.float())
        return self.gate(x_TD)

    def route(self, x_TD, logits_TE=None):
        """Router: softmax over expert logits, top-k, optional renormalisation.

        Runs in whatever dtype autocast gives the gate (bf16 logits, fp32 softmax under bf16 autocast),
        exactly as the reference, unless router_dtype="float32". With aux-loss-free balancing the top-k
        choice uses scores + expert_bias, and the weights are the unbiased scores of the chosen experts.
        Args: x_TD [T, D]; logits_TE: the gate logits if already computed. Returns scores_TE [T, E],
        topk_weight_TK [T, K] (scores' dtype), topk_idx_TK int64 [T, K] (unordered).
        """
        scores_TE = F.softmax(self.router_logits(x_TD) if logits_TE is None else logits_TE, dim=-1)
        K = self.config.num_experts_per_tok
        if self.expert_bias is None:
            topk_weight_TK, topk_idx_TK = torch.topk(scores_TE, k=K, dim=-1, sorted=False)
        else:
            _, topk_idx_TK = torch.topk(scores_TE.float() + self.expert_bias, k=K, dim=-1, sorted=False)
            topk_weight_TK = scores_TE.gather(-1, topk_idx_TK)
        if self.config.norm_topk_prob:
            topk_weight_TK = topk_weight_TK / (topk_weight_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return scores_TE, topk_weight_TK, topk_idx_TK

    def _route_and_account(self, x_TD, token_mask_T, num_sequences):
        """Route, and in training compute the router losses (into self.aux_loss) and add the load.
        Returns topk_idx_TK, topk_weight_TK, balance_loss, z_loss (the losses None in eval / when off)."""
        logits_TE = self.router_logits(x_TD)
        scores_TE, topk_weight_TK, topk_idx_TK = self.route(x_TD, logits_TE)
        balance_loss = z_loss = None
        if self.training and x_TD.shape[0] > 0:
            self._warn_if_router_gets_no_lm_gradient()
            balance_loss, z_loss = router_losses(self.config, logits_TE, scores_TE, topk_idx_TK, token_mask_T,
                                                 num_sequences)
            with torch.no_grad():
                load_E = tokens_per_expert(topk_idx_TK, self.config.num_experts, token_mask_T)
                self._load_E = load_E if self._load_E is None else self._load_E + load_E
        aux_loss = balance_loss if balance_loss is not None else scores_TE.new_zeros(())
        self.aux_loss = aux_loss if z_loss is None else aux_loss + z_loss
        return topk_idx_TK, topk_weight_TK, balance_loss, z_loss

    def pop_load(self):
        """Router choices per expert (int64 [E], real tokens only, before capacity dropping) summed over
        the training-mode calls since the last call, then reset; None if there were none."""
        load, self._load_E = self._load_E, None
        return load

    @torch.no_grad()
    def update_expert_bias(self, load_E):
        """Aux-loss-free balancing after an optimizer step: bias += rate * sign(mean load - load).
        load_E: the step's pairs per expert over all data-parallel ranks (train/ sums them)."""
        if self.expert_bias is not None:
            expert_bias_update(self.expert_bias, load_E.to(self.expert_bias.device),
                               self.config.router_bias_update_rate)

    def pack_expert_weights(self):
        """Lay the expert weights out back to back for the grouped / chain experts (model.experts)."""
        self.experts.pack_weights()

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()  # the bias stays fp32 under .half() / .bfloat16()
        return out

    def __getstate__(self):
        # deepcopy / pickle: leave out the last forward's results (its losses are not graph leaves)
        state = dict(super().__getstate__())
        state.update(aux_loss=torch.zeros(()), stats=MoEStats(), _load_E=None)
        return state

    def _warn_if_router_gets_no_lm_gradient(self):
        global _warned_no_router_grad
        if self.config.num_experts_per_tok == 1 and self.config.norm_topk_prob and not _warned_no_router_grad:
            _warned_no_router_grad = True
            warnings.warn("MoE with num_experts_per_tok=1 and norm_topk_prob=True: every combine weight is "
                          "exactly 1, so the router gets no gradient from the language-model loss (only from "
                          "the aux / z losses). Set norm_topk_prob=False or use k >= 2.", stacklevel=4)


def masked_expert_loop(experts, x_TD, topk_idx_TK, topk_weight_TK, training):
    """The per-expert masked loop that sorted dispatch replaced (MiniMind's original layer): steps 3-5 of
    the layer, the bitwise reference of moe_impl="sorted". For each expert it asks the device three
    questions whose answers come back to the host (`mask.any()`, the length of `nonzero()`, the length of the
    boolean-mask gather): 3 syncs per expert.

    Args: experts (iterable of E SwiGLU FFNs), x_TD [T, D], topk_idx_TK int64 [T, K] in [-1, E) (-1: no
    expert), topk_weight_TK [T, K], training (keep idle experts in the graph). Returns y_TD [T, D] of x's dtype.
    """
    y_TD = torch.zeros_like(x_TD)
    for e, expert in enumerate(experts):
        mask_TK = topk_idx_TK == e
        if mask_TK.any():
            token_idx = mask_TK.any(dim=-1).nonzero().flatten()
            weight = topk_weight_TK[mask_TK].view(-1, 1)  # (a token holds expert e in at most one slot)
            y_TD.index_add_(0, token_idx, (expert(x_TD[token_idx]) * weight).to(y_TD.dtype))
        elif training:  # keep the idle expert in the autograd graph with a zero gradient (DDP needs every grad)
            y_TD[:1, :1] += 0 * sum(p.sum() for p in expert.parameters())  # (an empty slice when T = 0)
    return y_TD
