"""Sorted-dispatch MoE layer vs the masked per-expert reference: bitwise equality, syncs, edge cases.

    python scripts/test_moe_sorted.py [name-filter ...]
"""
import os
import subprocess
import sys
import warnings
from functools import partial

import torch
import torch.nn.functional as F

from testlib import ROOT, SHARED, Skip, run
from moe_reference import masked_layer_forward, reference_masked_forward
from sync_count import SyncCounter, count_syncs
from model.model_minimind import MiniMindConfig, MOEFeedForward


def build(seed=0, **kw):
    cfg = dict(hidden_size=64, use_moe=True, num_experts=4, num_experts_per_tok=1, moe_intermediate_size=128)
    cfg.update(kw)
    torch.manual_seed(seed)
    return MOEFeedForward(MiniMindConfig(**cfg))


def forced_input(mod, assign, hidden_size=64):
    """x such that token t routes (top-1) to expert assign[t]: identity gate, a large entry at that expert."""
    with torch.no_grad():
        mod.gate.weight.zero_()
        for e in range(mod.config.num_experts):
            mod.gate.weight[e, e] = 1.0
    x = torch.zeros(1, len(assign), hidden_size)
    for t, e in enumerate(assign):
        x[0, t, e] = 10.0
    return x


def run_both(mod, x):
    """Forward + backward of reference and sorted layer on clones of x; returns (ref, ours) dicts."""
    res = []
    for fn in (lambda t: reference_masked_forward(mod, t), mod):
        xi = x.clone().requires_grad_()
        y = fn(xi)
        (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()  # non-uniform upstream grad
        res.append({"y": y.detach(), "x_grad": xi.grad,
                    "grads": {n: None if p.grad is None else p.grad.clone() for n, p in mod.named_parameters()}})
        mod.zero_grad(set_to_none=True)
    return res


def assert_same(ref, ours, k, what):
    assert torch.equal(ref["y"], ours["y"]), f"{what}: forward differs (max {(ref['y'] - ours['y']).abs().max():.3e})"
    if k <= 2:
        assert torch.equal(ref["x_grad"], ours["x_grad"]), f"{what}: input grad not bitwise"
    else:  # K >= 3 summands per token: autograd adds the experts' input grads in another order (<= ~1 ulp)
        rel = (ref["x_grad"] - ours["x_grad"]).abs().max() / ref["x_grad"].abs().max().clamp_min(1e-30)
        assert rel < 1e-6, f"{what}: input grad rel diff {rel:.2e}"
    for n, g in ref["grads"].items():
        o = ours["grads"][n]
        assert (g is None) == (o is None), f"{what} {n}: grad presence differs (ref {g is None}, ours {o is None})"
        if g is not None:
            assert torch.equal(g, o), f"{what} {n}: param grad not bitwise"


def test_bitwise_vs_masked_reference():
    """Forward and parameter grads bitwise for every (E, k), train and eval, norm_topk_prob on/off."""
    for e, k in ((1, 1), (2, 1), (3, 2), (4, 1), (4, 2), (4, 3), (4, 4), (5, 3), (8, 2), (8, 8), (16, 4)):
        for norm in (True, False):
            mod = build(seed=3, num_experts=e, num_experts_per_tok=k, norm_topk_prob=norm)
            torch.manual_seed(21)
            x = torch.randn(3, 11, 64)
            for train in (True, False):
                mod.train(train)
                assert_same(*run_both(mod, x), k, f"E={e} k={k} norm={norm} train={train}")


def test_odd_hidden_and_intermediate_sizes():
    """Odd sizes, and the layout-ambiguous ones where a transposed or mis-split expert weight still fits
    (2F == D, F == D: unsloth-zoo 849's grouped GEMM trained on transposed weights there)."""
    for h, f, e, k in ((37, 19, 3, 2), (65, 7, 7, 1), (1, 1, 2, 2), (64, 32, 4, 2), (32, 32, 4, 2)):
        mod = build(seed=4, hidden_size=h, num_attention_heads=1, num_key_value_heads=1, head_dim=8, moe_intermediate_size=f,
                    num_experts=e, num_experts_per_tok=k)
        torch.manual_seed(5)
        x = torch.randn(2, 9, h)
        for train in (True, False):
            mod.train(train)
            assert_same(*run_both(mod, x), k, f"H={h} F={f} E={e} k={k} train={train}")


def test_idle_experts_and_tiny_batches():
    """Experts with no tokens, every token to one expert, fewer tokens than experts, a single token."""
    cases = {"idle experts": [0, 1, 0, 1, 0, 1], "all to expert 0": [0] * 6, "batch < E": [1, 2], "one token": [3]}
    for name, assign in cases.items():
        for train in (True, False):
            mod = build(seed=5).train(train)
            x = forced_input(mod, assign)
            assert_same(*run_both(mod, x), 1, f"{name} train={train}")


def test_zero_token_grads_train_vs_eval():
    """Train and eval: an idle expert's share of the stacked weights' gradient is zero, and every parameter
    has a gradient (DDP find_unused_parameters=False)."""
    for train in (True, False):
        mod = build(seed=5).train(train)
        mod(forced_input(mod, [0] * 6)).sum().backward()
        assert all(p.grad is not None for p in mod.parameters()), f"train={train}: some parameter has no grad"
        assert all(torch.count_nonzero(p.grad[0]) > 0 for p in mod.experts.parameters()), f"train={train}: expert 0"
        for e in (1, 2, 3):
            assert all(torch.count_nonzero(p.grad[e]) == 0 for p in mod.experts.parameters()), f"expert {e} grad != 0"


def test_empty_input():
    """B*S = 0 tokens: an empty output, and in training still zero grads for every expert."""
    for shape in ((0, 5, 64), (2, 0, 64)):
        for train in (True, False):
            mod = build(seed=1, num_experts_per_tok=2).train(train)
            x = torch.randn(*shape, requires_grad=True)
            y = mod(x)
            assert y.shape == x.shape
            if train:
                y.sum().backward()
                assert all(p.grad is not None and torch.count_nonzero(p.grad) == 0 for p in mod.experts.parameters())
            assert torch.equal(y, reference_masked_forward(mod.eval(), x.detach())), "eval reference differs"


def test_bf16_on_cpu():
    """bf16 autocast on CPU (bf16 logits, fp32 softmax) and a bf16 module: still bitwise."""
    mod = build(seed=3, num_experts=8, num_experts_per_tok=2)
    torch.manual_seed(21)
    x = torch.randn(4, 16, 64)
    for train in (True, False):
        mod.train(train)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref, ours = run_both(mod, x)
        assert ours["y"].dtype == torch.float32
        assert_same(ref, ours, 2, f"autocast bf16 train={train}")
    mod = mod.to(torch.bfloat16)
    ref, ours = run_both(mod, x.to(torch.bfloat16))
    assert ours["y"].dtype == torch.bfloat16
    assert_same(ref, ours, 2, "bf16 module")


def test_aux_loss_and_state_dict():
    """aux_loss is MiniMind's formula bit for bit (k = 1, 2) and state_dict keys are the reference's."""
    for k in (1, 2):
        mod = build(seed=7, num_experts_per_tok=k).train()
        torch.manual_seed(11)
        x = torch.randn(2, 16, 64)
        mod(x)
        scores = F.softmax(mod.gate(x.view(-1, 64)), dim=-1)
        _, topk_idx = torch.topk(scores, k=k, dim=-1, sorted=False)
        load = F.one_hot(topk_idx, 4).float().mean(0)
        want = (load * scores.mean(0)).sum() * 4 * mod.config.router_aux_loss_coef
        assert torch.equal(mod.aux_loss, want), f"k={k}: aux_loss {mod.aux_loss} != {want}"
    mod.eval()
    mod(x)
    assert mod.aux_loss.item() == 0.0, "eval aux_loss must be 0"
    expect = {"gate.weight"} | {f"experts.{i}.{p}_proj.weight" for i in range(4) for p in ("gate", "up", "down")}
    assert set(mod.state_dict()) == expect, f"state_dict keys changed: {sorted(mod.state_dict())}"


def test_single_sync_per_layer():
    """At most one sync-inducing call per forward (the tokens_per_expert read) for every E, k, mode,
    including a batch where most experts get no tokens; the masked reference needs ~3 per active expert."""
    torch.manual_seed(0)
    for e in (1, 4, 8, 16, 64):
        for k in (1, 2, 4):
            if k > e:
                continue
            mod = build(seed=e, num_experts=e, num_experts_per_tok=k, hidden_size=32, moe_intermediate_size=16)
            for train in (True, False):
                mod.train(train)
                for x in (torch.randn(2, 24, 32), torch.randn(1, 2, 32)):  # the second leaves experts idle
                    _, n = count_syncs(mod, x)
                    assert n <= 1, f"E={e} k={k} train={train} T={x.shape[1]}: {n} syncs"
                    _, n_ref = count_syncs(lambda t: reference_masked_forward(mod, t), x)
                    active = int((mod.stats.tokens_per_expert > 0).sum())
                    assert n_ref == e + 2 * active, f"reference: {n_ref} syncs, expected E + 2*active"
    mod = build(seed=0, num_experts=4)
    with SyncCounter() as c:
        mod(torch.randn(2, 8, 64))
    assert c.ops == ["Tensor.tolist"], c.ops


def test_sync_counter_sees_known_syncs():
    """The counter itself: each known sync pattern is seen (so a zero above means something)."""
    t = torch.tensor([0, 3, 0, 2])
    for name, fn, want in [("item", lambda: t[1].item(), 1), ("bool", lambda: bool(t.any()), 1),
                           ("nonzero", lambda: t.nonzero(), 1), ("bool index", lambda: t[t > 0], 1),
                           ("masked_select", lambda: t.masked_select(t > 0), 1), ("unique", lambda: t.unique(), 1),
                           ("repeat_interleave", lambda: torch.repeat_interleave(t), 1),
                           ("tolist", lambda: t.tolist(), 1), ("one_hot", lambda: F.one_hot(t, 4), 2),
                           ("tolist of a tensor made from a list", lambda: torch.tensor([0, 3]).tolist(), 0),
                           ("sort/gather", lambda: t.sort().values.gather(0, t.argsort()), 0)]:
        _, n = count_syncs(fn)
        assert n == want, f"{name}: counted {n}, expected {want}"


def test_deterministic():
    mod = build(seed=9, num_experts=8, num_experts_per_tok=3).train()
    x = torch.randn(4, 32, 64)
    a, b = run_both(mod, x)[1], run_both(mod, x)[1]
    assert torch.equal(a["y"], b["y"]) and torch.equal(a["x_grad"], b["x_grad"])
    assert all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"])


def test_cuda_bitwise_and_syncs():
    """On CUDA: fp32 and bf16 autocast bitwise, one sync per forward by torch.cuda sync debug mode."""
    if not torch.cuda.is_available():
        raise Skip("needs CUDA")
    for e, k in ((4, 1), (8, 2), (16, 4)):
        mod = build(seed=3, num_experts=e, num_experts_per_tok=k).cuda().train()
        x = torch.randn(4, 128, 64, device="cuda")
        assert torch.equal(reference_masked_forward(mod, x), mod(x)), f"E={e} k={k}: CUDA fp32"
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert torch.equal(reference_masked_forward(mod, x), mod(x)), f"E={e} k={k}: CUDA bf16"
        mod(x)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            mod(x)
        torch.cuda.set_sync_debug_mode("default")
        n = sum("sync" in str(r.message).lower() for r in w)
        assert n == 1, f"E={e}: {n} CUDA syncs"


# zero-padded row blocks (moe_pad_to_capacity) change the experts' GEMM blocking: a few fp32 ulps of the largest value
PAD_REL_TOL = 1e-6


def assert_close_to_largest(ref, ours, rel_tol, what):
    """run_both's dicts: output, x's grad and every parameter's grad within rel_tol of the reference's largest
    |value| (the same grads present)."""
    pairs = [("y", ref["y"], ours["y"]), ("x grad", ref["x_grad"], ours["x_grad"])]
    for n, g in ref["grads"].items():
        o = ours["grads"][n]
        assert (g is None) == (o is None), f"{what} {n}: grad presence differs (ref {g is None}, ours {o is None})"
        if g is not None:
            pairs.append((f"grad {n}", g, o))
    for name, want, got in pairs:
        rel = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
        assert rel <= rel_tol, f"{what} {name}: {rel:.2e} of the largest |value| > {rel_tol}"


def test_masked_layer_equals_sorted():
    """The sorted layer against moe_reference.masked_layer_forward, which recomputes every option from the
    layer's gate weight, expert_bias and config alone (its own routing, balance losses, z-loss, capacity
    policy and counts; nothing of model/router.py or model/dispatch.py), CPU fp32: output and grads bitwise
    (x's grad within 1 ulp for k >= 3, as assert_same), the same aux loss bit for bit, the same routed-pair
    counts and router load, with padding tokens, capacity dropping (both policies), aux-loss-free bias, the
    balance loss types, z-loss, routed scaling, an fp32 router and a shared expert. With moe_pad_to_capacity
    the sorted experts run on zero-padded row blocks, which changes the GEMMs' blocking and so their summation
    order: output, x's grad and every parameter's grad within PAD_REL_TOL of the largest |value| there
    (measured <= 3.1e-7 on the output, 1.2e-7 on the gate's grad, the experts' grads bitwise)."""
    cases = [dict(num_experts=4, num_experts_per_tok=2), dict(num_experts=8, num_experts_per_tok=1),
             dict(num_experts=8, num_experts_per_tok=3, router_aux_loss_type="sequence", router_z_loss_coef=1e-3),
             dict(num_experts=4, num_experts_per_tok=2, capacity_factor=0.75, moe_drop_policy="position",
                  router_aux_loss_type="switch", router_bias_update_rate=1e-2),
             dict(num_experts=4, num_experts_per_tok=2, capacity_factor=0.5, norm_topk_prob=False,
                  routed_scaling_factor=2.0, router_dtype="float32", router_z_loss_coef=1e-3),
             dict(num_experts=8, num_experts_per_tok=2, router_aux_loss_type="none", router_bias_update_rate=1e-2,
                  n_shared_experts=1),
             dict(num_experts=4, num_experts_per_tok=2, capacity_factor=1.0, moe_pad_to_capacity=True)]
    torch.manual_seed(21)
    x = torch.randn(3, 11, 64)
    mask = torch.ones(3, 11, dtype=torch.bool)
    mask[0, 8:] = mask[2, :3] = False  # right and left padding
    for kw in cases:
        sorted_mod, masked = build(seed=3, **kw), build(seed=3, **kw)
        if sorted_mod.expert_bias is not None:
            sorted_mod.expert_bias.copy_(torch.linspace(-0.05, 0.05, kw["num_experts"]))
        masked.load_state_dict(sorted_mod.state_dict())
        for train in (True, False):
            res, seen = [], []
            for mod, forward in ((sorted_mod.train(train), sorted_mod), (masked.train(train), partial(masked_layer_forward, masked))):
                xi = x.clone().requires_grad_()
                y = forward(xi, token_mask=mask)
                loss = (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum() + mod.aux_loss
                loss.backward()
                res.append({"y": y.detach(), "x_grad": xi.grad,
                            "grads": {n: None if p.grad is None else p.grad.clone() for n, p in mod.named_parameters()}})
                seen.append((mod.aux_loss.detach(), mod.stats.tokens_per_expert, mod.pop_load()))
                mod.zero_grad(set_to_none=True)
            what = f"{kw} train={train}"
            if kw.get("moe_pad_to_capacity"):
                assert_close_to_largest(res[1], res[0], PAD_REL_TOL, what)
            else:
                assert_same(*res, kw["num_experts_per_tok"], what)
            # padding goes to no routed expert: its output is 0, or the shared expert's alone
            pad_out = (torch.zeros_like(res[0]["y"][~mask]) if sorted_mod.shared_experts is None else
                       sorted_mod.shared_experts(x.reshape(-1, 64)).detach()[~mask.reshape(-1)])
            assert torch.equal(res[0]["y"][~mask], pad_out), f"{what}: padding output"
            (aux_s, tpe_s, load_s), (aux_m, tpe_m, load_m) = seen
            if kw.get("capacity_factor", 1.0) < 1.0:  # (so the drop policy is exercised)
                assert int(tpe_m.sum()) < int(mask.sum()) * kw["num_experts_per_tok"], f"{what}: nothing dropped"
            assert torch.equal(aux_s, aux_m), f"{what}: aux loss {aux_s.item()!r} != reference {aux_m.item()!r}"
            assert torch.equal(tpe_s, tpe_m), f"{what}: routed pairs per expert {tpe_s.tolist()} != {tpe_m.tolist()}"
            assert (load_s is None) == (load_m is None) and (load_s is None or torch.equal(load_s, load_m)), \
                f"{what}: router load {load_s} != reference {load_m}"


def test_trainer_engines_keep_sorted_layer():
    """train.engines.engines_for gives the sorted layer its plain experts engine (model/moe.py: expert_loop)
    and dispatcher on CPU under fp32 and bf16: the layer the trainer builds is still bitwise the masked
    reference, with one sync."""
    from train.engines import engines_for
    from testlib import rebuilt
    from model.dispatch import SortedDispatcher
    from model.moe import expert_loop
    plain = build(seed=3, num_experts=8, num_experts_per_tok=2).train()
    for dtype in (torch.float32, torch.bfloat16):
        mod = rebuilt(plain, engines_for(plain.config, "cpu", dtype))
        assert mod.experts.engine is expert_loop and type(mod.dispatcher) is SortedDispatcher, (dtype, mod)
    torch.manual_seed(21)
    assert_same(*run_both(mod, torch.randn(3, 11, 64)), 2, "built with the trainer's engines")
    _, n = count_syncs(torch.nn.Sequential(mod), torch.randn(2, 8, 64))
    assert n == 1, f"{n} syncs with the trainer's engines"


def test_user_acceptance_file():
    """The user's own acceptance test (../shared/acceptance/test_moe_sorted.py), when it is present."""
    path = os.path.join(SHARED, "acceptance", "test_moe_sorted.py")
    if not os.path.exists(path):
        raise Skip(f"{path} not present")
    r = subprocess.run([sys.executable, path], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print("        acceptance:", r.stdout.strip().splitlines()[-1])


TESTS = [test_bitwise_vs_masked_reference, test_odd_hidden_and_intermediate_sizes, test_idle_experts_and_tiny_batches,
         test_zero_token_grads_train_vs_eval, test_empty_input, test_bf16_on_cpu, test_aux_loss_and_state_dict,
         test_single_sync_per_layer, test_sync_counter_sees_known_syncs, test_deterministic,
         test_cuda_bitwise_and_syncs, test_masked_layer_equals_sorted, test_trainer_engines_keep_sorted_layer,
         test_user_acceptance_file]

if __name__ == "__main__":
    run(TESTS)
