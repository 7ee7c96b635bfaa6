"""The masked per-expert MoE loop that the sorted layer replaced, kept as the bitwise reference.

MiniMind's routing (softmax, top-k, renormalisation) in front of `model/moe.py: masked_expert_loop`, the
loop itself (also what `moe_impl="masked"` runs). For every expert the loop asks the device three
questions whose answers must come back to the host (`mask.any()`, the length of `nonzero()`, the length
of the boolean-mask gather), i.e. 3E+2 syncs with the router's own. Tests and the benchmarks compare
`MOEFeedForward` against this function.
"""
import torch
import torch.nn.functional as F

from model.moe import masked_expert_loop  # (importers put the repository root on sys.path)


def reference_masked_forward(mod, x):
    """x: [B, S, D] -> [B, S, D]; uses mod.gate / mod.experts / mod.config, does not set aux_loss."""
    B, S, D = x.shape
    x_TD = x.view(-1, D)
    scores_TE = F.softmax(mod.gate(x_TD), dim=-1)
    topk_weight_TK, topk_idx_TK = torch.topk(scores_TE, k=mod.config.num_experts_per_tok, dim=-1, sorted=False)
    if mod.config.norm_topk_prob:
        topk_weight_TK = topk_weight_TK / (topk_weight_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return masked_expert_loop(mod.experts, x_TD, topk_idx_TK, topk_weight_TK, mod.training).view(B, S, D)
