"""The masked per-expert MoE loop that the sorted layer replaced (MiniMind's layer), kept as the bitwise
reference of `moe_impl="sorted"`: tests and the benchmarks' masked rows compare `MOEFeedForward` with it.

For every expert the loop asks the device three questions whose answers must come back to the host
(`mask.any()`, the length of `nonzero()`, the length of the boolean-mask gather): 3E syncs a layer, plus
the router's own.

    reference_masked_forward(mod, x)   MiniMind's routing (softmax, top-k, renormalisation), then the loop
    masked_layer_forward(mod, x, mask) every MOEFeedForward option written out here from the layer's
                                       parameters and config (routing, router losses, load counting,
                                       capacity policy, shared experts), then the loop; sets aux_loss,
                                       stats and the load pop_load() returns

Nothing here calls the layer's routing, model/router.py or model/dispatch.py: the reference restates
their documented formulas and policies plainly (counts and capacity in Python loops), so a test that
compares the layer with it compares two codings of one definition.
"""
import math

import torch
import torch.nn.functional as F

from model.moe import MoEStats  # (importers put the repository root on sys.path; only the record type)


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


# ------------------------------ the layer's options, written out ------------------------------

def plain_routing(config, gate_weight_ED, expert_bias_E, x_TD):
    """(logits_TE, scores_TE, topk_idx_TK, topk_weight_TK): logits x @ W^T (with router_dtype "float32" in
    fp32 outside autocast), scores their softmax; the K experts of the highest scores, or of the highest
    scores + expert_bias when there is one (the bias chooses, it never weighs); the chosen scores as weights,
    renormalised to sum 1 (norm_topk_prob), times routed_scaling_factor."""
    K = config.num_experts_per_tok
    if config.router_dtype == "float32":
        with torch.autocast(x_TD.device.type, enabled=False):
            logits_TE = F.linear(x_TD.float(), gate_weight_ED.float())
    else:
        logits_TE = F.linear(x_TD, gate_weight_ED)
    scores_TE = F.softmax(logits_TE, dim=-1)
    choice_TE = scores_TE if expert_bias_E is None else scores_TE.float() + expert_bias_E
    topk_idx_TK = torch.topk(choice_TE, k=K, dim=-1, sorted=False).indices
    topk_weight_TK = scores_TE.gather(-1, topk_idx_TK)
    if config.norm_topk_prob:
        topk_weight_TK = topk_weight_TK / (topk_weight_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return logits_TE, scores_TE, topk_idx_TK, topk_weight_TK * config.routed_scaling_factor


def count_choices(idx_rows, num_experts, real=None):
    """[[pairs of row r's slot j ... ]] -> int64 [K, E]: how many real rows (real[r], all when None) chose
    expert e in slot j; -1 entries (no expert) count nowhere. A plain loop."""
    K = len(idx_rows[0]) if idx_rows else 0
    counts = [[0] * num_experts for _ in range(K)]
    for r, row in enumerate(idx_rows):
        if real is None or real[r]:
            for j, e in enumerate(row):
                if e >= 0:
                    counts[j][e] += 1
    return torch.tensor(counts, dtype=torch.int64).view(K, num_experts)


def real_mean(values_T_, real_T):
    """Mean over dim 0 of the real rows (real_T bool [T]; at least 1 in the denominator); padded rows add 0."""
    return torch.where(real_T.view(-1, *([1] * (values_T_.dim() - 1))), values_T_, 0).sum(0) / real_T.sum().clamp(min=1)


def plain_balance_loss(config, scores_TE, topk_idx_TK, real_T, num_sequences):
    """The balance loss router_aux_loss_type names (model/router.py's docstrings), None when off:
      minimind  coef * E * sum_{k,e} load[k, e] * P[e]: load[k, e] the fraction of real tokens whose slot k
                chose e, P[e] the mean score of e over real tokens;
      switch    coef * E * sum_e f[e] * P[e]: f[e] the fraction of the real tokens' T*K choices that are e
                (the slots' loads averaged over K), P as above in fp32;
      sequence  coef * mean over sequences b with real tokens of sum_e f[b, e] * P[b, e]: f[b, e] =
                E / K * (b's real tokens that chose e) / S_b, P[b, e] the mean over b's S_b real tokens of
                the scores renormalised to sum 1 (fp32)."""
    E, K = config.num_experts, config.num_experts_per_tok
    coef, kind = config.router_aux_loss_coef, config.router_aux_loss_type
    if kind == "none" or coef <= 0:
        return None
    idx_rows, real = topk_idx_TK.tolist(), real_T.tolist()
    device = scores_TE.device
    if kind in ("minimind", "switch"):
        load_KE = count_choices(idx_rows, E, real).to(device).float() / real_T.sum().clamp(min=1)
        if kind == "minimind":
            return (load_KE * real_mean(scores_TE, real_T)).sum() * E * coef
        f_E = load_KE.sum(0) / K
        return coef * E * (f_E * real_mean(scores_TE.float(), real_T)).sum()
    assert kind == "sequence", kind
    B = num_sequences
    S = len(idx_rows) // B
    probs_TE = scores_TE.float() / scores_TE.float().sum(-1, keepdim=True)
    per_sequence = []
    for b in range(B):
        rows = slice(b * S, (b + 1) * S)
        S_b = sum(real[rows])
        if S_b == 0:
            continue  # (a sequence of padding only is left out of the mean)
        chosen_E = count_choices(idx_rows[rows], E, real[rows]).sum(0).to(device).float()
        f_E = E / K * chosen_E / S_b
        P_E = real_mean(probs_TE[rows], real_T[rows])
        per_sequence.append((f_E * P_E).sum())
    if not per_sequence:
        return scores_TE.new_zeros((), dtype=torch.float32)
    return coef * torch.stack(per_sequence).sum() / len(per_sequence)


def plain_z_loss(config, logits_TE, real_T):
    """coef * mean over real tokens of logsumexp(logits)^2 in fp32 (ST-MoE), None when its coef is 0."""
    if config.router_z_loss_coef <= 0:
        return None
    return config.router_z_loss_coef * real_mean(torch.logsumexp(logits_TE.float(), dim=-1).square(), real_T)


def plain_capacity(config, topk_idx_TK, topk_weight_TK, real_T):
    """topk_idx_TK with -1 for every pair that goes to no expert: a padding token's, and with capacity_factor
    cf each expert's pairs beyond its capacity ceil(cf * T * K / E) (T all tokens, padding too): it keeps the
    pairs of the highest routing weights (moe_drop_policy "probs"; ties: the earlier token) or of the earliest
    tokens ("position"). A Python loop over the (token, slot) pairs."""
    (T, K), E = topk_idx_TK.shape, config.num_experts
    idx_rows, real = topk_idx_TK.tolist(), real_T.tolist()
    for t in range(T):
        if not real[t]:
            idx_rows[t] = [-1] * K
    if config.capacity_factor is not None:
        capacity = math.ceil(config.capacity_factor * T * K / E)
        weight_rows = topk_weight_TK.float().tolist()
        pairs = [(t, j) for t in range(T) for j in range(K) if idx_rows[t][j] >= 0]  # token order
        if config.moe_drop_policy == "probs":
            pairs.sort(key=lambda tj: -weight_rows[tj[0]][tj[1]])  # (a stable sort: ties keep token order)
        taken = [0] * E
        for t, j in pairs:
            e = idx_rows[t][j]
            if taken[e] < capacity:
                taken[e] += 1
            else:
                idx_rows[t][j] = -1
    return torch.tensor(idx_rows, dtype=torch.int64, device=topk_idx_TK.device).view(T, K)


def masked_layer_forward(mod, x, token_mask=None):
    """What `mod.forward(x, token_mask)` (an MOEFeedForward) computes, from its gate weight, expert_bias,
    config, experts and shared experts alone, steps 3-5 by `masked_expert_loop`; sets mod.aux_loss, mod.stats
    (padded_tokens_per_expert None: the loop pads nothing) and, in training, adds the router's choices per
    expert (real tokens, before capacity) to what mod.pop_load() returns. x [B, S, D] -> [B, S, D]."""
    B, S, D = x.shape
    config, E = mod.config, mod.config.num_experts
    x_TD = x.reshape(-1, D)
    T = x_TD.shape[0]
    real_T = (torch.ones(T, dtype=torch.bool, device=x.device) if token_mask is None
              else token_mask.reshape(-1).to(device=x.device, dtype=torch.bool))
    logits_TE, scores_TE, topk_idx_TK, topk_weight_TK = plain_routing(config, mod.gate.weight, mod.expert_bias, x_TD)
    balance_loss = z_loss = None
    if mod.training and T > 0:
        balance_loss = plain_balance_loss(config, scores_TE, topk_idx_TK, real_T, B)
        z_loss = plain_z_loss(config, logits_TE, real_T)
        load_E = count_choices(topk_idx_TK.tolist(), E, real_T.tolist()).sum(0).to(x.device)
        mod._load_E = load_E if mod._load_E is None else mod._load_E + load_E
    aux_loss = balance_loss if balance_loss is not None else scores_TE.new_zeros((), dtype=torch.float32)
    mod.aux_loss = aux_loss if z_loss is None else aux_loss + z_loss
    kept_idx_TK = plain_capacity(config, topk_idx_TK, topk_weight_TK, real_T)
    y_TD = masked_expert_loop(mod.experts, x_TD, kept_idx_TK, topk_weight_TK, mod.training)
    routed_E = count_choices(kept_idx_TK.tolist(), E).sum(0).to(x.device)
    mod.stats = MoEStats(routed_E, None, balance_loss, z_loss)
    if mod.shared_experts is not None:
        y_TD = y_TD + mod.shared_experts(x_TD).to(y_TD.dtype)
    return y_TD.view(B, S, D)
