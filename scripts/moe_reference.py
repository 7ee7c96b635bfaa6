"""The masked per-expert MoE loop that the sorted layer replaced (MiniMind's layer), kept as the bitwise
reference of `moe_impl="sorted"`: tests and the benchmarks' masked rows compare `MOEFeedForward` with it.

For every expert the loop asks the device three questions whose answers must come back to the host
(`mask.any()`, the length of `nonzero()`, the length of the boolean-mask gather): 3E syncs a layer, plus
the router's own.

    reference_masked_forward(mod, x)   MiniMind's routing (softmax, top-k, renormalisation), then the loop
    masked_layer_forward(mod, x, mask) the layer's own routing, capacity policy and shared experts (every
                                       MOEFeedForward option), then the loop; sets aux_loss and stats
"""
import torch
import torch.nn.functional as F

from model.dispatch import drop_and_pad  # (importers put the repository root on sys.path)
from model.moe import MoEStats
from model.router import tokens_per_expert


def masked_expert_loop(experts, x_TD, topk_idx_TK, topk_weight_TK, training):
    """Steps 3-5 of model/moe.py (dispatch, experts, combine) as one loop over the experts.
    x_TD [T, D]; topk_idx_TK int64 [T, K] in [-1, E) (-1: no expert); topk_weight_TK [T, K].
    Returns y_TD [T, D] of x's dtype. In training an expert without tokens joins the graph with a zero
    gradient (DDP needs every gradient)."""
    y_TD = torch.zeros_like(x_TD)
    for e, expert in enumerate(experts):
        mask_TK = topk_idx_TK == e
        if mask_TK.any():
            token_idx = mask_TK.any(dim=-1).nonzero().flatten()
            weight = topk_weight_TK[mask_TK].view(-1, 1)  # (a token holds expert e in at most one slot)
            y_TD.index_add_(0, token_idx, (expert(x_TD[token_idx]) * weight).to(y_TD.dtype))
        elif training:
            y_TD[:1, :1] += 0 * sum(p.sum() for p in expert.parameters())  # (an empty slice when T = 0)
    return y_TD


def reference_masked_forward(mod, x):
    """x [B, S, D] -> [B, S, D]: MiniMind's MoE layer with `mod`'s gate and experts (no capacity, bias,
    scaling or shared experts); does not set aux_loss."""
    B, S, D = x.shape
    x_TD = x.view(-1, D)
    scores_TE = F.softmax(mod.gate(x_TD), dim=-1)
    topk_weight_TK, topk_idx_TK = torch.topk(scores_TE, k=mod.config.num_experts_per_tok, dim=-1, sorted=False)
    if mod.config.norm_topk_prob:
        topk_weight_TK = topk_weight_TK / (topk_weight_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return masked_expert_loop(mod.experts, x_TD, topk_idx_TK, topk_weight_TK, mod.training).view(B, S, D)


def masked_layer_forward(mod, x, token_mask=None):
    """`mod.forward(x, token_mask)` (an MOEFeedForward) with steps 3-5 run by `masked_expert_loop`: the same
    routing, router losses, load counting, capacity policy and shared experts; sets mod.aux_loss and
    mod.stats (padded_tokens_per_expert None: the loop pads nothing). x [B, S, D] -> [B, S, D]."""
    B, S, D = x.shape
    x_TD = x.reshape(-1, D)
    token_mask_T = None if token_mask is None else token_mask.reshape(-1).to(device=x.device, dtype=torch.bool)
    topk_idx_TK, topk_weight_TK, balance_loss, z_loss = mod.route(x_TD, token_mask_T, B)
    topk_idx_TK, _ = drop_and_pad(mod.config, topk_idx_TK, topk_weight_TK, token_mask_T)
    y_TD = masked_expert_loop(mod.experts, x_TD, topk_idx_TK, topk_weight_TK, mod.training)
    mod.stats = MoEStats(tokens_per_expert(topk_idx_TK, mod.config.num_experts), None, balance_loss, z_loss)
    if mod.shared_experts is not None:
        y_TD = y_TD + mod.shared_experts(x_TD).to(y_TD.dtype)
    return y_TD.view(B, S, D)
