"""Capacity control for the MoE layer: capacity_factor with "probs"/"position" drop policies, padding to
capacity and expert alignment.

    python scripts/test_capacity.py
"""
import math

import torch

from testlib import Skip, run  # noqa: F401
from moe_reference import reference_masked_forward
from sync_count import count_syncs
from model.model_minimind import MiniMindConfig, MOEFeedForward
from model.dispatch import apply_capacity


def build(seed=0, **kw):
    cfg = dict(hidden_size=32, num_attention_heads=1, num_key_value_heads=1, head_dim=8, use_moe=True,
               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
    cfg.update(kw)
    torch.manual_seed(seed)
    return MOEFeedForward(MiniMindConfig(**cfg)).train()


def x_batch(t=40, seed=1):
    return torch.randn(1, t, 32, generator=torch.Generator().manual_seed(seed))


def routed(mod, x):
    """(topk_weight_TK, topk_idx_TK) of the layer's router on x (route's other results: the losses)."""
    with torch.no_grad():
        idx, w, _, _ = mod.route(x.reshape(-1, 32))
    return w.detach(), idx


def test_counts_within_capacity_and_sync_free():
    """Sorted: one sync with capacity; the fused layer built with train.engines.engines_for's engines
    (the experts on the CPU expert GEMMs where oneDNN runs, the rows moved by the plain row movers): no sync,
    the same per-expert counts (also with padding to capacity)."""
    from train.engines import describe, engines_for
    from testlib import rebuilt
    for cf in (0.25, 0.5, 1.0):
        for pad in (False, True):
            mod = build(capacity_factor=cf, moe_pad_to_capacity=pad)
            x = x_batch()
            _, n = count_syncs(mod, x)
            cap = math.ceil(cf * 40 * 2 / 4)
            assert int(mod.stats.tokens_per_expert.max()) <= cap, (cf, mod.stats.tokens_per_expert, cap)
            assert n == 1, f"{n} syncs with capacity"
            fused = build(capacity_factor=cf, moe_pad_to_capacity=pad, moe_impl="fused")
            engines = engines_for(fused.config, "cpu", torch.float32)
            fused = rebuilt(fused, engines)
            want = f"engines: {engines.experts.__name__} x1"
            assert fused.experts.engine is engines.experts and describe(fused) == want, describe(fused)
            _, n = count_syncs(fused, x)
            assert n == 0, f"fused: {n} syncs with capacity"
            assert torch.equal(fused.stats.tokens_per_expert, mod.stats.tokens_per_expert), cf


def test_probs_policy_keeps_highest_weights_position_keeps_earliest():
    mod = build(seed=3)
    x = x_batch(t=64)
    w, idx = routed(mod, x)
    cap = 10
    for policy in ("probs", "position"):
        kept = apply_capacity(idx, w, 4, cap, policy)
        for e in range(4):
            mine = idx == e
            keep, drop = mine & (kept == e), mine & (kept != e)
            assert int(keep.sum()) == min(cap, int(mine.sum()))
            if drop.any():
                if policy == "probs":
                    assert w[keep].min() >= w[drop].max(), f"expert {e}: dropped a higher-weight pair"
                else:
                    tok = torch.arange(64)[:, None].expand(64, 2)
                    assert tok[keep].max() < tok[drop].min(), f"expert {e}: dropped an earlier token"


def test_large_capacity_is_dropless_and_bitwise():
    mod = build(seed=2, capacity_factor=4.0)  # capacity = T*K: nothing can be dropped
    x = x_batch()
    assert torch.equal(mod(x), reference_masked_forward(mod, x))


def test_dropped_tokens_get_zero_output():
    mod = build(seed=4, num_experts_per_tok=1, capacity_factor=0.25)
    x = x_batch(t=64)
    y = mod(x)
    _, idx = routed(mod, x)
    kept = apply_capacity(idx, routed(mod, x)[0], 4, math.ceil(0.25 * 64 / 4), "probs")
    dropped = (kept < 0).all(-1)
    assert dropped.any() and torch.count_nonzero(y[0, dropped]) == 0


def grads_of(mod, x):
    xi = x.clone().requires_grad_()
    y = mod(xi)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    g = {n: p.grad.clone() for n, p in mod.named_parameters()}
    mod.zero_grad(set_to_none=True)
    return y.detach(), xi.grad, g


def test_padding_and_alignment_change_nothing():
    """Zero padding rows (to capacity, or to a multiple of the alignment) leave outputs and gradients
    unchanged up to GEMM blocking (the real rows' block grows), and the padded counts are multiples."""
    x = x_batch(t=50)
    base = grads_of(build(seed=5, capacity_factor=1.0), x)
    for kw in (dict(moe_pad_to_capacity=True), dict(moe_expert_alignment=16),
               dict(moe_pad_to_capacity=True, moe_expert_alignment=8)):
        mod = build(seed=5, capacity_factor=1.0, **kw)
        got = grads_of(mod, x)
        assert torch.allclose(got[0], base[0], rtol=1e-5, atol=1e-6), kw
        assert torch.allclose(got[1], base[1], rtol=1e-5, atol=1e-6), kw
        for n in base[2]:
            assert torch.allclose(got[2][n], base[2][n], rtol=1e-5, atol=1e-6), (kw, n)
        align = kw.get("moe_expert_alignment", 1)
        cap = math.ceil(1.0 * 50 * 2 / 4)
        padded = mod.stats.padded_tokens_per_expert.tolist()
        assert len(padded) == 4 and all(c % align == 0 for c in padded), padded
        if kw.get("moe_pad_to_capacity"):
            assert all(c >= cap for c in padded), padded


def test_config_validation():
    for kw, field in ((dict(capacity_factor=0.0), "capacity_factor"), (dict(moe_drop_policy="random"), "moe_drop_policy"),
                      (dict(moe_pad_to_capacity=True), "moe_pad_to_capacity"), (dict(moe_expert_alignment=0), "moe_expert_alignment")):
        try:
            MiniMindConfig(**kw)
        except ValueError as e:
            assert field in str(e)
        else:
            raise AssertionError(kw)


TESTS = [test_counts_within_capacity_and_sync_free, test_probs_policy_keeps_highest_weights_position_keeps_earliest,
         test_large_capacity_is_dropless_and_bitwise, test_dropped_tokens_get_zero_output,
         test_padding_and_alignment_change_nothing, test_config_validation]

if __name__ == "__main__":
    run(TESTS)
