"""Router losses, aux-loss-free balancing, fp32 router and load telemetry.

    python scripts/test_router.py
"""
import contextlib
import os
import warnings

import torch
import torch.nn.functional as F

import testlib
from testlib import SHARED, Skip, run  # noqa: F401
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM, MOEFeedForward
from model.router import (layer_mean, minimind_aux_loss, router_z_loss, sequence_aux_loss, switch_aux_loss,
                          tokens_per_expert)

D = 16
COEF = 0.01


def route_only(mod, x_TD):
    """(topk_idx_TK, topk_weight_TK) of the layer's router, without the side effects a training-mode
    route() has (it sets aux_loss and adds to the load)."""
    was_training = mod.training
    mod.eval()
    try:
        with torch.no_grad():
            idx, w, _, _ = mod.route(x_TD)
    finally:
        mod.train(was_training)
    return idx, w


def balanced_routing(T, K, E):
    """[T, K] distinct experts per token, every expert chosen exactly T*K/E times."""
    return torch.tensor([[(t * K + j) % E for j in range(K)] for t in range(T)])


def test_switch_loss_is_coef_when_balanced():
    """Switch k-normalised: exactly coef for balanced routing at every k (MiniMind's gives coef * k)."""
    E, T = 8, 64
    for K in (1, 2, 4):
        idx = balanced_routing(T, K, E)
        uniform = torch.full((T, E), 1.0 / E)
        assert switch_aux_loss(uniform, idx, E, COEF).item() == torch.tensor(COEF).item(), K
        scores = torch.softmax(torch.randn(T, E), -1)  # any router probabilities: sum_e P_e = 1
        got = switch_aux_loss(scores, idx, E, COEF).item()
        assert abs(got - COEF) <= 1e-6 * COEF, (K, got)  # fp32 rounding of sum_e P_e
        seq = sequence_aux_loss(scores.view(4, 16, E), idx.view(4, 16, K), E, COEF).item()
        assert abs(seq - COEF) <= 1e-6 * COEF, (K, seq)
        mm = minimind_aux_loss(uniform, idx, E, COEF).item()
        assert abs(mm - K * COEF) <= 1e-6 * K * COEF, (K, mm)


def test_minimind_default_is_bitwise_minimind():
    """The default loss is MiniMind's formula (F.one_hot version) bit for bit, incl. through the layer."""
    torch.manual_seed(0)
    E, K, T = 8, 2, 40
    scores = torch.softmax(torch.randn(T, E), -1)
    idx = torch.topk(scores, K, -1).indices
    one_hot = F.one_hot(idx, num_classes=E).float()
    want = (one_hot.mean(0) * scores.mean(0)).sum() * E * COEF
    assert torch.equal(minimind_aux_loss(scores, idx, E, COEF), want)
    mod = layer(E, K, router_aux_loss_coef=COEF)
    x = torch.randn(2, 20, D)
    mod(x)
    aux = mod.aux_loss
    idx, _ = route_only(mod, x.view(-1, D))
    s = torch.softmax(mod.gate(x.view(-1, D)), -1)
    want = (F.one_hot(idx, num_classes=E).float().mean(0) * s.mean(0)).sum() * E * COEF
    assert torch.equal(aux, want)


def layer(E, K, seed=0, **kw):
    torch.manual_seed(seed)
    return MOEFeedForward(MiniMindConfig(hidden_size=D, num_attention_heads=1, num_key_value_heads=1, head_dim=8,
                                         use_moe=True, num_experts=E, num_experts_per_tok=K,
                                         moe_intermediate_size=24, **kw)).train()


VARIANTS = [dict(router_aux_loss_type=t, router_aux_loss_coef=COEF) for t in ("minimind", "switch", "sequence")] + [
    dict(router_aux_loss_type="none", router_z_loss_coef=1e-3),
    dict(router_aux_loss_type="switch", router_aux_loss_coef=COEF, router_z_loss_coef=1e-3, router_bias_update_rate=0.01),
    dict(router_aux_loss_type="sequence", router_aux_loss_coef=COEF, moe_impl="fused", capacity_factor=1.5),
]


def padded_batch(mod, lengths, S):
    """[B, S, D] inputs whose first lengths[b] positions are real and the rest padding built to route to
    expert 0 (aligned with gate row 0), the mask, and each sequence's real part alone [1, L_b, D]."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(lengths), S, D, generator=g)
    mask = torch.zeros(len(lengths), S, dtype=torch.bool)
    row0 = mod.gate.weight[0].detach()
    for b, n in enumerate(lengths):
        mask[b, :n] = True
        x[b, n:] = 50.0 * row0 / row0.norm()
    return x, mask, [x[b:b + 1, :n] for b, n in enumerate(lengths)]


def test_padding_changes_no_loss_and_no_load():
    """Padded positions that all route to one expert leave every loss variant, the load counts and the
    bias update unchanged, and the real tokens' outputs too. Tolerance for the losses: 1e-6 relative (the
    masked means sum zeros in other positions, which can only reassociate the fp32 sums)."""
    for kw in VARIANTS:
        mod = layer(8, 2, **kw)
        x, mask, parts = padded_batch(mod, [11, 7], S=16)
        pad_routes = route_only(mod, x[0, 11:])[0]
        assert (pad_routes == 0).any(dim=-1).all(), "padding must route to expert 0 for this test to mean anything"
        y = mod(x, token_mask=mask)
        loss_padded, z_padded, load_padded = mod.aux_loss.detach(), mod.stats.z_loss, mod.pop_load()
        if kw["router_aux_loss_type"] == "sequence":  # per sequence: the unpadded reference is each alone
            per_seq, loads = [], []
            for p in parts:
                y_p = mod(p)
                per_seq.append(mod.aux_loss.detach() - (mod.stats.z_loss if mod.stats.z_loss is not None else 0))
                loads.append(mod.pop_load())
            want_loss = torch.stack(per_seq).mean()
            got_loss = loss_padded - (z_padded if z_padded is not None else 0)
            want_load = sum(loads)
        else:
            flat = torch.cat([p.reshape(-1, D) for p in parts]).unsqueeze(0)
            y_p = mod(flat)
            want_loss, want_load, got_loss = mod.aux_loss.detach(), mod.pop_load(), loss_padded
        assert abs(got_loss.item() - want_loss.item()) <= 1e-6 * max(abs(want_loss.item()), 1e-12), (kw, got_loss, want_loss)
        assert torch.equal(load_padded, want_load), (kw, load_padded, want_load)
        if kw["router_aux_loss_type"] != "sequence":
            real = y[mask].view(-1, D)
            assert torch.allclose(real, y_p.view(-1, D), atol=1e-6), kw
        if mod.expert_bias is not None:
            mod.update_expert_bias(load_padded)
            padded_bias = mod.expert_bias.clone()
            mod.expert_bias.zero_()
            mod.update_expert_bias(want_load)
            assert torch.equal(padded_bias, mod.expert_bias)


def test_nan_at_padded_position_leaves_losses_finite():
    """NaN and Inf placed at padded positions: every loss variant, the load and the real tokens' outputs are
    bitwise those of the same batch with finite padding (the mask selects, it does not multiply by 0)."""
    for kw in VARIANTS + [dict(router_aux_loss_type="minimind", router_aux_loss_coef=COEF, moe_impl="fused")]:
        mod = layer(8, 2, **kw)
        x, mask, _ = padded_batch(mod, [11, 7], S=16)
        y = mod(x, token_mask=mask)
        want_loss, want_load = mod.aux_loss.detach(), mod.pop_load()
        x_bad = x.clone()
        x_bad[0, 11:] = float("nan")
        x_bad[1, 7:] = float("inf")
        y_bad = mod(x_bad, token_mask=mask)
        assert torch.isfinite(mod.aux_loss).all(), kw
        assert torch.equal(mod.aux_loss.detach(), want_loss), (kw, mod.aux_loss, want_loss)
        assert torch.equal(mod.pop_load(), want_load), kw
        assert torch.equal(y_bad[mask], y[mask]), kw


def test_no_cancellation_across_layers():
    """Two layers with opposite imbalances give a larger loss than a balanced pair; pooling both layers'
    routing into one loss (what per-layer averaging avoids) would call them balanced."""
    E, T = 2, 32
    to0, to1 = torch.zeros(T, 1, dtype=torch.long), torch.ones(T, 1, dtype=torch.long)
    p0 = torch.tensor([[0.9, 0.1]]).expand(T, E)
    p1 = torch.tensor([[0.1, 0.9]]).expand(T, E)
    half = torch.cat([to0[:T // 2], to1[T // 2:]])
    for fn in (switch_aux_loss, minimind_aux_loss):
        skewed = layer_mean([fn(p0, to0, E, COEF), fn(p1, to1, E, COEF)], p0)
        balanced = layer_mean([fn(torch.full((T, E), 0.5), half, E, COEF)] * 2, p0)
        pooled = fn(torch.cat([p0, p1]), torch.cat([to0, to1]), E, COEF)
        assert skewed > 1.5 * balanced, (fn.__name__, skewed, balanced)
        assert abs(pooled - balanced) < 1e-7, "pooled routing hides the imbalance"
    # and the model averages its layers' losses
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(vocab_size=64, hidden_size=D, num_hidden_layers=3, num_attention_heads=2,
                                               num_key_value_heads=1, use_moe=True, num_experts=4,
                                               num_experts_per_tok=2, moe_intermediate_size=24,
                                               router_aux_loss_type="switch")).train()
    out = model(torch.randint(0, 64, (2, 12)))
    per_layer = [blk.mlp.aux_loss for blk in model.model.layers]
    assert torch.allclose(out.aux_loss, sum(per_layer) / 3)


def router_grads_after(model, batch, grad_accum, repeats):
    """The router grads after `repeats` micro-steps of the training loop (train.loop.forward_backward,
    single process) on `batch`, accumulated with --grad_accum `grad_accum`."""
    from types import SimpleNamespace
    from train.loop import forward_backward
    model.zero_grad(set_to_none=True)
    run = SimpleNamespace(args=SimpleNamespace(grad_accum=grad_accum), ctx=SimpleNamespace(world_size=1),
                          device=torch.device("cpu"), autocast=contextlib.nullcontext, train_model=model)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    x, y = batch[:, :-1], batch[:, 1:]
    n_global = int((y != -100).sum()) * repeats  # every micro-step's supervised tokens
    for _ in range(repeats):
        forward_backward(run, scaler, n_global, x, y)
    return [blk.mlp.gate.weight.grad.clone() for blk in model.model.layers]


def test_grad_accumulation_scales_aux_once():
    """The same micro-batch M times with M accumulation steps gives one step's router gradient (within
    fp32 rounding of the 1/M split: 1e-6 relative, elementwise), for every aux variant. Measured: bitwise
    (4 seeds x 5 variants): for M = 2, 4 the 1/M scaling is exact and adding M equal gradients rounds back to
    the one-step value but at rare ties (1 ulp, 1.2e-7 relative)."""
    for kw in VARIANTS[:5]:
        torch.manual_seed(0)
        model = MiniMindForCausalLM(MiniMindConfig(vocab_size=64, hidden_size=D, num_hidden_layers=2,
                                                   num_attention_heads=2, num_key_value_heads=1, use_moe=True,
                                                   num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                                   **kw)).train()
        batch = torch.randint(0, 64, (3, 13))
        one = router_grads_after(model, batch, 1, 1)
        for M in (2, 4):
            acc = router_grads_after(model, batch, M, M)
            for a, b in zip(one, acc):
                rel = ((a - b).abs() / a.abs()).nan_to_num(0.0).max().item()  # (0/0: both exactly 0)
                assert torch.allclose(b, a, rtol=1e-6, atol=0.0), f"{kw} M={M}: relative difference {rel:.2e} > 1e-6"


def test_bias_steers_selection_not_weights():
    mod = layer(4, 2, router_bias_update_rate=0.1)
    x = torch.randn(1, 30, D)
    with torch.no_grad():
        mod.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 10.0]))
        scores1 = torch.softmax(mod.router_logits(x[0]), -1)
    idx1, w1 = route_only(mod, x[0])
    assert torch.equal(idx1.sort(-1).values, torch.tensor([[0, 3]] * 30)), "bias decides the selection"
    want = scores1.gather(-1, idx1)
    assert torch.allclose(w1, want / want.sum(-1, keepdim=True)), "weights are the unbiased scores"
    # update direction: overloaded experts go down, underloaded up
    mod.expert_bias.zero_()
    mod.update_expert_bias(torch.tensor([10, 0, 5, 5]))
    assert mod.expert_bias.tolist() == [-0.1, 0.1, 0.0, 0.0] or torch.allclose(
        mod.expert_bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))
    assert "expert_bias" in mod.state_dict() and "expert_bias" not in layer(4, 2).state_dict()


def test_bias_balances_a_collapsed_router():
    """Aux-loss-free balancing alone (no loss term) spreads a router that sends everything to one expert."""
    mod = layer(4, 1, router_bias_update_rate=0.05, router_aux_loss_type="none")
    with torch.no_grad():
        mod.gate.weight.zero_()
        mod.gate.weight[0, 0] = 1.0
    x = torch.randn(1, 256, D)
    x[..., 0] = x[..., 0].abs() + 0.5  # expert 0 always wins without a bias
    first = None
    for _ in range(60):
        with torch.no_grad():
            mod(x)
        load = mod.pop_load()
        first = load if first is None else first
        mod.update_expert_bias(load)
    assert first.max() == 256 and load.max() < 0.5 * 256, (first, load)


def test_fp32_router_under_autocast():
    mod = layer(8, 2, router_dtype="float32")
    ref = layer(8, 2)
    x = torch.randn(2, 10, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = mod.router_logits(x.view(-1, D))
        ref_logits = ref.router_logits(x.view(-1, D))
        mod(x)
    assert logits.dtype == torch.float32 and ref_logits.dtype == torch.bfloat16
    assert torch.equal(logits, F.linear(x.view(-1, D), mod.gate.weight))


def test_z_loss_formula():
    logits = torch.randn(10, 4)
    mask = torch.tensor([True] * 7 + [False] * 3)
    want = 1e-3 * (torch.logsumexp(logits[:7], -1) ** 2).mean()
    assert torch.allclose(router_z_loss(logits, 1e-3, mask), want)


def test_tokens_per_expert_skips_padding_and_drops():
    idx = torch.tensor([[0, 1], [1, -1], [2, 3], [0, 0]])
    mask = torch.tensor([True, True, True, False])
    assert tokens_per_expert(idx, 4, mask).tolist() == [1, 2, 1, 1]


def test_warns_when_router_gets_no_lm_gradient():
    import model.moe as moe_module
    moe_module._warned_no_router_grad = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer(4, 1)(torch.randn(1, 3, D))
        layer(4, 1)(torch.randn(1, 3, D))
    msgs = [str(w.message) for w in caught if "no gradient from the language-model loss" in str(w.message)]
    assert len(msgs) == 1, msgs


def test_training_logs_load_and_draws_heatmap():
    """A tiny run with switch loss + z-loss + bias: per-layer load fields in metrics.jsonl, a heatmap PNG,
    and the bias buffers in the checkpoint; the export refuses the selection bias by name."""
    import json
    from train.pretrain import parse_args, train
    out = testlib.scratch_dir("test_router_")
    args = ["--hidden_size", "32", "--num_hidden_layers", "2", "--num_attention_heads", "2", "--num_key_value_heads", "1",
            "--num_experts", "4", "--num_experts_per_tok", "2", "--moe_intermediate_size", "32", "--seq_len", "32",
            "--batch_size", "4", "--vocab_size", "512", "--eval_tokens", "512", "--max_steps", "6", "--log_interval", "3",
            "--eval_interval", "6", "--no_progress", "--sample_tokens", "0", "--router_aux_loss_type", "switch",
            "--router_z_loss_coef", "1e-3", "--router_bias_update_rate", "1e-2", "--out_dir", out]
    text = os.path.join(SHARED, "data", "tinyshakespeare.txt")  # (else the embedded corpus, built once per suite)
    s = train(parse_args(args + (["--data_path", text] if os.path.exists(text) else [])), log=lambda *_: None)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    logged = [r for r in rows if "expert_load" in r]
    assert [r["step"] for r in logged] == [3, 6]
    for r in logged:
        assert len(r["expert_load"]) == 2 and all(abs(sum(row) - 1) < 1e-3 for row in r["expert_load"])
        assert len(r["load_max_over_mean"]) == 2 and len(r["idle_experts"]) == 2
    assert os.path.getsize(os.path.join(out, "expert_load.png")) > 0 and len(s["expert_load"]) == 2
    state = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)["model"]
    biases = [k for k in state if k.endswith("expert_bias")]
    assert len(biases) == 2 and any(state[k].abs().sum() > 0 for k in biases)
    from model.hf_adapter import ExportError, check_exportable
    from train.checkpoint import load_checkpoint, model_from_checkpoint
    try:
        check_exportable(model_from_checkpoint(load_checkpoint(out)).config)
    except ExportError as e:
        assert "router_bias_update_rate" in str(e)
    else:
        raise AssertionError("a model with a selection bias was accepted for export")


TESTS = [test_switch_loss_is_coef_when_balanced, test_minimind_default_is_bitwise_minimind,
         test_padding_changes_no_loss_and_no_load, test_nan_at_padded_position_leaves_losses_finite,
         test_no_cancellation_across_layers,
         test_grad_accumulation_scales_aux_once, test_bias_steers_selection_not_weights,
         test_bias_balances_a_collapsed_router, test_fp32_router_under_autocast, test_z_loss_formula,
         test_tokens_per_expert_skips_padding_and_drops, test_warns_when_router_gets_no_lm_gradient,
         test_training_logs_load_and_draws_heatmap]

if __name__ == "__main__":
    run(TESTS)
