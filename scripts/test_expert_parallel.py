"""Expert parallelism over 2 and 4 gloo processes on CPU, checked against the single-process layer.

    python scripts/test_expert_parallel.py

The EP dispatcher (train/parallel.py: AllToAllDispatcher, `install`) wraps the layer's own dispatcher, so
every expert engine runs under EP (ENGINES): "sorted" (moe_impl="sorted"), and moe_impl="fused" as the
plain layer ("plain": the plain permute / combine and model/moe.py's expert_loop) and built with
train.engines.engines_for's engines (what the trainer runs: "cpu", kernels/experts.py's CPU expert GEMMs with
the plain permute / combine) or with the grouped-GEMM experts engine ("grouped",
GROUPED_EXPERTS["torch"]). The trainer builds the layers with their engines, then installs EP; so do these
tests. Gradients are compared per expert, under the state_dict's names (`named_grads`).
"""
import contextlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from testlib import ROOT, Skip, run, spawn_ranks as spawn  # noqa: F401
from model.dispatch import SortedDispatcher
from model.moe import local_shard
from model.model_minimind import MiniMindConfig, MOEFeedForward

D = 32
ENGINES = ("sorted", "plain", "cpu", "grouped")


def build(e, k, seed=0, moe_impl="sorted", **kw):
    torch.manual_seed(seed)
    return MOEFeedForward(MiniMindConfig(hidden_size=D, num_attention_heads=1, num_key_value_heads=1, head_dim=8,
                                         use_moe=True, num_experts=e, num_experts_per_tok=k,
                                         moe_intermediate_size=16, moe_impl=moe_impl, **kw)).train()


def make(e, k, engine, seed=0, **kw):
    """The layer that runs `engine` (ENGINES), same weights for every engine."""
    mod = build(e, k, seed, "sorted" if engine == "sorted" else "fused", **kw)
    if engine in ("cpu", "grouped"):
        import dataclasses

        from train.engines import describe, engines_for
        from testlib import rebuilt
        from kernels.experts import GROUPED_EXPERTS, cpu_experts_rows_in_place
        engines = engines_for(mod.config, "cpu", torch.float32)
        if engine == "cpu" and engines.experts is not cpu_experts_rows_in_place:
            raise Skip("the CPU expert GEMMs do not run here (no oneDNN)")
        if engine == "grouped":
            engines = dataclasses.replace(engines, experts=GROUPED_EXPERTS["torch"])
        mod = rebuilt(mod, engines)
        want = "cpu_experts_rows_in_place" if engine == "cpu" else "grouped_experts_torch"
        assert describe(mod) == f"engines: {want} x1", describe(mod)
    return mod


@contextlib.contextmanager
def engine_choice(engine):
    """Check on leaving that the layers built for `engine` ran its expert GEMMs (the CPU engine's
    CPUExperts, the grouped engine's GroupedSwiGLU) and no other; "sorted" and "plain" neither."""
    from unittest import mock

    import kernels.experts as experts_module
    calls = {"CPUExperts": 0, "GroupedSwiGLU": 0}

    def counting(n, f):
        def counted(*args, **kwargs):
            calls[n] += 1
            return f(*args, **kwargs)
        return counted

    with contextlib.ExitStack() as patches:
        for n in calls:
            cls = getattr(experts_module, n)
            patches.enter_context(mock.patch.object(cls, "forward", staticmethod(counting(n, cls.forward))))
        yield
    want = {"cpu": "CPUExperts", "grouped": "GroupedSwiGLU"}.get(engine)
    assert all(calls[n] == 0 for n in calls if n != want), f"{engine}: {calls}"
    assert want is None or calls[want] > 0, f"{engine}: {want} never ran ({calls})"


def scenario_inputs(name, world):
    """Per-rank inputs [1, S_r, D] for the named scenario, and the expert count / top-k."""
    g = torch.Generator().manual_seed(7)
    sizes = {"even": [24] * world, "uneven": [5, 31, 0, 12][:world], "one_empty_rank": [0] + [16] * (world - 1),
             "all_to_one": [12] * world, "idle_expert": [12] * world, "idle_rank": [12] * world}[name]
    xs = [torch.randn(1, s, D, generator=g) for s in sizes]
    for x in xs:
        x[..., 0] = x[..., 0].abs() + 1.0  # feature 0 > 0 everywhere: lets force() pin the idle expert
    return xs


def force(mod, name):
    """Gate weights that send every token to expert 0 (all_to_one), never to the last (idle_expert:
    its logit is pinned far below every other expert's via the always-positive feature 0 of the input),
    or every token to experts 0 and 1 (idle_rank: every rank that owns none of experts 0 and 1, e.g. rank 1
    of 2 with E = 4, receives no routed pair at all)."""
    with torch.no_grad():
        if name == "all_to_one":
            mod.gate.weight.zero_()
            mod.gate.weight[0, 0] = 50.0
        elif name == "idle_expert":
            mod.gate.weight[:, 0] = 0.0
            mod.gate.weight[-1] = 0.0
            mod.gate.weight[-1, 0] = -1000.0
        elif name == "idle_rank":
            mod.gate.weight.zero_()
            mod.gate.weight[0, 0] = 50.0
            mod.gate.weight[1, 0] = 49.0
            mod.gate.weight[:2, 1:] = torch.randn(2, D - 1, generator=torch.Generator().manual_seed(3)) * 0.3


def dispatch_experts_combine(layer, dispatcher, x_TD, topk_idx_TK, topk_weight_TK):
    """The MoE layer's steps 3-5 on given routing (the dispatch contract, `layer`'s experts):
    x_TD [T, D] -> y_TD [T, D]."""
    d = dispatcher.dispatch(x_TD, topk_idx_TK, topk_weight_TK)
    return dispatcher.combine(layer.experts(d.rows_PD, d.tokens_per_expert, d.row_weight_P), d)


@torch.no_grad()
def grouped_by_rank_reference(mod, x, world):
    """Single-process forward that adds each token's expert outputs grouped by owner rank, as EP does:
    y = (0 + sum of rank 0's experts) + sum of rank 1's experts + ... Each expert still sees the same rows
    (all tokens routed to it, ascending), so this differs from the plain layer only by float reassociation."""
    x_TD = x.reshape(-1, x.shape[-1])
    idx, w, _, _ = mod.route(x_TD)
    per_rank = mod.config.num_experts // world
    y = torch.zeros_like(x_TD)
    for m in range(world):
        mine = idx.div(per_rank, rounding_mode="floor") == m
        y = y + dispatch_experts_combine(mod, SortedDispatcher(mod.config.num_experts), x_TD,
                                         torch.where(mine, idx, -1), w)
    return y.view_as(x)


def named_grads(mod):
    """Each parameter's gradient (None without one) by name, the stacked experts' split per expert under the
    state_dict's names, experts.{e}.{gate,up,down}_proj.weight (under EP the rank's experts only)."""
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in mod.named_parameters()
             if not n.startswith("experts.")}
    gate_up, down = (local_shard(p.grad) if p.grad is not None else None for p in mod.experts.parameters())
    F_, first = mod.experts.down_proj.shape[2], getattr(mod.dispatcher, "first_expert", 0)
    for e in range(local_shard(mod.experts.down_proj).shape[0]):
        for name, grad, rows in (("gate_proj", gate_up, slice(None, F_)), ("up_proj", gate_up, slice(F_, None)),
                                 ("down_proj", down, slice(None))):
            grads[f"experts.{first + e}.{name}.weight"] = None if grad is None else grad[e, rows].clone()
    return grads


def world_mesh():
    """The 1-D DeviceMesh of every rank: the EP mesh of these layer tests."""
    return init_device_mesh("cpu", (dist.get_world_size(),))


def run_layer(mod, xs, upstream):
    """Forward + backward on each x in xs (one rank's inputs, or the concatenation)."""
    x = xs.clone().requires_grad_()
    y = mod(x)
    (y * upstream).sum().backward()
    grads = named_grads(mod)
    mod.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


def ep_worker(rank, world, cases):
    from train.parallel import install
    results = {}
    for name, e, k in cases:
        mod = build(e, k)
        force(mod, name)
        install(mod, world_mesh(), e)
        x = scenario_inputs(name, world)[rank]
        up = torch.linspace(-1, 1, x.numel()).view_as(x)
        y, xg, grads = run_layer(mod, x, up)
        d = mod.dispatcher
        results[(name, e, k)] = dict(y=y, xg=xg, grads=grads, tpe=mod.stats.tokens_per_expert.clone(),
                                     owned=list(range(d.first_expert, d.first_expert + d.experts_per_rank)),
                                     bytes_sent=d.bytes_sent, bytes_k=d.bytes_k_copies)
    return results


CASES = [("even", 4, 1), ("even", 4, 2), ("even", 8, 2), ("even", 8, 4), ("uneven", 4, 2),
         ("one_empty_rank", 4, 2), ("all_to_one", 4, 1), ("idle_expert", 8, 2), ("idle_rank", 4, 2),
         ("idle_rank", 8, 2)]


def check_against_single(world):
    cases = [c for c in CASES if c[1] % world == 0]
    per_rank = spawn(ep_worker, world, cases)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the workers: a GEMM's rounding may depend on the thread count
    try:
        _compare(world, cases, per_rank)
    finally:
        torch.set_num_threads(threads)


def _compare(world, cases, per_rank):
    for name, e, k in cases:
        mod = build(e, k)
        force(mod, name)
        xs = scenario_inputs(name, world)
        x_all = torch.cat(xs, dim=1)
        up_all = torch.cat([torch.linspace(-1, 1, x.numel()).view_as(x) for x in xs], dim=1)
        y, xg, grads = run_layer(mod, x_all, up_all)
        ys, xgs = torch.split(y, [x.shape[1] for x in xs], 1), torch.split(xg, [x.shape[1] for x in xs], 1)
        what = f"world={world} {name} E={e} k={k}"
        if k > 2:  # the reason EP may differ: partial sums grouped by owner rank (shown bitwise below)
            ys = torch.split(grouped_by_rank_reference(mod, x_all, world), [x.shape[1] for x in xs], 1)
            assert torch.allclose(torch.cat(ys, 1), y, rtol=1e-6, atol=1e-7), f"{what}: grouping changed more than rounding"
        for r, res in enumerate(per_rank):
            got = res[(name, e, k)]
            assert torch.equal(got["y"], ys[r]), f"{what} rank {r}: forward differs {(got['y'] - ys[r]).abs().max():.2e}"
            if k <= 2:
                assert torch.equal(got["xg"], xgs[r]), f"{what} rank {r}: input grad differs"
            else:  # 3+ partial sums per token are added in another order across ranks: ~1 ulp
                assert torch.allclose(got["xg"], xgs[r], rtol=1e-6, atol=1e-7), f"{what} rank {r}: input grad"
            for ex in got["owned"]:
                for pn in ("gate_proj", "up_proj", "down_proj"):
                    key = f"experts.{ex}.{pn}.weight"
                    assert torch.equal(got["grads"][key], grads[key]), f"{what}: {key} grad differs on its owner"
        # The router's grad is a sum over tokens: per-rank partial GEMMs reassociate it (fp32 rounding).
        if name == "idle_expert":
            assert all(int(res[(name, e, k)]["tpe"][-1]) == 0 for res in per_rank), "the idle expert got tokens"
            idle = [res[(name, e, k)]["grads"][f"experts.{e - 1}.up_proj.weight"] for res in per_rank
                    if e - 1 in res[(name, e, k)]["owned"]]  # (on its owner: the others do not hold it)
            assert len(idle) == 1 and (idle[0] is None or torch.count_nonzero(idle[0]) == 0), \
                "the idle expert got a non-zero grad"
        if name == "all_to_one":
            assert all(int(res[(name, e, k)]["tpe"][0]) == res[(name, e, k)]["y"].shape[1] for res in per_rank)
        if name == "idle_rank":  # experts >= 2 get no pair (so whole ranks receive nothing): zero grads
            assert sum(int(res[(name, e, k)]["tpe"][2:].sum()) for res in per_rank) == 0, "experts >= 2 got tokens"
            for r, res in enumerate(per_rank):
                for ex in res[(name, e, k)]["owned"]:
                    for pn in ("gate_proj", "up_proj", "down_proj"):
                        v = res[(name, e, k)]["grads"][f"experts.{ex}.{pn}.weight"]
                        assert ex < 2 or (v is not None and not v.any()), f"{what}: idle expert {ex} on rank {r}"
        gate = sum(res[(name, e, k)]["grads"]["gate.weight"] for res in per_rank)
        assert torch.allclose(gate, grads["gate.weight"], rtol=1e-5, atol=1e-6), f"{what}: gate grad"
    b = per_rank[0][("even", 8, 4)] if ("even", 8, 4) in cases else None
    if b and b["bytes_k"]:
        print(f"        world={world} E=8 k=4: dispatch bytes {b['bytes_sent']} vs {b['bytes_k']} for k copies "
              f"({b['bytes_sent'] / b['bytes_k']:.2f}x)")


def test_ep_equals_single_process_2_ranks():
    check_against_single(2)


def test_ep_equals_single_process_4_ranks():
    check_against_single(4)


def roundtrip_worker(rank, world):
    return {k: roundtrip_one(rank, k) for k in (1, 2, 4)}


def roundtrip_one(rank, k):
    """Identity experts, weights 1/k, -1 entries: dispatch + combine must return x and its grad exactly."""
    from train.parallel import AllToAllDispatcher
    e = 4
    g = torch.Generator().manual_seed(rank)
    T = 10 + 3 * rank
    x = torch.randn(T, D, generator=g, requires_grad=True)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(T)])
    idx[0, 0] = -1  # a "no expert" entry: that token loses one share
    w = torch.full((T, k), 1.0 / k)
    ep = AllToAllDispatcher(dist.group.WORLD, e, SortedDispatcher(e))
    d = ep.dispatch(x, idx, w)
    y = ep.combine(d.rows_PD, d)  # identity experts: their output rows are their input rows
    up = torch.randn(T, D, generator=g)
    (y * up).sum().backward()
    share = 1.0 - (idx < 0).float().sum(-1, keepdim=True) / k
    local = SortedDispatcher(e)
    d = local.dispatch(x.detach(), idx, w)
    return dict(ok_y=torch.equal(y, x.detach() * share), ok_g=torch.equal(x.grad, up * share),
                ref=torch.equal(y, local.combine(d.rows_PD, d)))


def test_dispatch_combine_roundtrip():
    for world in (2, 4):
        for r, by_k in enumerate(spawn(roundtrip_worker, world)):
            for k, res in by_k.items():
                assert res["ok_y"] and res["ok_g"] and res["ref"], f"world={world} k={k} rank {r}: {res}"


def test_deterministic():
    a = spawn(ep_worker, 2, [("uneven", 4, 2)])
    b = spawn(ep_worker, 2, [("uneven", 4, 2)])
    for ra, rb in zip(a, b):
        x, y = ra[("uneven", 4, 2)], rb[("uneven", 4, 2)]
        assert torch.equal(x["y"], y["y"]) and torch.equal(x["xg"], y["xg"])


CAPACITY_CASES = [dict(capacity_factor=0.5), dict(capacity_factor=0.5, moe_drop_policy="position", moe_pad_to_capacity=True),
                  dict(capacity_factor=1.0, moe_expert_alignment=16)]


def capacity_worker(rank, world):
    from train.parallel import install
    out = []
    for kw in CAPACITY_CASES:
        torch.manual_seed(0)
        mod = MOEFeedForward(MiniMindConfig(hidden_size=D, num_attention_heads=1, num_key_value_heads=1, head_dim=8,
                                            use_moe=True, num_experts=4, num_experts_per_tok=2,
                                            moe_intermediate_size=16, **kw)).train()
        install(mod, world_mesh(), 4)
        x = scenario_inputs("uneven", world)[rank]
        out.append((mod(x).detach(), mod.stats.tokens_per_expert.clone()))
    return out


def test_capacity_under_ep():
    """Capacity is applied to each rank's own tokens before dispatch: EP output on rank r equals the
    single-process layer with the same capacity on rank r's batch (up to the experts' GEMM blocking)."""
    world = 2
    per_rank = spawn(capacity_worker, world)
    xs = scenario_inputs("uneven", world)
    for r, res in enumerate(per_rank):
        for kw, (y, counts) in zip(CAPACITY_CASES, res):
            key = str(kw)
            torch.manual_seed(0)
            mod = MOEFeedForward(MiniMindConfig(hidden_size=D, num_attention_heads=1, num_key_value_heads=1, head_dim=8,
                                                use_moe=True, num_experts=4, num_experts_per_tok=2,
                                                moe_intermediate_size=16, **kw)).train()
            want = mod(xs[r]).detach()
            assert torch.allclose(y, want, rtol=1e-5, atol=1e-6), f"rank {r} {key}"
            cap = -(-int(kw["capacity_factor"] * xs[r].shape[1] * 2) // 4)
            assert int(counts.max()) <= cap, f"rank {r} {key}: {counts} > {cap}"


FUSED_CASES = [("even", 8, 2), ("uneven", 4, 2), ("one_empty_rank", 4, 2), ("idle_expert", 8, 2),
               ("all_to_one", 4, 1), ("idle_rank", 4, 2), ("even", 8, 4)]
FUSED_ENGINES = ("plain", "cpu", "grouped")
# Ranks whose experts get no routed pair (idle_rank: every pair goes to experts 0 and 1) or a rank without
# tokens (one_empty_rank), without and with capacity dropping, padding to capacity and alignment (the
# idle ranks then run their experts on padding rows only). idle_rank gives every rank the same batch
# size; one_empty_rank does not, so it leaves out padding to capacity (test_pad_to_capacity_uneven_batches).
EMPTY_RANK_LAYOUTS = [{}, dict(capacity_factor=1.0), dict(capacity_factor=0.75, moe_drop_policy="position"),
                      dict(capacity_factor=1.0, moe_pad_to_capacity=True), dict(moe_expert_alignment=4),
                      dict(capacity_factor=1.5, moe_pad_to_capacity=True, moe_expert_alignment=8)]
EMPTY_RANK_CASES = [("idle_rank", 4, 2, kw) for kw in EMPTY_RANK_LAYOUTS] + [
    ("one_empty_rank", 4, 2, kw) for kw in EMPTY_RANK_LAYOUTS if not kw.get("moe_pad_to_capacity")]
UNEVEN_PAD_CASES = [("uneven", 4, 2, dict(capacity_factor=1.0, moe_pad_to_capacity=True)),
                    ("one_empty_rank", 4, 2, dict(capacity_factor=1.0, moe_pad_to_capacity=True)),
                    ("uneven", 4, 2, dict(capacity_factor=0.5, moe_pad_to_capacity=True, moe_expert_alignment=4))]


def fused_worker(rank, world, cases):
    from train.parallel import install
    out = {}
    for engine in FUSED_ENGINES:
        for name, e, k in cases:
            mod = make(e, k, engine)
            force(mod, name)
            install(mod, world_mesh(), e)
            x = scenario_inputs(name, world)[rank]
            with engine_choice(engine):
                y, xg, grads = run_layer(mod, x, torch.linspace(-1, 1, x.numel()).view_as(x))
            d = mod.dispatcher
            owned = {n: g for n, g in grads.items()
                     if n.startswith("experts.") and d.first_expert <= int(n.split(".")[1]) < d.first_expert + d.experts_per_rank}
            out[engine, name, e, k] = dict(y=y, xg=xg, gate=grads["gate.weight"], owned=owned)
    return out


def per_batch_worker(rank, world, cases, engines):
    """Each (engine, case) under EP on this rank's batch: output, input grad, grads, the owned expert
    parameter names and the pairs routed per expert."""
    from train.parallel import install
    out = {}
    for engine in engines:
        for i, (name, e, k, kw) in enumerate(cases):
            mod = make(e, k, engine, **kw)
            force(mod, name)
            install(mod, world_mesh(), e)
            x = scenario_inputs(name, world)[rank]
            with engine_choice(engine):
                y, xg, grads = run_layer(mod, x, torch.linspace(-1, 1, x.numel()).view_as(x))
            d = mod.dispatcher
            out[engine, i] = dict(y=y, xg=xg, grads=grads, tpe=mod.stats.tokens_per_expert.clone(),
                                  owned=[n for n in grads if n.startswith("experts.") and d.first_expert <= int(n.split(".")[1]) < d.first_expert + d.experts_per_rank])
    return out


def fused_and_empty_worker(rank, world, fused_cases):
    return fused_worker(rank, world, fused_cases), per_batch_worker(rank, world, EMPTY_RANK_CASES, ENGINES)


_SPAWNED = {}


def fused_and_empty_results(world):
    """One spawn per world size serves the fused-EP and the empty-rank tests (spawning is the slow part)."""
    if world not in _SPAWNED:
        cases = [c for c in FUSED_CASES if c[1] % world == 0]
        _SPAWNED[world] = cases, spawn(fused_and_empty_worker, world, cases)
    return _SPAWNED[world]


def check_fused_against_single(world):
    """moe_impl="fused" as the EP ranks' local expert compute, for every fused engine: output, input grads,
    the owners' expert grads and the summed router grads equal the single-process layer with the same
    engine on the whole batch (within 1e-5: EP adds each token's per-rank partial sums in another order)."""
    cases, results = fused_and_empty_results(world)
    per_rank = [r[0] for r in results]
    for engine in FUSED_ENGINES:
        for name, e, k in cases:
            mod = make(e, k, engine)
            force(mod, name)
            xs = scenario_inputs(name, world)
            ups = [torch.linspace(-1, 1, x.numel()).view_as(x) for x in xs]
            with engine_choice(engine):
                y, xg, grads = run_layer(mod, torch.cat(xs, 1), torch.cat(ups, 1))
            got = [r[engine, name, e, k] for r in per_rank]
            what = f"world={world} {engine} {name} E={e} k={k}"
            close = lambda a, b: (a - b).abs().max().item() <= 1e-5 if a.numel() else True  # noqa: E731
            assert close(torch.cat([g["y"] for g in got], 1), y), what
            assert close(torch.cat([g["xg"] for g in got], 1), xg), what
            assert close(sum(g["gate"] for g in got), grads["gate.weight"]), what
            owners = {}
            for g in got:
                for n, v in g["owned"].items():
                    owners[n] = owners.get(n, 0) + 1
                    assert v is not None, f"{what} {n}: no grad on its owner"
                    assert close(v, grads[n]), f"{what} {n}"
            assert sorted(owners) == sorted(n for n in grads if n.startswith("experts.")) and set(owners.values()) == {1}, \
                f"{what}: every expert parameter has exactly one owner"


def test_fused_path_under_ep_2_ranks():
    check_fused_against_single(2)


def test_fused_path_under_ep_4_ranks():
    check_fused_against_single(4)


def compare_per_batch(world, cases, engines, per_rank):
    """EP results against the single-process layer (same engine) run on each rank's batch alone
    (capacity is applied to each rank's own tokens): rank r's output and input grad, each owner's expert
    grads and the summed router grads (the sums over ranks of the per-batch grads) within 1e-5; with
    idle_rank no pair reaches experts >= 2, whose grads are zero."""
    close = lambda a, b: (a - b).abs().max().item() <= 1e-5 if a.numel() else True  # noqa: E731
    for engine in engines:
        for i, (name, e, k, kw) in enumerate(cases):
            what = f"world={world} {engine} {name} E={e} k={k} {kw}"
            refs = []
            for x in scenario_inputs(name, world):
                mod = make(e, k, engine, **kw)
                force(mod, name)
                with engine_choice(engine):
                    refs.append(run_layer(mod, x, torch.linspace(-1, 1, x.numel()).view_as(x)))
            got = [res[engine, i] for res in per_rank]
            for r, (g, (y, xg, _)) in enumerate(zip(got, refs)):
                assert close(g["y"], y), f"{what} rank {r}: forward"
                assert close(g["xg"], xg), f"{what} rank {r}: input grad"
            summed = {n: sum(ref[2][n] for ref in refs) for n in refs[0][2]}
            assert close(sum(g["grads"]["gate.weight"] for g in got), summed["gate.weight"]), f"{what}: gate grad"
            owned = sorted(n for g in got for n in g["owned"])
            assert owned == sorted(n for n in summed if n.startswith("experts.")), f"{what}: owners"
            for r, g in enumerate(got):
                for n in g["owned"]:
                    assert g["grads"][n] is not None and close(g["grads"][n], summed[n]), f"{what} rank {r}: {n}"
            if name == "idle_rank":
                assert sum(int(g["tpe"][2:].sum()) for g in got) == 0, f"{what}: experts >= 2 got tokens"
                for r, g in enumerate(got):
                    for n in g["owned"]:
                        if int(n.split(".")[1]) >= 2:
                            assert not g["grads"][n].any(), f"{what}: idle expert {n} on rank {r}"


def test_rank_without_routed_pairs_2_ranks():
    """EP where a rank's experts get no token (rank 1 of 2 receives no routed pair) or a rank has no token,
    every engine, every capacity / padding layout: forward and backward complete on every rank and match
    the single process (compare_per_batch). (A rank receiving no routed pair crashed the fused EP path
    with gloo's "Received data size doesn't match".)"""
    compare_per_batch(2, EMPTY_RANK_CASES, ENGINES, [r[1] for r in fused_and_empty_results(2)[1]])


def test_rank_without_routed_pairs_4_ranks():
    """As the 2-rank test; with 4 ranks and E = 4, ranks 2 and 3 receive no routed pair."""
    compare_per_batch(4, EMPTY_RANK_CASES, ENGINES, [r[1] for r in fused_and_empty_results(4)[1]])


def test_pad_to_capacity_uneven_batches():
    """Padding to capacity under EP when the ranks' batches differ in size (each rank's capacity comes from
    its own token count): every engine completes forward and backward and matches the single process on
    each rank's batch (compare_per_batch)."""
    world = 2
    compare_per_batch(world, UNEVEN_PAD_CASES, ENGINES, spawn(per_batch_worker, world, UNEVEN_PAD_CASES, ENGINES))


META_CONFIGS = [dict(num_experts=8, num_experts_per_tok=2, n_shared_experts=1),
                dict(num_experts=4, num_experts_per_tok=1, tie_word_embeddings=False)]


def whole_model(seed=0, **kw):
    from model.model_minimind import MiniMindForCausalLM
    torch.manual_seed(seed)
    return MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=2, use_moe=True, moe_intermediate_size=96,
                                              vocab_size=300, **kw))


def keyed_build_worker(rank, world, ep_size, fsdp, seed):
    """The trainer's build (train/parallel.py: build_model) on this rank, under EP over `ep_size` ranks and,
    with `fsdp`, FSDP2 as the trainer shards it; returns every tensor of the whole model gathered
    (torch's state_dict helper, full_state_dict) and whether a tied head stayed tied."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from model.model_minimind import MiniMindForCausalLM
    from model.moe import stacked_names
    from train.distributed import init_distributed
    from train.parallel import build_model, shard
    ctx = init_distributed(ep_size, "cpu", fsdp)
    out = []
    for kw in META_CONFIGS:
        config = whole_model(**kw).config
        torch.manual_seed(rank)  # (the global RNG is not what the weights come from)
        model = build_model(lambda: MiniMindForCausalLM(config), "cpu", seed, ctx.ep_mesh if ep_size > 1 else None)
        held = [local_shard(p).shape[0] for m in model.modules() if isinstance(m, MOEFeedForward)
                for p in m.experts.parameters()]
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        if ctx.distributed:
            shard(model, ctx)
        with stacked_names():
            whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        out.append(dict(tensors={k: v.clone() for k, v in whole.items()}, held=held, tied=tied))
    return out


def test_weights_are_a_function_of_the_seed_alone():
    """The trainer's build (train/parallel.py: build_model: meta device, each rank's experts only, then
    drawn by key) gives, gathered whole, the same tensors bit for bit in one process and at 2 and 4 ranks
    under EP, EP + FSDP and FSDP alone, whatever the global RNG holds; each EP rank allocates only its
    E / ep_size experts; a tied head stays tied; another seed gives other weights. The reference draws each
    tensor by its own key (`keyed_normal`), not through init_weights."""
    from model.model_minimind import MiniMindForCausalLM, keyed_normal
    from model.moe import stacked_names
    from train.parallel import build_model
    wants = []
    for kw in META_CONFIGS:  # the one-process reference, each tensor from its key
        config = whole_model(**kw).config
        with stacked_names():
            shapes = {k: v.shape for k, v in MiniMindForCausalLM(config).state_dict().items()}
        want = {}
        for name, shape in shapes.items():
            if name.endswith("norm.weight"):
                want[name] = torch.ones(shape)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                want[name] = torch.stack([keyed_normal(shape[1:], config.initializer_range, 5, f"{name}.{e}")
                                          for e in range(shape[0])])
            elif not (name == "lm_head.weight" and config.tie_word_embeddings):
                want[name] = keyed_normal(shape, config.initializer_range, 5, name)
        wants.append((config, want))
    for world, ep_size, fsdp in ((1, 1, False), (2, 2, True), (4, 4, False), (4, 2, True), (2, 1, True)):
        per_rank = spawn(keyed_build_worker, world, ep_size, fsdp, 5, init_group=False)
        for i, (config, want) in enumerate(wants):
            for rank, got in enumerate(per_rank):
                got, where = got[i], (world, ep_size, fsdp, rank, i)
                tensors = {k: v for k, v in got["tensors"].items()
                           if not (k == "lm_head.weight" and config.tie_word_embeddings)}
                assert tensors.keys() == want.keys(), (where, tensors.keys() ^ want.keys())
                for name, t in want.items():
                    assert torch.equal(tensors[name], t), (where, name)
                assert got["held"] == [config.num_experts // ep_size] * len(got["held"]), (where, got["held"])
                assert got["tied"] == config.tie_word_embeddings, where
    other = build_model(lambda: MiniMindForCausalLM(wants[0][0]), "cpu", 6)
    assert not torch.equal(other.model.embed_tokens.weight, wants[0][1]["model.embed_tokens.weight"])


TESTS = [test_weights_are_a_function_of_the_seed_alone, test_capacity_under_ep, test_fused_path_under_ep_2_ranks, test_fused_path_under_ep_4_ranks,
         test_rank_without_routed_pairs_2_ranks, test_rank_without_routed_pairs_4_ranks,
         test_pad_to_capacity_uneven_batches, test_ep_equals_single_process_2_ranks,
         test_ep_equals_single_process_4_ranks, test_dispatch_combine_roundtrip, test_deterministic]

if __name__ == "__main__":
    run(TESTS)
