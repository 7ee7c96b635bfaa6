"""The fused MoE path (moe_impl="fused") against the sorted layer, the bitwise reference.

    python scripts/test_moe_fused.py

The fused layer is MOEFeedForward with a RowMapDispatcher (model/dispatch.py). Its experts (model/moe.py:
Experts) run on the engine chosen when the layer is built, three ways, and every equivalence test runs all
three (ENGINES), each on a layer of its own with the same weights (train.engines.rebuilt: `engine_layers`):
  "plain"    the layer built with the plain engines (model/engines.py: PLAIN): model/moe.py's expert_loop,
             one nn.Linear-style chain per expert (reads the counts to the host, so it is not the zero-sync
             path), and model/dispatch.py's PLAIN_MOVERS;
  "cpu"      the layer built with train.engines.engines_for's engines: kernels/experts.py's cpu_experts_for (the
             CPU expert GEMMs, CPUExperts: what engines_for picks on CPU where oneDNN runs the dtype) and
             the row movers engines_for picks (on CPU model/dispatch.py's PLAIN_MOVERS, on CUDA
             TRITON_MOVERS: kernels/permute.py's row movers);
  "grouped"  the same engines with the grouped-GEMM experts engine grouped_experts_for picks for the CPU
             (kernels/experts.py: GROUPED_EXPERTS, kernels/grouped_gemm.py: GroupedSwiGLU on torch's
             grouped_mm where it takes the sizes, else model/moe.py: expert_loop): the GPU's engine.
Each engine run checks which experts engine the layer holds and which one actually ran (`engine`).

Tolerance, fp32: forward and every gradient within 1e-5 absolute on outputs of size ~0.1-1 (the grouped
GEMM sums each dot product in another order than per-expert nn.Linear, the routing weight is applied
before the down projection instead of after it, and the combine accumulates in fp32: differences are a
few ulps, ~1e-7 measured). bf16 autocast: measured against an fp64 copy of the sorted layer, the fused
path's error (relative L2 norm, per output and per gradient) is at most BF16_MARGIN times the sorted path's
(`assert_bf16_as_close_as_sorted`): both round to bf16 at different points, so neither is the reference.
"""
import contextlib
import copy
import dataclasses
import warnings
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from testlib import Skip, run  # noqa: F401
from sync_count import SyncCounter, count_syncs
from kernels.cpu_linear import onednn_runs
from train.engines import describe, engines_for, grouped_experts_for
from testlib import rebuilt
from kernels.experts import (GROUPED_EXPERTS, CPUExperts, GroupedSwiGLU, cpu_experts_rows_bucketed,
                             cpu_experts_rows_in_place)
from model.dispatch import RowLayout, RowMapDispatcher, SortedDispatcher
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM, MOEFeedForward
from model import moe as model_moe
from model.moe import expert_loop

D = 32
ENGINES = ("plain", "cpu", "grouped")
ENGINE_FUNCTIONS = {"plain": (expert_loop,), "cpu": (cpu_experts_rows_in_place, cpu_experts_rows_bucketed),
                    "grouped": (*GROUPED_EXPERTS.values(), expert_loop)}


def fused_engines(experts_engine, n=1, device="cpu"):
    """describe() of n engine-built fused layers on `device` whose experts run `experts_engine` (the permute /
    combine are named where they are the Triton ones, on CUDA)."""
    names = ([f"triton row movers x{n}"] if device == "cuda" else []) + (
        [f"{experts_engine.__name__} x{n}"] if experts_engine is not expert_loop else [])
    return "engines: " + (", ".join(names) or "plain PyTorch")


def with_engines(fused, device="cpu", dtype=torch.float32, experts=None, compiled=False):
    """A copy of the plain fused layer built with the engines train/engines.py picks for `device`, autocast
    `dtype` and `compiled` (with the experts engine `experts` in their place when given): same weights and
    buffers, same train/eval mode. The build's initialisation draws are kept off the caller's random
    stream, so a test's inputs do not depend on how its layers are made."""
    engines = engines_for(fused.config, device, dtype, compiled)
    if experts is not None:
        engines = dataclasses.replace(engines, experts=experts)
    with torch.random.fork_rng(devices=[]):
        layer = rebuilt(fused, engines)
    assert type(layer) is MOEFeedForward and layer.training == fused.training
    assert layer.experts.engine is engines.experts and type(layer.dispatcher) is RowMapDispatcher
    assert layer.dispatcher.movers is engines.movers
    assert describe(layer) == fused_engines(engines.experts, device=device), describe(layer)
    return layer


def engines_here(dtype=torch.float32):
    """ENGINES that run on this machine for the compute dtype (the CPU engine needs oneDNN)."""
    return tuple(e for e in ENGINES if e != "cpu" or onednn_runs("cpu", dtype))


def engine_layers(fused, dtype=torch.float32):
    """{name: layer} for the ENGINES that run here under compute `dtype`: the plain fused layer, and copies
    built for the CPU with engines_for's engines (cpu_experts_for) and with the grouped engine in their place."""
    layers = {"plain": fused}
    if "cpu" in engines_here(dtype):
        layers["cpu"] = with_engines(fused, "cpu", dtype)
    config = fused.config
    grouped = grouped_experts_for("cpu", dtype, config.hidden_size, config.moe_intermediate_size)
    layers["grouped"] = with_engines(fused, "cpu", dtype, experts=grouped)
    return layers


def counting(function, calls):
    """Patches the autograd Function `function`'s forward to count its runs in calls[its name]."""
    real = function.forward

    def forward(*args, **kwargs):
        calls[function.__name__] += 1
        return real(*args, **kwargs)
    return mock.patch.object(function, "forward", staticmethod(forward))


def function_of(engine_):
    """The autograd Function an experts engine runs: "CPUExperts" (cpu_experts_for's), "GroupedSwiGLU"
    (GROUPED_EXPERTS'), None for model/moe.py's expert_loop (a loop of plain ops)."""
    if engine_ in (cpu_experts_rows_in_place, cpu_experts_rows_bucketed):
        return "CPUExperts"
    if engine_ in GROUPED_EXPERTS.values():
        return "GroupedSwiGLU"
    assert engine_ is expert_loop, engine_
    return None


@contextlib.contextmanager
def engine(layers, name):
    """Run the fused layer with experts engine `name` (ENGINES): layers from engine_layers. Checks that the
    layer holds that engine, yields it; on leaving checks that the Function of the engine the layer was built
    with ran (the CPU expert GEMMs, kernels.experts.CPUExperts: cpu_experts_for; or the grouped GEMMs,
    kernels.grouped_gemm.GroupedSwiGLU) and no other; a layer built with expert_loop (the plain engine, or the
    grouped engine's fallback for sizes grouped_mm cannot take) runs neither. The body must run the layer."""
    if name not in ENGINES:
        raise ValueError(name)
    layer = layers[name]
    engine_ = layer.experts.engine
    assert engine_ in ENGINE_FUNCTIONS[name], f"engine {name}: the layer runs {engine_.__name__}"
    calls = {"CPUExperts": 0, "GroupedSwiGLU": 0}
    with counting(CPUExperts, calls), counting(GroupedSwiGLU, calls):
        yield layer
    built = function_of(engine_)
    others = {f: n for f, n in calls.items() if f != built}
    assert not any(others.values()), f"engine {name} ({engine_.__name__}): {others} ran"
    assert built is None or calls[built] > 0, f"engine {name} ({engine_.__name__}): {built} did not run ({calls})"


def dispatch_experts_combine(layer, x_TD, topk_idx_TK, topk_weight_TK, layout=RowLayout()):
    """The MoE layer's steps 3-5 on given routing (the dispatch contract): x_TD [T, D] -> y_TD [T, D]."""
    d = layer.dispatcher.dispatch(x_TD, topk_idx_TK, topk_weight_TK, layout)
    rows_out_PD = layer.experts(d.rows_PD, d.tokens_per_expert, d.row_weight_P)
    return layer.dispatcher.combine(rows_out_PD, d)


def pair(E, k, seed=0, **kw):
    """(sorted layer, engine_layers of a plain fused layer) with the same weights."""
    torch.manual_seed(seed)
    cfg = dict(hidden_size=D, num_attention_heads=1, num_key_value_heads=1, head_dim=8, use_moe=True,
               num_experts=E, num_experts_per_tok=k, moe_intermediate_size=24, **kw)
    ref = MOEFeedForward(MiniMindConfig(**cfg)).train()
    fused = MOEFeedForward(MiniMindConfig(**cfg, moe_impl="fused")).train()
    fused.load_state_dict(ref.state_dict())
    assert type(ref.dispatcher) is SortedDispatcher and type(fused.dispatcher) is RowMapDispatcher
    assert ref.experts.engine is expert_loop and fused.experts.engine is expert_loop
    return ref, engine_layers(fused)


def fwd_bwd(mod, x, g):
    xi = x.clone().requires_grad_()
    mod.zero_grad(set_to_none=True)
    y = mod(xi)
    (y * g).sum().backward()
    grads = {n: p.grad for n, p in mod.named_parameters()}
    return y.detach(), xi.grad, grads


def assert_close(a, b, tol, what):
    if a is None or b is None:
        assert a is None and b is None or (a is None and not b.abs().any()) or (b is None and not a.abs().any()), what
        return
    err = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    assert err <= tol, f"{what}: max abs error {err:.2e} > {tol}"


CONFIGS = [  # E, k, extra config
    (1, 1, {}), (4, 1, {}), (4, 2, {}), (8, 2, {}), (4, 4, {}), (8, 3, {}),
    (4, 2, {"capacity_factor": 0.5}),
    (4, 2, {"capacity_factor": 0.75, "moe_drop_policy": "position", "moe_pad_to_capacity": True}),
    (8, 2, {"moe_expert_alignment": 8}),
    (4, 2, {"capacity_factor": 1.0, "moe_pad_to_capacity": True, "moe_expert_alignment": 4}),
]


# fused error / sorted error against fp64, relative L2 per tensor: at most 1.27 over 531 tensors on CPU (10
# configurations x 3 seeds, the grouped engine); the floor 2^-8 (bf16's unit roundoff) covers a sorted path
# that happens to be near exact on a tensor
BF16_MARGIN = 1.5


def assert_bf16_as_close_as_sorted(ref, run_fused, x, g, what):
    """Under bf16 autocast on x's device: the fused layer (`run_fused(x, g)` -> fwd_bwd's triple) no further
    from an fp64 copy of the sorted layer `ref` than BF16_MARGIN times the sorted layer under the same autocast
    (relative L2 norm of the output, grad x and every parameter's gradient; floor 2^-8 of the norm)."""
    exact = fwd_bwd(copy.deepcopy(ref).double(), x.double(), g.double())
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        sorted_out, fused_out = fwd_bwd(ref, x, g), run_fused(x, g)
    assert sorted_out[0].dtype == fused_out[0].dtype == x.dtype, what
    def tensors(result):  # output, grad x, then the parameters' grads in one order
        return [result[0], result[1], *(result[2][n] for n in exact[2])]

    names = ["output", "grad x"] + [f"grad {n}" for n in exact[2]]
    for name, want, a, b in zip(names, tensors(exact), tensors(sorted_out), tensors(fused_out)):
        norm = want.norm().item()
        err_sorted = 0.0 if a is None else (a.double() - want).norm().item()
        err_fused = 0.0 if b is None else (b.double() - want).norm().item()
        bound = BF16_MARGIN * max(err_sorted, 2 ** -8 * norm)
        assert err_fused <= bound, (f"{what} {name}: fused {err_fused / max(norm, 1e-30):.2e} from fp64 vs sorted "
                                    f"{err_sorted / max(norm, 1e-30):.2e} (relative), > {BF16_MARGIN}x")


def test_matches_sorted_fp32():
    for E, k, kw in CONFIGS:
        ref, layers = pair(E, k, **kw)
        for impl in engines_here():
            for S in (1, 7, 50):
                x = torch.randn(2, S, D)
                g = torch.randn(2, S, D)
                ya, dxa, ga = fwd_bwd(ref, x, g)
                with engine(layers, impl) as fused:
                    yb, dxb, gb = fwd_bwd(fused, x, g)
                what = f"{impl} E={E} k={k} {kw} S={S}"
                assert_close(ya, yb, 1e-5, what + " forward")
                assert_close(dxa, dxb, 1e-5, what + " grad x")
                assert set(ga) == set(gb), what
                for n in ga:
                    assert_close(ga[n], gb[n], 1e-5, f"{what} grad {n}")
                assert torch.equal(ref.stats.tokens_per_expert, fused.stats.tokens_per_expert), what
                pads = kw.get("moe_pad_to_capacity") or kw.get("moe_expert_alignment", 1) > 1
                if pads:
                    assert (ref.stats.padded_tokens_per_expert.tolist()
                            == fused.stats.padded_tokens_per_expert.tolist()), what
                else:
                    assert ref.stats.padded_tokens_per_expert is None and fused.stats.padded_tokens_per_expert is None
                assert torch.equal(ref.aux_loss, fused.aux_loss), what


def test_idle_experts_get_zero_grads():
    """An expert with no tokens still gets a (zero) gradient in training (DDP needs every parameter)."""
    _, layers = pair(6, 1)
    for layer in layers.values():
        with torch.no_grad():
            layer.gate.weight[:, 0] = 0.0
            layer.gate.weight[5] = 0.0
            layer.gate.weight[5, 0] = -1000.0
    x = torch.randn(1, 20, D)
    x[..., 0] = x[..., 0].abs() + 1.0
    for impl in engines_here():
        with engine(layers, impl) as fused:
            _, _, grads = fwd_bwd(fused, x, torch.randn(1, 20, D))
        assert int(fused.stats.tokens_per_expert[5]) == 0
        for name in ("gate_up_proj", "down_proj"):  # stacked: expert 5's slice (gate and up rows, down)
            g = grads[f"experts.{name}"]
            assert g is not None and g.abs().any() and not g[5].abs().any(), f"{impl} {name}"


def test_deterministic():
    for E, k, kw in CONFIGS[:6]:
        _, layers = pair(E, k, **kw)
        x, g = torch.randn(3, 40, D), torch.randn(3, 40, D)
        for impl in engines_here():
            with engine(layers, impl) as fused:
                a, b = fwd_bwd(fused, x, g), fwd_bwd(fused, x, g)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), impl
            assert all(torch.equal(a[2][n], b[2][n]) for n in a[2]), impl


def test_zero_syncs():
    """Built with engines_for's engines, no sync-inducing call in forward or backward, in training and eval,
    with capacity, padding and alignment: with the CPU expert GEMMs (which read their segment bounds from
    CPU memory: not a sync), and with the grouped engine on torch's grouped_mm, whose offsets never leave
    the device (the CUDA design). The plain fused layer reads the counts at most once (its expert_loop),
    the sorted layer exactly once. Also through a module tree: every fused MoE layer of a model built with
    engines_for's engines gets them (and a sorted layer keeps the plain ones); rebuilding an engine-built
    layer with the same engines gives the same engines and state."""
    variants = [e for e in engines_here() if e != "plain"]
    for E, k, kw in CONFIGS + [(64, 8, {}), (16, 4, {"capacity_factor": 1.25, "moe_pad_to_capacity": True})]:
        ref, layers = pair(E, k, **kw)
        x = torch.randn(2, 30, D)
        for train in (True, False):
            for impl in variants:
                with engine(layers, impl) as fused:
                    fused.train(train)
                    xi = x.clone().requires_grad_()
                    with SyncCounter() as c:
                        fused(xi).sum().backward()
                assert c.count == 0, f"{impl} E={E} k={k} {kw} train={train}: syncs {c.ops}"
            layers["plain"].train(train)
            assert count_syncs(layers["plain"], x)[1] <= 1, f"plain fused E={E} k={k} {kw}"
            ref.train(train)
            assert count_syncs(ref, x)[1] == 1
    # a module tree: two fused layers, each built with engines_for's engines
    torch.manual_seed(0)
    cfg = dict(hidden_size=D, num_attention_heads=1, num_key_value_heads=1, head_dim=8, use_moe=True, num_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=24)
    plain_tree = torch.nn.Sequential(MOEFeedForward(MiniMindConfig(**cfg, moe_impl="fused")),
                                     MOEFeedForward(MiniMindConfig(**cfg, moe_impl="fused", capacity_factor=1.0)))
    engines = engines_for(plain_tree[0].config, "cpu", torch.float32)
    assert engines.experts is (cpu_experts_rows_in_place if onednn_runs("cpu", torch.float32) else
                               grouped_experts_for("cpu", torch.float32, D, 24))
    tree = torch.nn.Sequential(*(rebuilt(m, engines_for(m.config, "cpu", torch.float32)) for m in plain_tree))
    assert describe(tree) == fused_engines(engines.experts, 2), describe(tree)
    assert describe(plain_tree) == "engines: plain PyTorch", describe(plain_tree)
    again = rebuilt(tree[0], engines_for(tree[0].config, "cpu", torch.float32))
    assert again.experts.engine is engines.experts and type(again.dispatcher) is RowMapDispatcher
    assert again.dispatcher.movers is engines.movers
    assert list(again.state_dict()) == list(tree[0].state_dict()) and all(
        torch.equal(a, b) for a, b in zip(again.state_dict().values(), tree[0].state_dict().values()))
    x = torch.randn(2, 30, D)
    y, n = count_syncs(tree, x)
    assert n == 0, f"engine-built tree: {n} syncs"
    assert_close(y, plain_tree(x), 1e-5, "engine-built tree vs plain tree")
    # a model: every fused MoE layer built with the engines, for any layer count
    from model.model_minimind import MiniMindForCausalLM
    config = MiniMindConfig(**cfg, moe_impl="fused", num_hidden_layers=3, vocab_size=64)
    model = MiniMindForCausalLM(config, engines_for(config, "cpu", torch.float32))
    assert all(b.mlp.experts.engine is engines.experts and b.mlp.dispatcher.movers is engines.movers for b in model.model.layers)
    assert fused_engines(engines.experts, 3)[len("engines: "):] in describe(model), describe(model)
    # a sorted layer keeps the plain experts and dispatcher
    sorted_config = MiniMindConfig(**cfg)
    sorted_engines = engines_for(sorted_config, "cpu", torch.float32)
    assert sorted_engines.experts is expert_loop
    sorted_layer = rebuilt(MOEFeedForward(sorted_config), sorted_engines)
    assert type(sorted_layer) is MOEFeedForward and sorted_layer.experts.engine is expert_loop
    assert type(sorted_layer.dispatcher) is SortedDispatcher and describe(sorted_layer) == "engines: plain PyTorch"


def test_empty_and_tiny_inputs():
    """No token (B or S = 0), one token: forward equals the sorted layer, backward runs, for every engine
    and layout. Every case runs; the failures are reported together."""
    failures = []
    for kw in ({}, {"moe_expert_alignment": 4}, {"capacity_factor": 2.0, "moe_pad_to_capacity": True}):
        ref, layers = pair(4, 2, **kw)
        for shape, impl in ((s, i) for s in ((1, 0, D), (0, 5, D), (1, 1, D)) for i in engines_here()):
            x = torch.randn(*shape)
            try:
                with engine(layers, impl) as fused:
                    assert_close(ref(x).detach(), fused(x).detach(), 1e-5, f"{impl} {kw} {shape}")
                    xi = x.clone().requires_grad_()
                    fused(xi).sum().backward()
                assert xi.grad.shape == x.shape
            except Exception as e:  # noqa: BLE001 (collected, raised below)
                failures.append(f"{impl} {kw} {shape}: {type(e).__name__}: {str(e).splitlines()[0]}")
    # an EP rank that received no pairs but pads every expert to an alignment: P > 0 rows, T = 0 tokens
    _, layers = pair(4, 2)
    for impl in engines_here():
        try:
            with engine(layers, impl) as fused:
                y = dispatch_experts_combine(fused, torch.randn(0, D), torch.zeros(0, 2, dtype=torch.long),
                                             torch.zeros(0, 2), RowLayout(None, 4))
            assert y.shape == (0, D), impl
        except Exception as e:  # noqa: BLE001
            failures.append(f"{impl} T=0 direct call, alignment 4: {type(e).__name__}: {str(e).splitlines()[0]}")
    assert not failures, f"{len(failures)} cases failed:\n  " + "\n  ".join(failures)


def test_state_dict_and_engines():
    """The engines change no parameter: the layer built with them has the plain layer's parameter names
    and state_dict keys (the sorted layer's too) and equal values, in copies of its own (an optimizer step
    on it leaves the plain layer alone); it survives an optimizer step, .to(dtype), load_state_dict (also
    with assign=True), inference_mode and deepcopy, and keeps computing the plain layer's function (.to(float64):
    test_engine_built_layers_in_float64)."""
    ref, layers = pair(4, 2)
    fused = layers["plain"]
    assert list(ref.state_dict()) == list(fused.state_dict())
    layer = with_engines(fused)
    params = {n: p for n, p in fused.named_parameters()}
    assert [n for n, _ in layer.named_parameters()] == list(params)
    assert all(p is not params[n] and p.data_ptr() != params[n].data_ptr() for n, p in layer.named_parameters()), \
        "rebuilt shares a parameter with the plain layer"
    assert list(layer.state_dict()) == list(ref.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(layer.state_dict().values(), ref.state_dict().values()))
    before = {n: t.clone() for n, t in fused.state_dict().items()}
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    layer(torch.randn(1, 9, D)).sum().backward()
    opt.step()
    assert all(torch.equal(t, before[n]) for n, t in fused.state_dict().items()), "a step changed the plain layer"
    assert not all(torch.equal(t, before[n]) for n, t in layer.state_dict().items()), "the step changed nothing"
    x = torch.randn(1, 9, D)
    ref.load_state_dict(layer.state_dict())
    assert_close(layer(x), ref(x), 1e-5, "after an optimizer step")
    layer.to(torch.bfloat16)
    assert layer.experts.gate_up_proj.dtype == next(iter(layer.experts)).weights()[0].dtype == torch.bfloat16
    layer.to(torch.float32)
    fused.load_state_dict(ref.state_dict())
    layer.load_state_dict(ref.state_dict())
    want = ref(x)
    assert_close(layer(x), want, 1e-5, "load_state_dict")
    layer.load_state_dict(ref.state_dict(), assign=True)  # new tensors
    assert_close(layer(x), want, 1e-5, "load_state_dict(assign=True)")
    with torch.inference_mode():
        assert_close(layer(x), want, 1e-5, "inference_mode")
    twin = copy.deepcopy(layer)
    assert twin.experts.engine is layer.experts.engine and twin.dispatcher.movers == layer.dispatcher.movers
    assert_close(twin(x), want, 1e-5, "deepcopy")
    assert_close(fused(x), want, 1e-5, "plain fused layer")


def test_engine_built_layers_in_float64():
    """Engine-built layers moved to float64 by .to(dtype) keep computing the plain layer's function: the CPU
    engine (its batched GEMMs by torch.bmm for fp64) and the grouped engine of a layer built for fp64
    (engines_for picks the reference loop: torch's grouped_mm takes no fp64). Failures are reported together."""
    ref, layers = pair(4, 2)
    x = torch.randn(1, 9, D, dtype=torch.float64)
    want, failures = ref.double()(x), []
    for impl in engines_here():
        layer = layers[impl].to(torch.float64)
        if impl == "grouped":  # an engine decided at build for fp32 rows: build for fp64 instead
            layer = rebuilt(layer, engines_for(layer.config, "cpu", torch.float64))
        assert layer.experts.gate_up_proj.dtype == next(iter(layer.experts)).weights()[2].dtype == torch.float64
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                assert_close(layer(x), want, 1e-5, f"{impl} float64")
        except Exception as e:  # noqa: BLE001 (collected, raised below)
            failures.append(f"{impl} ({layer.experts.engine.__name__}): {type(e).__name__}: "
                            f"{str(e).splitlines()[0]}")
    assert not failures, f"{len(failures)} engines failed in float64:\n  " + "\n  ".join(failures)


def test_bf16_autocast_cpu():
    """Every engine under CPU bf16 autocast, by the fp64 criterion; fp32 router logits (router_dtype) give fp32
    routing weights, which the engines apply in the rows' dtype (bf16) as well."""
    for E, k, kw in CONFIGS + [(8, 2, {"router_dtype": "float32"}), (4, 2, {"router_dtype": "float32", "capacity_factor": 0.5})]:
        ref, layers = pair(E, k, **kw)
        layers = engine_layers(layers["plain"], torch.bfloat16)
        x, g = torch.randn(2, 32, D), torch.randn(2, 32, D)
        for impl in engines_here(torch.bfloat16):
            def run_fused(x, g):
                with engine(layers, impl) as layer:
                    return fwd_bwd(layer, x, g)
            assert_bf16_as_close_as_sorted(ref, run_fused, x, g, f"{impl} E={E} k={k} {kw}")


def sorted_and_fused(D_, F_):
    """(sorted layer, plain fused layer) with the same weights: hidden size D_, expert width F_, E=4, k=2."""
    torch.manual_seed(0)
    cfg = dict(hidden_size=D_, num_attention_heads=1, num_key_value_heads=1, head_dim=8, use_moe=True,
               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=F_)
    ref = MOEFeedForward(MiniMindConfig(**cfg)).train()
    fused = MOEFeedForward(MiniMindConfig(**cfg, moe_impl="fused")).train()
    fused.load_state_dict(ref.state_dict())
    return ref, fused


def test_odd_sizes_fall_back():
    """Sizes torch's grouped_mm cannot take, in forward or only in backward (rows not 16-byte multiples:
    D or F not a multiple of 4 in fp32, of 8 in bf16), get the reference loop as their grouped engine
    (grouped_experts_for; as on CUDA, where the CPU engine never runs); the CPU expert GEMMs take any size.
    Values and all grads agree in every variant."""
    for D_, F_, dtype in ((33, 13, None), (32, 13, None), (33, 24, None), (36, 64, torch.bfloat16),
                          (100, 64, torch.bfloat16)):
        ref, fused = sorted_and_fused(D_, F_)
        layers = engine_layers(fused, dtype or torch.float32)
        assert layers["grouped"].experts.engine is expert_loop, (D_, F_, dtype)
        x, g = torch.randn(2, 11, D_), torch.randn(2, 11, D_)
        tol = 1e-5 if dtype is None else 5e-2
        for variant in engines_here(dtype or torch.float32):
            with (warnings.catch_warnings(), engine(layers, variant) as layer,
                  torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)):
                warnings.simplefilter("ignore")
                a, b = fwd_bwd(ref, x, g), fwd_bwd(layer, x, g)
            what = f"{variant} D={D_} F={F_} {dtype}"
            assert_close(a[0], b[0], tol, what + " forward")
            assert_close(a[1], b[1], tol, what + " grad x")
            for n in a[2]:
                assert_close(a[2][n], b[2][n], tol, f"{what} grad {n}")


def test_plain_engine_on_the_fused_path():
    """Where engines_for gives the fused path the plain expert_loop (fp64; fp16 on this CPU), the layer runs
    every input the other engines run: all tokens masked or dropped (expert_loop returns zero rows for the
    holes), fp64 weights under bf16 autocast (the weights cast to the rows' dtype), fp16 autocast."""
    config = MiniMindConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                            vocab_size=300, use_moe=True, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=16, moe_impl="fused")
    ids, none = torch.randint(0, 300, (2, 8)), torch.zeros(2, 8, dtype=torch.long)
    model = MiniMindForCausalLM(config, engines_for(config, "cpu", torch.float64)).double()
    assert model.model.layers[0].mlp.experts.engine is expert_loop
    for mask in (None, none):
        assert torch.isfinite(model(ids, attention_mask=mask).logits).all(), mask
    model(ids, labels=ids).loss.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(model(ids).logits).all()
    half = MiniMindForCausalLM(config, engines_for(config, "cpu", torch.float16))
    with torch.autocast("cpu", dtype=torch.float16):
        for mask in (None, none):
            assert torch.isfinite(half(ids, attention_mask=mask).logits).all(), half.model.layers[0].mlp.experts.engine


def test_layout_ambiguous_shapes():
    """2F == D and F == D, where a transposed or mis-split stacked weight still has a shape that fits (the
    bug of unsloth-zoo 849): every experts engine here against the sorted layer (itself bitwise the masked
    loop at these sizes: test_moe_sorted.py), forward and every gradient, fp32."""
    for D_, F_ in ((64, 32), (32, 32)):
        ref, fused = sorted_and_fused(D_, F_)
        layers = engine_layers(fused)
        x, g = torch.randn(2, 13, D_), torch.randn(2, 13, D_)
        for variant in engines_here():
            with engine(layers, variant) as layer:
                a, b = fwd_bwd(ref, x, g), fwd_bwd(layer, x, g)
            what = f"{variant} D={D_} F={F_}"
            assert_close(a[0], b[0], 1e-5, what + " forward")
            assert_close(a[1], b[1], 1e-5, what + " grad x")
            for n in a[2]:
                assert_close(a[2][n], b[2][n], 1e-5, f"{what} grad {n}")


def test_direct_call_with_dropped_pairs():
    """The dispatchers and experts called directly with -1 entries (as the EP transport passes them, in
    any slot order): those pairs contribute 0; sorted and row-map paths agree for every engine."""
    ref, layers = pair(4, 2)
    x = torch.randn(10, D)
    idx = torch.tensor([[0, 1], [-1, 2], [3, -1], [-1, -1], [3, 0], [1, 2], [2, 3], [0, 2], [-1, 1], [1, 0]])
    w = torch.rand(10, 2)
    want = dispatch_experts_combine(ref, x, idx, w)
    assert not want[3].abs().any()
    for impl in engines_here():
        with engine(layers, impl) as fused:
            got = dispatch_experts_combine(fused, x, idx, w)
        assert_close(got, want, 1e-5, f"{impl} dropped pairs")
        assert not got[3].abs().any(), impl


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that make a tensor (a kernel launch each on a GPU; views and detach are free)."""

    def __init__(self):
        super().__init__()
        self.count, self.names = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        makes_tensor = any(isinstance(o, torch.Tensor) for o in (out if isinstance(out, (tuple, list)) else [out]))
        if makes_tensor and not func.is_view and func.overloadpacket not in (torch.ops.aten.detach, torch.ops.aten.lift_fresh):
            self.count += 1
            self.names.append(func.overloadpacket.__name__)
        return out


def test_layer_op_count():
    """One training forward / backward of the fused layer on the GPU's engine (grouped GEMMs), bf16 autocast, the
    trainer's routing (top-k renormalised, routed scaling k, MiniMind's balance loss): at the main job's shape on a
    GPU every op is a kernel launch, so the count is its cost, and it must not grow with E: the aten ops of the
    forward and of the backward are the same numbers for E = 8, 16 (k = 2) and 64 (k = 8): no op per expert (the
    grouped GEMMs read the stacked weights, each cast once to bf16). The numbers themselves move with torch's
    version and are not pinned."""
    counts = {}
    for E, k in ((8, 2), (16, 2), (64, 8)):
        _, layers = pair(E, k, routed_scaling_factor=float(k))
        layers = engine_layers(layers["plain"], torch.bfloat16)
        layer = layers["grouped"]
        x = torch.randn(2, 64, D, requires_grad=True)
        with engine(layers, "grouped"), torch.autocast("cpu", dtype=torch.bfloat16):
            with OpCounter() as forward:
                loss = layer(x).float().sum() + layer.aux_loss
            with OpCounter() as backward:
                loss.backward()
        # (the loss's own ops: float, sum, add forward; their backward: none but the expand)
        counts[E, k] = {"forward": forward.count - 3, "backward": backward.count, "forward ops": forward.names}
        assert counts[E, k]["forward"] > 0 and counts[E, k]["backward"] > 0, counts[E, k]
    (E0, k0), first = next(iter(counts.items()))
    for (E, k), c in counts.items():
        assert (c["forward"], c["backward"]) == (first["forward"], first["backward"]), (
            f"E={E} k={k}: {c['forward']} forward / {c['backward']} backward ops, E={E0} k={k0}: {first['forward']} / "
            f"{first['backward']}: the layer's op count grows with E; forward ops {c['forward ops']}")


def test_cuda_matches_sorted():
    if not torch.cuda.is_available():
        raise Skip("needs CUDA")
    for E, k, kw in CONFIGS[:6]:
        ref, layers = pair(E, k, **kw)
        ref.cuda(), layers["plain"].cuda()
        fused = with_engines(layers["plain"], "cuda", torch.float32)
        assert fused.experts.gate_up_proj.is_cuda and fused.experts.engine in ENGINE_FUNCTIONS["grouped"]
        x, g = torch.randn(4, 64, D, device="cuda"), torch.randn(4, 64, D, device="cuda")
        a, b = fwd_bwd(ref, x, g), fwd_bwd(fused, x, g)
        assert_close(a[0], b[0], 1e-5, "cuda fp32 forward")
        for n in a[2]:
            assert_close(a[2][n], b[2][n], 1e-5, f"cuda fp32 grad {n}")
        assert_bf16_as_close_as_sorted(ref, lambda x, g: fwd_bwd(fused, x, g), x, g, f"cuda E={E} k={k} {kw}")
        assert count_syncs(fused, x)[1] == 0


def test_decode_step_loop_matches_the_dispatch():
    """model/moe.py's routed_loop, what a layer runs for at most DECODE_TOKENS tokens outside autograd on the
    CPU (a decode step), against the same layer's dispatch path (the call with autograd on) at 1, 2, 8 and
    DECODE_TOKENS tokens: the sorted layer bitwise (expert_loop's ops on the same rows, the sorted combine's
    sum), the fused layer (engines_for's CPU engines) within 1e-6 relative (its experts' GEMMs batched); k = 1,
    a shared expert, an expert no token picks, padding (token_mask) and capacity drops; DECODE_TOKENS + 1
    tokens and autograd take the dispatch path."""
    from model.moe import DECODE_TOKENS
    cases = [dict(num_experts=4, num_experts_per_tok=2), dict(num_experts=4, num_experts_per_tok=1),
             dict(num_experts=8, num_experts_per_tok=2, n_shared_experts=1, shared_expert_intermediate_size=16),
             dict(num_experts=4, num_experts_per_tok=2, capacity_factor=0.5)]
    ran = []
    for kw in cases:
        for impl in ("sorted", "fused"):
            torch.manual_seed(0)
            config = MiniMindConfig(hidden_size=D, num_attention_heads=1, num_key_value_heads=1, head_dim=8, use_moe=True,
                                    moe_intermediate_size=24, moe_impl=impl, **kw)
            engines = engines_for(config, "cpu", torch.float32)
            # (the shared expert on nn.Linear: OneDNNLinear takes MKL for a few rows outside autograd, its own test)
            layer = MOEFeedForward(config, engines.experts, engines.movers).eval()
            with torch.no_grad():  # expert 0 picked by no token: its gate row far below the others
                layer.gate.weight[0] = -10 * layer.gate.weight.abs().sum(0)
            original = model_moe.routed_loop
            for T in (1, 2, 8, DECODE_TOKENS, DECODE_TOKENS + 1):
                x = torch.randn(1, T, D)
                mask = torch.rand(1, T) > 0.3 if T > 2 else None
                want = layer(x, mask)  # (autograd on: the dispatch path)
                calls = []
                with mock.patch.object(model_moe, "routed_loop", lambda *a: calls.append(1) or original(*a)), \
                        torch.no_grad():
                    got = layer(x, mask)
                assert bool(calls) == (T <= DECODE_TOKENS), (kw, impl, T, calls)
                assert not (got == 0).all(dim=-1)[0][mask[0] if mask is not None else slice(None)].any() \
                    or "capacity_factor" in kw, (kw, impl, T, "a real token got no output")
                if impl == "sorted":
                    assert torch.equal(got, want), (kw, impl, T, (got - want).abs().max())
                else:
                    assert (got - want).abs().max() <= 1e-6 * want.abs().max(), (kw, impl, T, (got - want).abs().max())
                ran += [T] if calls else []
    assert set(ran) == {1, 2, 8, DECODE_TOKENS}, ran


TESTS = [test_decode_step_loop_matches_the_dispatch, test_matches_sorted_fp32, test_idle_experts_get_zero_grads, test_deterministic, test_zero_syncs,
         test_empty_and_tiny_inputs, test_state_dict_and_engines,
         test_engine_built_layers_in_float64, test_bf16_autocast_cpu, test_odd_sizes_fall_back, test_plain_engine_on_the_fused_path,
         test_layout_ambiguous_shapes,
         test_direct_call_with_dropped_pairs, test_layer_op_count, test_cuda_matches_sorted]

if __name__ == "__main__":
    run(TESTS)
