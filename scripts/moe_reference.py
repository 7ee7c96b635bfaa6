"""The masked per-expert MoE loop that the sorted layer replaced, kept as the bitwise reference.

For every expert it asks the device three questions whose answers must come back to the host
(`mask.any()`, the length of `nonzero()`, the length of the boolean-mask gather), i.e. 3E+2 syncs with
the router's own. Tests and the benchmark compare `MOEFeedForward` against this function.
"""
import torch
import torch.nn.functional as F


def reference_masked_forward(mod, x):
    """x: [B, S, D] -> [B, S, D]; uses mod.gate / mod.experts / mod.config, does not set aux_loss."""
    B, S, D = x.shape
    x_TD = x.view(-1, D)
    scores_TE = F.softmax(mod.gate(x_TD), dim=-1)
    topk_weight_TK, topk_idx_TK = torch.topk(scores_TE, k=mod.config.num_experts_per_tok, dim=-1, sorted=False)
    if mod.config.norm_topk_prob:
        topk_weight_TK = topk_weight_TK / (topk_weight_TK.sum(dim=-1, keepdim=True) + 1e-20)
    y_TD = torch.zeros_like(x_TD)
    for e, expert in enumerate(mod.experts):
        mask_TK = topk_idx_TK == e
        if mask_TK.any():
            token_idx = mask_TK.any(dim=-1).nonzero().flatten()
            weight = topk_weight_TK[mask_TK].view(-1, 1)
            y_TD.index_add_(0, token_idx, (expert(x_TD[token_idx]) * weight).to(y_TD.dtype))
        elif mod.training:  # keep the idle expert in the autograd graph with a zero gradient
            y_TD[0, 0] += 0 * sum(p.sum() for p in expert.parameters())
    return y_TD.view(B, S, D)
