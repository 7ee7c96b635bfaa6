"""The fused MoE path (moe_impl="fused") against the sorted layer, the bitwise reference.

    python scripts/test_moe_fused.py

The fused layer (RowMapDispatcher + SwiGLUExperts) has two expert implementations (`layer.experts.impl`,
model/experts.py): "grouped" (permute -> grouped GEMM -> combine, the GPU design) and "cpu_chains"
(per-expert oneDNN chains, what "auto" picks on CPU); every equivalence test runs both.

Tolerance, fp32: forward and every gradient within 1e-5 absolute on outputs of size ~0.1-1 (the grouped
GEMM sums each dot product in another order than per-expert nn.Linear, the routing weight is applied
before the down projection instead of after it, and the combine accumulates in fp32: differences are a
few ulps, ~1e-7 measured). bf16 autocast: within 2e-2 (bf16 has 8 mantissa bits;
both paths round the expert outputs to bf16 once, at different points).
"""
import contextlib
import warnings

import torch

from testlib import Skip, run  # noqa: F401
from sync_count import count_syncs
from model.dispatch import RowLayout, RowMapDispatcher, SortedDispatcher
from model.experts import _back_to_back
from model.model_minimind import MiniMindConfig, MOEFeedForward

D = 32
IMPLS = ("cpu_chains", "grouped")


@contextlib.contextmanager
def fused_impl(mod, impl, gemm_backend="auto", permute_backend="auto"):
    """Run the fused layer `mod` with a given experts implementation and kernel backends (its public
    attributes experts.impl, experts.gemm_backend, dispatcher.permute_backend), then restore them."""
    saved = mod.experts.impl, mod.experts.gemm_backend, mod.dispatcher.permute_backend
    mod.experts.impl, mod.experts.gemm_backend, mod.dispatcher.permute_backend = impl, gemm_backend, permute_backend
    try:
        yield mod
    finally:
        mod.experts.impl, mod.experts.gemm_backend, mod.dispatcher.permute_backend = saved


def dispatch_experts_combine(dispatcher, experts, x_TD, topk_idx_TK, topk_weight_TK, layout=None):
    """The MoE layer's steps 3-5 on given routing: x_TD [T, D] -> y_TD [T, D]."""
    permute = not experts.gathers_own_rows(x_TD)
    rows, tokens_per_expert, handle = dispatcher.dispatch(x_TD, topk_idx_TK, topk_weight_TK, layout, permute)
    return dispatcher.combine(experts(rows, tokens_per_expert, handle), handle)


def pair(E, k, seed=0, **kw):
    """(sorted layer, fused layer) with the same weights."""
    torch.manual_seed(seed)
    cfg = dict(hidden_size=D, num_attention_heads=1, num_key_value_heads=1, head_dim=8, use_moe=True,
               num_experts=E, num_experts_per_tok=k, moe_intermediate_size=24, **kw)
    ref = MOEFeedForward(MiniMindConfig(**cfg)).train()
    fused = MOEFeedForward(MiniMindConfig(**cfg, moe_impl="fused")).train()
    fused.load_state_dict(ref.state_dict())
    return ref, fused


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


def test_matches_sorted_fp32():
    for (E, k, kw), impl in ((c, i) for c in CONFIGS for i in IMPLS):
        ref, fused = pair(E, k, **kw)
        for S in (1, 7, 50):
            x = torch.randn(2, S, D)
            g = torch.randn(2, S, D)
            ya, dxa, ga = fwd_bwd(ref, x, g)
            with fused_impl(fused, impl):
                yb, dxb, gb = fwd_bwd(fused, x, g)
            what = f"{impl} E={E} k={k} {kw} S={S}"
            assert_close(ya, yb, 1e-5, what + " forward")
            assert_close(dxa, dxb, 1e-5, what + " grad x")
            for n in ga:
                assert_close(ga[n], gb[n], 1e-5, f"{what} grad {n}")
            assert torch.equal(ref.stats.tokens_per_expert, fused.stats.tokens_per_expert), what
            pads = kw.get("moe_pad_to_capacity") or kw.get("moe_expert_alignment", 1) > 1
            if pads:
                assert ref.stats.padded_tokens_per_expert.tolist() == fused.stats.padded_tokens_per_expert.tolist(), what
            else:
                assert ref.stats.padded_tokens_per_expert is None and fused.stats.padded_tokens_per_expert is None
            assert torch.equal(ref.aux_loss, fused.aux_loss), what


def test_idle_experts_get_zero_grads():
    """An expert with no tokens still gets a (zero) gradient in training (DDP needs every parameter)."""
    ref, fused = pair(6, 1)
    with torch.no_grad():
        fused.gate.weight[:, 0] = 0.0
        fused.gate.weight[5] = 0.0
        fused.gate.weight[5, 0] = -1000.0
    x = torch.randn(1, 20, D)
    x[..., 0] = x[..., 0].abs() + 1.0
    for impl in IMPLS:
        with fused_impl(fused, impl):
            _, _, grads = fwd_bwd(fused, x, torch.randn(1, 20, D))
        assert int(fused.stats.tokens_per_expert[5]) == 0
        for name in ("gate_proj", "up_proj", "down_proj"):
            g = grads[f"experts.5.{name}.weight"]
            assert g is not None and not g.abs().any(), f"{impl} {name}"


def test_deterministic():
    for (E, k, kw), impl in ((c, i) for c in CONFIGS[:6] for i in IMPLS):
        _, fused = pair(E, k, **kw)
        x, g = torch.randn(3, 40, D), torch.randn(3, 40, D)
        with fused_impl(fused, impl):
            a, b = fwd_bwd(fused, x, g), fwd_bwd(fused, x, g)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert all(torch.equal(a[2][n], b[2][n]) for n in a[2])


def test_zero_syncs():
    """No sync-inducing call in the forward, in training and eval, with capacity, padding and alignment:
    with the CPU expert chains (which read their segment bounds from CPU memory: not a sync), and with
    the grouped path on torch's grouped_mm, whose offsets never leave the device (the CUDA design)."""
    variants = [("cpu_chains", {}), ("grouped", {"gemm_backend": "torch", "permute_backend": "reference"})]
    for E, k, kw in CONFIGS + [(64, 8, {}), (16, 4, {"capacity_factor": 1.25, "moe_pad_to_capacity": True})]:
        ref, fused = pair(E, k, **kw)
        x = torch.randn(2, 30, D)
        for train in (True, False):
            for impl, backends in variants:
                fused.train(train)
                with fused_impl(fused, impl, **backends):
                    _, syncs = count_syncs(fused, x)
                assert syncs == 0, f"{impl} E={E} k={k} {kw} train={train}: {syncs} syncs"
            ref.train(train)
            assert count_syncs(ref, x)[1] == 1


def test_empty_and_tiny_inputs():
    for kw in ({}, {"moe_expert_alignment": 4}, {"capacity_factor": 2.0, "moe_pad_to_capacity": True}):
        ref, fused = pair(4, 2, **kw)
        for shape, impl in ((s, i) for s in ((1, 0, D), (0, 5, D), (1, 1, D)) for i in IMPLS):
            x = torch.randn(*shape)
            with fused_impl(fused, impl):
                assert_close(ref(x).detach(), fused(x).detach(), 1e-5, f"{impl} {kw} {shape}")
                xi = x.clone().requires_grad_()
                fused(xi).sum().backward()
            assert xi.grad.shape == x.shape
    # an EP rank that received no pairs but pads every expert to an alignment: P > 0 rows, T = 0 tokens
    _, fused = pair(4, 2)
    for impl in IMPLS:
        with fused_impl(fused, impl):
            y = dispatch_experts_combine(RowMapDispatcher(4), fused.experts, torch.randn(0, D),
                                         torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2), RowLayout(None, 4))
        assert y.shape == (0, D), impl


def test_state_dict_and_packing():
    """Same keys as the sorted layer; weights are views of two buffers and stay so through an optimizer
    step, .to(dtype) and load_state_dict; replaced weights are packed again by the next forward (stacked
    as copies inside inference_mode), also after deepcopy."""
    ref, fused = pair(4, 2)
    assert list(ref.state_dict()) == list(fused.state_dict())

    def packed(mod):
        gu = [w for ex in mod.experts for w in (ex.gate_proj.weight, ex.up_proj.weight)]
        return _back_to_back(gu) and _back_to_back([ex.down_proj.weight for ex in mod.experts])

    assert packed(fused)
    opt = torch.optim.AdamW(fused.parameters(), lr=1e-2)
    fused(torch.randn(1, 9, D)).sum().backward()
    opt.step()
    assert packed(fused)
    fused.to(torch.float64)
    assert packed(fused) and fused.experts[0].gate_proj.weight.dtype == torch.float64
    fused.to(torch.float32)
    fused.load_state_dict(ref.state_dict())
    assert packed(fused)
    x = torch.randn(1, 9, D)
    want = ref(x)
    fused.load_state_dict(ref.state_dict(), assign=True)  # new tensors: no longer back to back
    assert not packed(fused)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_close(fused(x), want, 1e-5, "unpacked fallback")  # no re-packing inside inference_mode
    assert not packed(fused)
    assert_close(fused(x), want, 1e-5, "re-packed by the forward")
    assert packed(fused)
    import copy
    twin = copy.deepcopy(fused)
    assert_close(twin(x), want, 1e-5, "deepcopy")
    assert packed(twin) and packed(fused)


def test_bf16_autocast_cpu():
    ref, fused = pair(8, 2)
    x, g = torch.randn(2, 16, D), torch.randn(2, 16, D)
    for impl in IMPLS:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = fwd_bwd(ref, x, g)
            with fused_impl(fused, impl):
                b = fwd_bwd(fused, x, g)
        assert a[0].dtype == b[0].dtype == x.dtype
        assert_close(a[0], b[0], 2e-2, f"{impl} bf16 autocast")
        assert_close(a[1], b[1], 2e-2, f"{impl} bf16 autocast grad x")
        for n in a[2]:
            assert_close(a[2][n], b[2][n], 5e-2, f"{impl} bf16 autocast grad {n}")


def test_odd_sizes_fall_back():
    """Sizes torch's grouped_mm cannot take, in forward or only in backward (rows not 16-byte multiples:
    D or F not a multiple of 4 in fp32, of 8 in bf16), use the reference loop in the grouped path when
    oneDNN is not there (as on CUDA, where it never is); the CPU expert chains and the oneDNN grouped GEMM
    take any size. Values and all grads agree in every variant."""
    import kernels.grouped_gemm as G
    for D_, F_, dtype in ((33, 13, None), (32, 13, None), (33, 24, None), (36, 64, torch.bfloat16),
                          (100, 64, torch.bfloat16)):
        torch.manual_seed(0)
        cfg = dict(hidden_size=D_, num_attention_heads=1, num_key_value_heads=1, head_dim=8, use_moe=True,
                   num_experts=4, num_experts_per_tok=2, moe_intermediate_size=F_)
        ref = MOEFeedForward(MiniMindConfig(**cfg)).train()
        fused = MOEFeedForward(MiniMindConfig(**cfg, moe_impl="fused")).train()
        fused.load_state_dict(ref.state_dict())
        x, g = torch.randn(2, 11, D_), torch.randn(2, 11, D_)
        tol = 1e-5 if dtype is None else 5e-2
        for variant in ("cpu_chains", "grouped", "grouped without oneDNN"):
            supports = G.onednn_supports
            if variant == "grouped without oneDNN":
                G.onednn_supports = lambda a, b: False
            try:
                with (warnings.catch_warnings(), fused_impl(fused, variant.split()[0]),
                      torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)):
                    warnings.simplefilter("ignore")
                    a, b = fwd_bwd(ref, x, g), fwd_bwd(fused, x, g)
            finally:
                G.onednn_supports = supports
            what = f"{variant} D={D_} F={F_} {dtype}"
            assert_close(a[0], b[0], tol, what + " forward")
            assert_close(a[1], b[1], tol, what + " grad x")
            for n in a[2]:
                assert_close(a[2][n], b[2][n], tol, f"{what} grad {n}")


def test_direct_call_with_dropped_pairs():
    """The dispatchers and experts called directly with -1 entries (as the EP transport passes them, in
    any slot order): those pairs contribute 0; sorted and row-map paths agree; an unknown impl is refused."""
    ref, fused = pair(4, 2)
    x = torch.randn(10, D)
    idx = torch.tensor([[0, 1], [-1, 2], [3, -1], [-1, -1], [3, 0], [1, 2], [2, 3], [0, 2], [-1, 1], [1, 0]])
    w = torch.rand(10, 2)
    want = dispatch_experts_combine(SortedDispatcher(4), ref.experts, x, idx, w)
    for impl in IMPLS:
        with fused_impl(fused, impl):
            got = dispatch_experts_combine(RowMapDispatcher(4), fused.experts, x, idx, w)
        assert_close(got, want, 1e-5, f"{impl} dropped pairs")
        assert not got[3].abs().any()
    for attr, bad in (("impl", "fast"), ("gemm_backend", "cuda")):
        try:
            setattr(fused.experts, attr, bad)
        except ValueError as e:
            assert attr in str(e)
        else:
            raise AssertionError(f"unknown {attr} accepted")


def test_compiles_without_graph_breaks():
    """torch.compile(fullgraph=True) traces the fused layer's forward and backward in one graph (no
    data-dependent shape, no host read) and computes the same values."""
    ref, fused = pair(4, 2)
    x, g = torch.randn(2, 16, D), torch.randn(2, 16, D)
    compiled = torch.compile(fused, fullgraph=True)
    a = fwd_bwd(ref, x, g)
    xi = x.clone().requires_grad_()
    y = compiled(xi)
    (y * g).sum().backward()
    assert_close(a[0], y.detach(), 1e-5, "compiled forward")
    assert_close(a[1], xi.grad, 1e-5, "compiled grad x")
    for n, p in fused.named_parameters():
        assert_close(a[2][n], p.grad, 1e-5, f"compiled grad {n}")


def test_cuda_matches_sorted():
    if not torch.cuda.is_available():
        raise Skip("needs CUDA")
    for E, k, kw in CONFIGS[:6]:
        ref, fused = pair(E, k, **kw)
        ref.cuda(), fused.cuda()
        x, g = torch.randn(4, 64, D, device="cuda"), torch.randn(4, 64, D, device="cuda")
        a, b = fwd_bwd(ref, x, g), fwd_bwd(fused, x, g)
        assert_close(a[0], b[0], 1e-5, "cuda fp32 forward")
        for n in a[2]:
            assert_close(a[2][n], b[2][n], 1e-5, f"cuda fp32 grad {n}")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            a, b = fwd_bwd(ref, x, g), fwd_bwd(fused, x, g)
        assert_close(a[0], b[0], 2e-2, "cuda bf16 forward")
        for n in a[2]:
            assert_close(a[2][n], b[2][n], 5e-2, f"cuda bf16 grad {n}")
        assert count_syncs(fused, x)[1] == 0


TESTS = [test_matches_sorted_fp32, test_idle_experts_get_zero_grads, test_deterministic, test_zero_syncs,
         test_empty_and_tiny_inputs, test_state_dict_and_packing, test_bf16_autocast_cpu, test_odd_sizes_fall_back,
         test_direct_call_with_dropped_pairs, test_compiles_without_graph_breaks, test_cuda_matches_sorted]

if __name__ == "__main__":
    run(TESTS)
