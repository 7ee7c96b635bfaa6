"""SwiGLU feed-forward and the mixture-of-experts layer with single-sync sorted dispatch.

Shape legend: B batch, S sequence, T = B*S tokens, D hidden size, E experts, K experts per token (top-k),
F expert intermediate size, N = T*K routed (token, slot) pairs.

The MoE layer computes exactly what the per-expert masked loop computes (MiniMind's original layer,
kept as `scripts/moe_reference.py`), bit for bit, but
  * dispatch is one stable sort of the N (token, slot) pairs by expert id, so each expert's rows are a
    contiguous slice in the same ascending-token order the masked loop gathers them in;
  * `tokens_per_expert` is computed on the device and read to the host once per layer call (the masked
    loop needs 3 reads per expert: `mask.any()`, `nonzero()`, the boolean-index length);
  * combine adds each token's K contributions in ascending expert order starting from zero, which is
    the order the masked loop's `index_add_` calls produce, so the forward is bitwise identical.
"""
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from model.moe_fused import fused_experts_forward, pack_expert_weights
from model.router import (AUX_LOSSES, expert_bias_update, minimind_aux_loss, router_z_loss,  # noqa: F401
                          tokens_per_expert)

_warned_no_router_grad = False


class PermuteRows(torch.autograd.Function):
    """y = x[perm] for a permutation `perm` [N] with inverse `inverse` [N]; x: [N, D].

    Autograd's own backward of `x[perm]` scatter-adds into zeros (a serial accumulate on CPU); for a
    permutation every row receives exactly one gradient, so the backward is the gather grad[inverse].
    """

    @staticmethod
    def forward(ctx, x, perm, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class FeedForward(nn.Module):
    """SwiGLU FFN: down(silu(gate(x)) * up(x)). x: [..., D] -> [..., D]. Names match HF (`gate_proj`...)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MOEFeedForward(nn.Module):
    """Top-k softmax-routed mixture of SwiGLU experts (MiniMind / Qwen3-MoE style).

    forward(x, token_mask=None): x [B, S, D] float -> y [B, S, D] of x's dtype. token_mask [B, S] bool
    (True = real token) marks padding: padded positions go to no expert (their FFN output is 0) and count
    in no router statistic. After a training-mode call `self.aux_loss` holds the router loss of this
    layer: the balance loss of type `router_aux_loss_type` plus the z-loss (a scalar; zero in eval).

    Parameters and state_dict keys: `gate.weight` [E, D] and `experts.{e}.{gate,up,down}_proj.weight`,
    plus the buffer `expert_bias` [E] fp32 only when aux-loss-free balancing is on
    (router_bias_update_rate > 0). In training every expert runs, possibly on an empty slice, so experts
    that got no tokens still get a (zero) gradient, as DistributedDataParallel(find_unused_parameters=False)
    requires. In eval, empty experts are skipped and their grads stay None.

    Telemetry: in training, `self.load_accum` sums the router's choices per expert (int64 [E], real tokens
    only, before capacity dropping) until `pop_load()` hands them over (train/ does, once per step).
    """

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            FeedForward(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts))
        if config.router_bias_update_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.aux_loss = torch.zeros(())
        self.z_loss = None  # the z-loss part of aux_loss (None when router_z_loss_coef == 0)
        self.load_accum = None
        # Set by train/expert_parallel.py to shard the experts over ranks; None = all experts local.
        self.expert_parallel = None
        # Filled by every forward: [E] int64 routed (token, slot) pairs per expert, for telemetry.
        self.last_tokens_per_expert = None
        if config.moe_impl == "fused":
            self.pack_expert_weights()

    def pack_expert_weights(self):
        """Fused path: lay the expert weights out back to back (see model.moe_fused.pack_expert_weights)."""
        pack_expert_weights(self.experts)

    def _apply(self, fn, *args, **kwargs):
        # .to() / .cuda() / .half() give every parameter its own new storage: pack them again.
        out = super()._apply(fn, *args, **kwargs)
        if self.config.moe_impl == "fused":
            self.pack_expert_weights()
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()  # the bias stays fp32 under .half() / .bfloat16()
        return out

    def __getstate__(self):
        # deepcopy / pickle: leave out the last forward's results (aux_loss is not a graph leaf)
        state = dict(super().__getstate__())
        state.update(aux_loss=torch.zeros(()), z_loss=None, load_accum=None, last_tokens_per_expert=None)
        return state

    @property
    def experts_forward(self):
        """The expert compute the config selects: sorted_experts_forward or fused_experts_forward."""
        return fused_experts_forward if self.config.moe_impl == "fused" else sorted_experts_forward

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
        Returns scores_TE, topk_weight_TK, topk_idx_TK (int64).
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

    def router_loss(self, logits_TE, scores_TE, topk_idx_TK, token_mask_T, B, S):
        """This layer's balance loss (config.router_aux_loss_type) + z-loss; sets self.z_loss."""
        cfg, E = self.config, self.config.num_experts
        loss = scores_TE.new_zeros(())
        if cfg.router_aux_loss_type != "none" and cfg.router_aux_loss_coef > 0:
            if cfg.router_aux_loss_type == "sequence":
                loss = AUX_LOSSES["sequence"](scores_TE.view(B, S, E), topk_idx_TK.view(B, S, -1), E,
                                              cfg.router_aux_loss_coef,
                                              None if token_mask_T is None else token_mask_T.view(B, S))
            else:
                loss = AUX_LOSSES[cfg.router_aux_loss_type](scores_TE, topk_idx_TK, E, cfg.router_aux_loss_coef,
                                                            token_mask_T)
        self.z_loss = None
        if cfg.router_z_loss_coef > 0:
            self.z_loss = router_z_loss(logits_TE, cfg.router_z_loss_coef, token_mask_T)
            loss = loss + self.z_loss
        return loss

    def pop_load(self):
        """Routed pairs per expert (int64 [E]) summed since the last call, then reset; None if none."""
        load, self.load_accum = self.load_accum, None
        return load

    @torch.no_grad()
    def update_expert_bias(self, load_E):
        """Aux-loss-free balancing after an optimizer step: bias += rate * sign(mean load - load).
        load_E: the step's pairs per expert over all data-parallel ranks (train/ sums them)."""
        if self.expert_bias is not None:
            expert_bias_update(self.expert_bias, load_E.to(self.expert_bias.device), self.config.router_bias_update_rate)

    def forward(self, x, token_mask=None):
        B, S, D = x.shape
        E, K = self.config.num_experts, self.config.num_experts_per_tok
        x_TD = x.reshape(-1, D)
        T = x_TD.shape[0]
        token_mask_T = None if token_mask is None else token_mask.reshape(-1).to(device=x.device, dtype=torch.bool)
        logits_TE = self.router_logits(x_TD)
        scores_TE, topk_weight_TK, topk_idx_TK = self.route(x_TD, logits_TE)
        if self.training and T > 0:
            self._warn_if_router_gets_no_lm_gradient()
            if self.config.router_aux_loss_type == "minimind" and token_mask_T is None and self.config.router_z_loss_coef == 0:
                # MiniMind's exact computation (the acceptance test pins it bit for bit)
                self.aux_loss = (minimind_aux_loss(scores_TE, topk_idx_TK, E, self.config.router_aux_loss_coef)
                                 if self.config.router_aux_loss_coef > 0 else scores_TE.new_zeros(()))
            else:
                self.aux_loss = self.router_loss(logits_TE, scores_TE, topk_idx_TK, token_mask_T, B, S)
            with torch.no_grad():
                load = tokens_per_expert(topk_idx_TK, E, token_mask_T)
                self.load_accum = load if self.load_accum is None else self.load_accum + load
        else:
            self.aux_loss = scores_TE.new_zeros(())
        if token_mask_T is not None:  # padding goes to no expert: no compute, no capacity taken
            topk_idx_TK = topk_idx_TK.masked_fill(~token_mask_T.unsqueeze(-1), -1)

        pad_to = None
        if self.config.capacity_factor is not None:
            capacity = math.ceil(self.config.capacity_factor * T * K / E)
            topk_idx_TK = apply_capacity(topk_idx_TK, topk_weight_TK, E, capacity, self.config.moe_drop_policy)
            if self.config.moe_pad_to_capacity:
                pad_to = capacity
        align = self.config.moe_expert_alignment
        padding = None if pad_to is None and align == 1 else (pad_to, align)
        # Order each token's K slots by expert id: after the global stable sort below, slot j of a token
        # is then its j-th smallest expert, and the combine adds slots 0..K-1 in the masked loop's order.
        # (-1 entries sort first; every path skips them.)
        topk_idx_TK, slot_order_TK = topk_idx_TK.sort(dim=-1)
        topk_weight_TK = topk_weight_TK.gather(-1, slot_order_TK)
        if self.expert_parallel is not None:  # experts sharded over ranks: the transport lives in train/
            return self.expert_parallel(self, x_TD, topk_idx_TK, topk_weight_TK, padding).view(B, S, D)
        if self.config.moe_impl == "fused":  # without capacity or a mask the top-k never says "no expert"
            may_drop = self.config.capacity_factor is not None or token_mask_T is not None
            return fused_experts_forward(self.experts, x_TD, topk_idx_TK, topk_weight_TK, self.training, self,
                                         padding=padding, may_drop=may_drop).view(B, S, D)
        return sorted_experts_forward(self.experts, x_TD, topk_idx_TK, topk_weight_TK, self.training,
                                      self, padding=padding).view(B, S, D)

    def _warn_if_router_gets_no_lm_gradient(self):
        global _warned_no_router_grad
        if self.config.num_experts_per_tok == 1 and self.config.norm_topk_prob and not _warned_no_router_grad:
            _warned_no_router_grad = True
            warnings.warn("MoE with num_experts_per_tok=1 and norm_topk_prob=True: every combine weight is "
                          "exactly 1, so the router gets no gradient from the language-model loss (only from "
                          "the aux / z losses). Set norm_topk_prob=False or use k >= 2.", stacklevel=3)


def apply_capacity(topk_idx_TK, topk_weight_TK, num_experts, capacity, policy):
    """Drop routed pairs beyond each expert's capacity (no host sync). Returns topk_idx_TK with dropped
    entries set to -1. policy "probs" keeps each expert's highest-weight pairs, "position" its earliest
    tokens (Switch Transformer / GShard capacity, as in Megatron-LM's drop policies)."""
    T, K = topk_idx_TK.shape
    idx_N = topk_idx_TK.reshape(-1)
    valid_N = idx_N >= 0
    expert_N = torch.where(valid_N, idx_N, num_experts)
    pre = (torch.argsort(-topk_weight_TK.reshape(-1).float(), stable=True) if policy == "probs"
           else torch.arange(T * K, device=idx_N.device))
    order = pre[torch.argsort(expert_N[pre], stable=True)]  # by expert, then by the policy's preference
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=idx_N.device)
    counts.scatter_add_(0, expert_N, torch.ones_like(expert_N))
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(T * K, device=idx_N.device) - starts[expert_N[order]]
    keep_N = torch.empty_like(valid_N).scatter_(0, order, rank_in_expert < capacity)
    return torch.where(keep_N & valid_N, idx_N, -1).view(T, K)


def sorted_experts_forward(experts, x_TD, topk_idx_TK, topk_weight_TK, training, stats=None, counts=None,
                           padding=None):
    """Single-sync sorted dispatch -> expert compute -> deterministic combine.

    Args:
        experts: sequence of E modules, expert e maps [n, D] -> [n, D].
        x_TD: [T, D] token rows. topk_idx_TK: int64 [T, K], each row sorted ascending (distinct experts;
            -1 = no expert, skipped). topk_weight_TK: [T, K] combine weights, aligned with topk_idx_TK.
        training: run idle experts on an empty slice so they join the autograd graph (zero grads).
        stats: if given, `stats.last_tokens_per_expert` is set to the [E] int64 counts.
        padding: None, or (pad_to, alignment): each expert's rows are padded with zero rows to pad_to
            (if not None) and then to a multiple of alignment; padded rows are computed and discarded
            (SwiGLU maps a zero row to zero), so the output is unchanged. `stats.last_padded_counts`
            records the padded row counts.
        counts: host list of the E per-expert pair counts when the caller already knows them (expert
            parallelism exchanges them with its split sizes); then this function reads nothing to the host.
    Returns: y_TD [T, D] in x's dtype, y[t] = sum over j (ascending expert) of w[t, j] * expert(x[t]),
        accumulated from zero one slot at a time (the masked reference's order, hence bitwise equal).
    """
    T, D = x_TD.shape
    K, E = topk_idx_TK.shape[1], len(experts)
    # Permute: one stable sort of the N = T*K pairs by expert id. Within an expert, pairs stay in
    # ascending token order (each token picks an expert at most once). -1 entries sort first and are cut.
    expert_idx_N = topk_idx_TK.reshape(-1)
    sorted_pair_N = torch.argsort(expert_idx_N, stable=True)
    sorted_token_N = sorted_pair_N // K
    sorted_weight_N1 = topk_weight_TK.reshape(-1)[sorted_pair_N].unsqueeze(-1)
    if counts is None:
        counts_E1 = torch.zeros(E + 1, dtype=torch.int64, device=x_TD.device)  # slot 0 counts the -1 entries
        counts_E1.scatter_add_(0, expert_idx_N + 1, torch.ones_like(expert_idx_N))
        if stats is not None:
            stats.last_tokens_per_expert = counts_E1[1:]
        counts = counts_E1.tolist()  # the layer's single device-to-host read
        skipped, counts = counts[0], counts[1:]
    else:
        skipped = T * K - sum(counts)

    # Compute: each expert once, on its contiguous slice of the sorted pairs. Each slice is gathered
    # into its own fresh tensor, like the reference's x[token_idx], so the GEMM sees identical inputs.
    out_chunks = [x_TD.new_zeros(skipped, D)] if skipped else []
    start, padded_counts = skipped, []
    for e, n in enumerate(counts):
        if n == 0 and not training:
            continue
        rows = slice(start, start + n)
        x_e = x_TD[sorted_token_N[rows]]
        if padding is not None:
            pad_to, align = padding
            target = max(n, pad_to or 0)
            target = -(-target // align) * align
            padded_counts.append(target)
            if target > n:
                x_e = torch.cat([x_e, x_e.new_zeros(target - n, D)])
        out_chunks.append((experts[e](x_e)[:n] * sorted_weight_N1[rows]).to(x_TD.dtype))
        start += n
    if stats is not None and padding is not None:
        stats.last_padded_counts = padded_counts
    with torch.autocast(x_TD.device.type, enabled=False):  # chunks share x's dtype; CPU autocast's cat rejects fp16
        out_sorted_ND = torch.cat(out_chunks) if out_chunks else x_TD.new_zeros(0, D)

    # Unpermute by gathering with the inverse permutation (no scatter-add, no atomics, also in backward).
    inverse_N = torch.empty_like(sorted_pair_N).scatter_(0, sorted_pair_N, torch.arange(T * K, device=x_TD.device))
    out_TKD = PermuteRows.apply(out_sorted_ND, inverse_N, sorted_pair_N).view(T, K, D)

    # Combine in ascending expert order, from zero, one add per slot: the masked loop's summation.
    y_TD = torch.zeros_like(x_TD)
    for j in range(K):
        y_TD = y_TD + out_TKD[:, j]
    return y_TD
