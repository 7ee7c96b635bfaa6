"""Router losses and load counting for the MoE layer: pure functions, one per formula.

Shape legend: T tokens, B sequences of S positions (T = B*S), E experts, K experts per token.
`token_mask` (bool, True = a real token; None = all real) keeps padding out of every statistic. Each
balance loss is per layer and the model averages them over layers (`layer_mean`), so one layer's
imbalance cannot cancel another's (as when all layers' routing is concatenated first).
"""
import torch


def _masked_mean(values_T_, token_mask_T):
    """Mean over the real tokens (dim 0). values [T, ...]; token_mask [T] bool or None. Padded
    positions are selected away (`where`), not multiplied by 0, so a NaN or Inf there cannot reach
    the result."""
    if token_mask_T is None:
        return values_T_.mean(0)
    mask_T_ = token_mask_T.view(-1, *([1] * (values_T_.dim() - 1)))
    return torch.where(mask_T_, values_T_, 0).sum(0) / token_mask_T.sum().clamp(min=1)


def slot_load(topk_idx_TK: torch.Tensor, num_experts: int, token_mask_T=None):
    """load_KE fp32 [K, E]: the fraction of real tokens whose k-th slot picked expert e; bitwise the
    mean of a one-hot [T, K, E], without building it. topk_idx_TK int64 [T, K] in [0, E)."""
    (T, K), E = topk_idx_TK.shape, num_experts
    counts = tokens_per_expert(topk_idx_TK + torch.arange(K, device=topk_idx_TK.device) * E,
                               K * E, token_mask_T)
    return counts.view(K, E).float() / (T if token_mask_T is None
                                        else token_mask_T.sum().clamp(min=1))


def minimind_aux_loss(scores_TE: torch.Tensor, topk_idx_TK: torch.Tensor, num_experts: int,
                      coef: float, token_mask_T=None):
    """MiniMind's balance loss (jingyaogong/minimind; the Switch loss per slot): coef * E *
    sum_{k,e} load[k, e] * mean_t scores[t, e], load[k, e] the fraction of tokens whose k-th slot
    picked e (coef * K when balanced). Bitwise MiniMind's without a mask (the acceptance test pins
    it). scores_TE [T, E]."""
    return (slot_load(topk_idx_TK, num_experts, token_mask_T)
            * _masked_mean(scores_TE, token_mask_T)).sum() * num_experts * coef


def switch_aux_loss(scores_TE: torch.Tensor, topk_idx_TK: torch.Tensor, num_experts: int,
                    coef: float, token_mask_T=None):
    """Switch Transformer balance loss for top-k: coef * E * sum_e f_e * P_e with f_e = (pairs
    routed to e) / (T * K) and P_e = mean_t scores[t, e]: exactly coef when balanced, for every K
    (Fedus et al. 2021, eq. 4-6; the T*K is Megatron-LM's). Args as `minimind_aux_loss`; returns an
    fp32 scalar."""
    K = topk_idx_TK.shape[1]
    f_E = slot_load(topk_idx_TK, num_experts, token_mask_T).sum(0) / K
    P_E = _masked_mean(scores_TE.float(), token_mask_T)
    return coef * num_experts * (f_E * P_E).sum()


def sequence_aux_loss(scores_BSE: torch.Tensor, topk_idx_BSK: torch.Tensor, num_experts: int,
                      coef: float, token_mask_BS=None):
    """Sequence-wise balance loss (DeepSeek-V3 report, eq. 17-20): coef * mean_b sum_e f[b, e] *
    P[b, e], f[b, e] = E / (K * S_b) * (pairs of sequence b routed to e), P[b, e] = mean over b's
    S_b real tokens of the renormalised scores; coef when every sequence is balanced; sequences
    without real tokens left out. scores_BSE [B, S, E]; topk_idx_BSK int64 [B, S, K]; token_mask_BS
    bool [B, S] or None. fp32 scalar."""
    B, S, K = topk_idx_BSK.shape
    one_hot = scores_BSE.new_zeros(B, S, K, num_experts, dtype=torch.float32)
    one_hot.scatter_(-1, topk_idx_BSK.unsqueeze(-1), 1.0)
    counts_BSE = one_hot.sum(2)
    probs_BSE = scores_BSE.float() / scores_BSE.float().sum(-1, keepdim=True)
    m_BS1 = (torch.ones(B, S, dtype=torch.bool, device=scores_BSE.device) if token_mask_BS is None
             else token_mask_BS).unsqueeze(-1)
    real_B1 = m_BS1.sum(1).float()
    # `where`, not a product with the mask: a NaN at a padded position must not reach the loss
    f_BE = num_experts / K * torch.where(m_BS1, counts_BSE, 0).sum(1) / real_B1.clamp(min=1)
    P_BE = torch.where(m_BS1, probs_BSE, 0).sum(1) / real_B1.clamp(min=1)
    has_tokens_B = (real_B1.squeeze(-1) > 0).float()
    per_seq_B = (f_BE * P_BE).sum(-1) * has_tokens_B
    return coef * per_seq_B.sum() / has_tokens_B.sum().clamp(min=1)


def router_z_loss(logits_TE: torch.Tensor, coef: float, token_mask_T=None):
    """Router z-loss coef * mean_t (logsumexp_e logits[t, e])^2 in fp32: keeps the logits small
    (ST-MoE, Zoph et al. 2022, eq. 5)."""
    z_T = torch.logsumexp(logits_TE.float(), dim=-1)
    return coef * _masked_mean(z_T.square(), token_mask_T)


AUX_LOSSES = {"minimind": minimind_aux_loss, "switch": switch_aux_loss,
              "sequence": sequence_aux_loss}


def router_losses(config, logits_TE, scores_TE, topk_idx_TK, token_mask_T=None, num_sequences=1):
    """One layer's (balance_loss, z_loss) as the config asks, each a scalar or None (off).
    logits_TE / scores_TE [T, E]; topk_idx_TK the router's choice before capacity drops;
    num_sequences B (T = B*S)."""
    E, coef = config.num_experts, config.router_aux_loss_coef
    balance = z_loss = None
    if config.router_aux_loss_type == "sequence" and coef > 0:
        B = num_sequences
        balance = sequence_aux_loss(scores_TE.view(B, -1, E),
                                    topk_idx_TK.view(B, -1, topk_idx_TK.shape[1]), E, coef,
                                    None if token_mask_T is None else token_mask_T.view(B, -1))
    elif config.router_aux_loss_type != "none" and coef > 0:
        balance = AUX_LOSSES[config.router_aux_loss_type](scores_TE, topk_idx_TK, E,
                                                          coef, token_mask_T)
    if config.router_z_loss_coef > 0:
        z_loss = router_z_loss(logits_TE, config.router_z_loss_coef, token_mask_T)
    return balance, z_loss


def layer_mean(per_layer_losses, like):
    """Average of the per-layer losses (a 0-dim fp32 zero when there are none)."""
    losses = list(per_layer_losses)
    if not losses:
        return like.new_zeros((), dtype=torch.float32)
    return sum(losses) / len(losses)


def tokens_per_expert(topk_idx_TK: torch.Tensor, num_experts: int, token_mask_T=None,
                      count_dropped=False):
    """Routed (token, slot) pairs per expert, the one place they are counted: int64 [E] on
    topk_idx's device (no host read); with count_dropped [E + 1], the last entry the pairs with -1
    or a masked token. topk_idx_TK int64 [T, K] in [-1, E) (-1 = no expert); token_mask_T bool [T]
    or None."""
    E = num_experts
    # -1 -> E, the slot of "no expert" (one op instead of where(>= 0))
    slot_TK = topk_idx_TK.remainder(E + 1)
    if token_mask_T is not None:
        slot_TK = torch.where(token_mask_T.reshape(-1, 1), slot_TK, E)
    slot_N = slot_TK.reshape(-1)
    counts_E1 = torch.zeros(E + 1, dtype=torch.int64, device=slot_N.device)
    counts_E1.scatter_add_(0, slot_N, torch.ones_like(slot_N))
    return counts_E1 if count_dropped else counts_E1[:E]


def expert_bias_update(bias_E: torch.Tensor, load_E: torch.Tensor, rate: float):
    """Aux-loss-free balancing step, in place: bias += rate * sign(mean load - load). The bias only
    enters the top-k choice, never the combine weights (Wang et al. 2024; DeepSeek-V3's bias update
    speed)."""
    load = load_E.float()
    bias_E += rate * torch.sign(load.mean() - load)
    return bias_E
