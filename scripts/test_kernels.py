"""Kernel tests: every Triton kernel against its plain-PyTorch reference (Triton's CPU interpreter, so
this runs in CI without a GPU; on a CUDA machine the same checks also run on the GPU).

    python scripts/test_kernels.py          # sets TRITON_INTERPRET=1 itself before triton is imported

permute / combine: bitwise (both are gathers plus the same fp32 multiply/add sequence); so is the CPU
embedding_bag combine (a fused gather-and-sum that adds each bag's rows in index order).
grouped GEMM (Triton, torch, oneDNN) and the CPU expert chains: fp32 within 1e-5 relative to the largest
|value|: each accumulates dot products in another order than the reference's matmul (reassociation only;
inputs are exact); bf16 within 2e-2 relative (8 mantissa bits, rounded at different points).
chunked LM-head cross-entropy: against F.cross_entropy in fp64, loss and gradients within 1e-5 relative
in fp32 (the logits' GEMM and the softmax in another order), within 2e-2 under bf16 autocast.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from testlib import Skip, run  # noqa: E402,F401
from kernels.backend import choose, cpu_values, interpreting, triton_importable  # noqa: E402
from kernels.cpu_experts import cpu_experts, cpu_experts_supported  # noqa: E402
from kernels.cpu_linear import Linear, bf16_gemm_speedup, linear, onednn_linear_fits  # noqa: E402
from kernels import linear_cross_entropy as lce  # noqa: E402
from kernels.grouped_gemm import (ScaledSwiGLU, SwiGLU, grouped_mm, grouped_swiglu, onednn_supports,  # noqa: E402
                                  torch_grouped_mm_supports)
from kernels.permute import (combine_rows, combine_rows_reference, gather_rows, gather_rows_reference,  # noqa: E402
                             permute, unpermute_combine)
from model.dispatch import build_row_map  # noqa: E402  (the row maps the permute kernels and cpu_experts read)

# Triton runs CPU tensors only in its interpreter, and the interpreter would also run CUDA tensors (on
# the host): so interpreted runs test on CPU, and TRITON_INTERPRET=0 on a GPU machine tests the compiled
# kernels on CUDA (scripts/gpu_check.sh does both).
DEVICES = ["cpu"] if interpreting() else (["cuda"] if torch.cuda.is_available() else [])


def need_triton():
    if not triton_importable():
        raise Skip("triton is not installed")
    if not DEVICES:
        raise Skip("no device Triton runs on (TRITON_INTERPRET=0 and no CUDA)")


def bits_equal(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.numel() else a,
                                                                      b.view(torch.uint8) if b.numel() else b)


def routing(T, K, E, seed=0, drop=0.0, idle=(), device="cpu"):
    """[T, K] distinct experts per row (never the `idle` ones), a fraction `drop` of entries set to -1."""
    g = torch.Generator().manual_seed(seed)
    pool = [e for e in range(E) if e not in idle]
    rows = [torch.tensor(pool)[torch.randperm(len(pool), generator=g)[:K]] for _ in range(T)]
    idx = torch.stack(rows) if T else torch.zeros(0, K, dtype=torch.int64)
    if drop:
        idx = torch.where(torch.rand(idx.shape, generator=g) < drop, -1, idx)
    return idx.to(device)


CASES = [  # T, K, E, drop, idle experts, pad_to, alignment
    (13, 2, 4, 0.0, (), None, 1),
    (13, 2, 6, 0.0, (1, 4), None, 1),  # experts with zero tokens
    (0, 2, 4, 0.0, (), None, 1),  # N = 0
    (1, 1, 4, 0.0, (), None, 1),  # N = 1
    (9, 4, 4, 0.0, (), None, 1),  # k = E
    (17, 2, 4, 0.0, (), None, 8),  # alignment padding
    (17, 3, 5, 0.3, (2,), None, 4),  # dropped pairs + idle expert + alignment
    (12, 2, 4, 0.4, (), 8, 1),  # pad to capacity
    (12, 2, 4, 0.4, (), 5, 4),  # pad to capacity, then alignment
]


def test_row_map_layout():
    """Rows go expert by expert in ascending (token, slot) order, padding is -1, the maps invert."""
    for T, K, E, drop, idle, pad_to, align in CASES:
        idx = routing(T, K, E, drop=drop, idle=idle)
        rm = build_row_map(idx, E, pad_to, align)
        counts = [int((idx == e).sum()) for e in range(E)]
        assert rm.tokens_per_expert_E.tolist() == counts
        start, expect = 0, []
        for e in range(E):
            pairs = [t * K + j for t in range(T) for j in range(K) if idx[t, j] == e]
            rows = max(counts[e], pad_to or 0)
            rows = -(-rows // align) * align
            expect += pairs + [-1] * (rows - len(pairs))
            start += rows
            assert int(rm.offsets_E[e]) == start, (e, rm.offsets_E)
        got = rm.pair_of_row_P.tolist()
        assert got[:start] == expect and all(v == -1 for v in got[start:]), (got, expect)
        P = E * (-(-pad_to // align) * align) if pad_to is not None else T * K + E * (align - 1)
        assert rm.num_rows == P  # static: known without looking at the data
        for t in range(T):
            for j in range(K):
                r = int(rm.row_of_pair_TK[t, j])
                assert (r == -1) if idx[t, j] < 0 else (got[r] == t * K + j)


def case_maps(dev):
    """(T, K, E, row map) for every routing case, on `dev`."""
    for T, K, E, drop, idle, pad_to, align in CASES:
        yield T, K, E, build_row_map(routing(T, K, E, drop=drop, idle=idle, device=dev), E, pad_to, align)


def test_gather_rows_bitwise():
    need_triton()
    for dev in DEVICES:
        for T, K, E, rm in case_maps(dev):
            for D in (1, 33, 64):
                x = torch.randn(T, D, device=dev)
                scale = torch.rand(rm.num_rows, device=dev)
                for s in (None, scale):
                    want = gather_rows_reference(x, rm.token_of_row_P, s)
                    assert bits_equal(gather_rows(x, rm.token_of_row_P, s, backend="triton"), want), (T, K, E, D)
                xb = x.bfloat16()
                assert bits_equal(gather_rows(xb, rm.token_of_row_P, scale, backend="triton"),
                                  gather_rows_reference(xb, rm.token_of_row_P, scale))


def test_combine_rows_bitwise():
    need_triton()
    for dev in DEVICES:
        for T, K, E, rm in case_maps(dev):
            for D in (1, 33, 64):
                h = torch.randn(rm.num_rows, D, device=dev)
                w = torch.rand(T, K, device=dev)
                for ww in (None, w):
                    want = combine_rows_reference(h, rm.row_of_pair_TK, ww)
                    assert bits_equal(combine_rows(h, rm.row_of_pair_TK, ww, backend="triton"), want), (T, K, E, D)
                hb = h.bfloat16()
                for out_dtype in (None, torch.float32):
                    assert bits_equal(combine_rows(hb, rm.row_of_pair_TK, w, backend="triton", out_dtype=out_dtype),
                                      combine_rows_reference(hb, rm.row_of_pair_TK, w, out_dtype))


def test_hole_free_fast_path_is_the_same():
    """The reference's unmasked path (no -1, no padding) gives the same bits as the masked one."""
    idx = routing(40, 2, 8)
    rm = build_row_map(idx, 8, may_drop=False)
    assert not rm.has_holes
    general = build_row_map(idx, 8)  # the general path's maps are the same
    for f in ("row_of_pair_TK", "pair_of_row_P", "token_of_row_P", "offsets_E", "tokens_per_expert_E"):
        assert torch.equal(getattr(rm, f), getattr(general, f)), f
    x, w = torch.randn(40, 16), torch.rand(40, 2)
    h = torch.randn(rm.num_rows, 16)
    assert bits_equal(gather_rows_reference(x, rm.token_of_row_P, has_holes=False),
                      gather_rows_reference(x, rm.token_of_row_P))
    assert bits_equal(combine_rows_reference(h, rm.row_of_pair_TK, w, has_holes=False),
                      combine_rows_reference(h, rm.row_of_pair_TK, w))


def test_permute_combine_autograd():
    """Gradients of the differentiable permute / unpermute_combine: the reference backend passes
    gradcheck in float64, and the Triton backend's gradients equal the reference's bitwise (fp32)."""
    for T, K, E, drop, idle, pad_to, align in CASES:
        if T == 0:
            continue
        rm = build_row_map(routing(T, K, E, drop=drop, idle=idle), E, pad_to, align)
        x = torch.randn(T, 5, dtype=torch.float64, requires_grad=True)
        h = torch.randn(rm.num_rows, 5, dtype=torch.float64, requires_grad=True)
        w = torch.rand(T, K, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda a: permute(a, rm, "reference"), (x,))
        assert torch.autograd.gradcheck(lambda a, b: unpermute_combine(a, b, rm, "reference"), (h, w))
        if not triton_importable() or not DEVICES:
            continue
        dev = DEVICES[0]
        rm = build_row_map(routing(T, K, E, drop=drop, idle=idle, device=dev), E, pad_to, align)
        xs, hs, ws = (t.detach().float().to(dev).requires_grad_() for t in (x, h, w))
        g_x, g_y = torch.randn(rm.num_rows, 5, device=dev), torch.randn(T, 5, device=dev)
        grads = {}
        for be in ("reference", "triton"):
            gx, = torch.autograd.grad(permute(xs, rm, be), xs, g_x)
            gh, gw = torch.autograd.grad(unpermute_combine(hs, ws, rm, be), (hs, ws), g_y)
            grads[be] = (gx, gh, gw)
        for a, b in zip(grads["reference"], grads["triton"]):
            assert bits_equal(a, b)


def grouped_reference(a, b, offsets):
    """Per-segment fp64 matmuls: the exact product of the fp32 inputs (up to fp64 rounding)."""
    bounds = [0] + offsets.tolist()
    out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64)
    for e in range(b.shape[0]):
        out[bounds[e]:bounds[e + 1]] = a[bounds[e]:bounds[e + 1]].double() @ b[e].double()
    return out


def close(got, want, what):
    scale = max(want.abs().max().item(), 1.0) if want.numel() else 1.0
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    assert err <= 1e-5 * scale, f"{what}: max error {err:.2e} (scale {scale:.1f})"


GEMM_CASES = [  # segment lengths, K, N, rows past the last segment
    ([5, 0, 7, 3], 32, 24, 0),
    ([0, 0, 0], 16, 16, 4),  # M rows but no segment: output rows unspecified/zero, grads zero
    ([1], 8, 8, 0),  # M = 1
    ([0], 8, 8, 0),  # M = 0
    ([17, 40, 0, 33, 2], 48, 40, 6),  # tiles crossing segment ends + a tail
    ([3, 4], 33, 17, 0),  # odd sizes
]


def test_grouped_mm_triton_forward_backward():
    need_triton()
    for dev in DEVICES:
        for lens, K, N, tail in GEMM_CASES:
            offsets = torch.tensor(lens, device=dev).cumsum(0).to(torch.int32)
            M = sum(lens) + tail
            a = torch.randn(M, K, device=dev, requires_grad=True)
            b = torch.randn(len(lens), N, K, device=dev).transpose(1, 2).requires_grad_()  # a transposed view
            c = grouped_mm(a, b, offsets, backend="triton")
            want = grouped_reference(a.detach().cpu(), b.detach().cpu(), offsets.cpu())
            close(c.cpu(), want, f"forward {lens}")
            g = torch.randn(M, N, device=dev)
            ga, gb = torch.autograd.grad(c, (a, b), g)
            a64, b64 = a.detach().cpu().double().requires_grad_(), b.detach().cpu().double().requires_grad_()
            ra, rb = torch.autograd.grad(grouped_mm(a64, b64, offsets.cpu(), backend="reference"), (a64, b64), g.cpu().double())
            n = sum(lens)
            close(ga[:n].cpu(), ra[:n], f"grad a {lens}")
            close(gb.cpu(), rb, f"grad b {lens}")
            assert torch.equal(ga[n:], torch.zeros_like(ga[n:])), "rows past the segments get zero gradient"


def test_grouped_mm_torch_backend_on_cpu():
    """torch's grouped_mm (the CPU/bf16-CUDA path) against the reference, incl. a broadcast gradient."""
    offsets = torch.tensor([5, 5, 12, 16], dtype=torch.int32)
    a = torch.randn(16, 32, requires_grad=True)
    b = torch.randn(4, 24, 32).transpose(1, 2).requires_grad_()
    if not torch_grouped_mm_supports(a, b):
        raise Skip("this torch has no CPU grouped_mm")
    c = grouped_mm(a, b, offsets, backend="torch")
    close(c, grouped_reference(a.detach(), b.detach(), offsets), "torch forward")
    c.sum().backward()  # a stride-0 gradient: torch's own backward rejects it, ours must not
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    grouped_mm(a64, b64, offsets, backend="reference").sum().backward()
    close(a.grad, a64.grad, "torch grad a")
    close(b.grad, b64.grad, "torch grad b")
    assert not torch_grouped_mm_supports(torch.randn(4, 33), torch.randn(2, 33, 8)), "misaligned strides"


def test_grouped_mm_onednn_backend_on_cpu():
    """The CPU oneDNN backend (one matmul per segment) against the fp64 reference: forward and both
    grads over the GEMM cases (empty segments, M = 0 / 1, rows past the last segment, odd sizes), fp32
    and (where the CPU has it) bf16."""
    if not onednn_supports(torch.ones(1), torch.ones(1)):
        raise Skip("this torch has no oneDNN CPU matmul")
    for lens, K, N, tail in GEMM_CASES:
        offsets = torch.tensor(lens).cumsum(0).to(torch.int32)
        M = sum(lens) + tail
        a = torch.randn(M, K, requires_grad=True)
        b = torch.randn(len(lens), N, K).transpose(1, 2).requires_grad_()
        c = grouped_mm(a, b, offsets, backend="onednn")
        close(c, grouped_reference(a.detach(), b.detach(), offsets), f"onednn forward {lens}")
        g = torch.randn(M, N)
        ga, gb = torch.autograd.grad(c, (a, b), g)
        a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
        ra, rb = torch.autograd.grad(grouped_mm(a64, b64, offsets, backend="reference"), (a64, b64), g.double())
        n = sum(lens)
        close(ga[:n], ra[:n], f"onednn grad a {lens}")
        close(gb, rb, f"onednn grad b {lens}")
        assert not ga[n:].any() and not c[n:].any(), "rows past the segments: zero output and gradient"
    if onednn_supports(torch.ones(1, dtype=torch.bfloat16), torch.ones(1)):
        a, b = torch.randn(20, 32), torch.randn(3, 32, 16)
        offsets = torch.tensor([7, 7, 20], dtype=torch.int32)
        got = grouped_mm(a.bfloat16(), b.bfloat16(), offsets, backend="onednn").double()
        want = grouped_reference(a.bfloat16().float(), b.bfloat16().float(), offsets)
        assert (got - want).abs().max() <= 2e-2 * want.abs().max(), "bf16"
    try:
        grouped_mm(torch.randn(4, 4, dtype=torch.float64), torch.randn(1, 4, 4, dtype=torch.float64),
                   torch.tensor([4], dtype=torch.int32), backend="onednn")
    except RuntimeError as e:
        assert "oneDNN" in str(e)
    else:
        raise AssertionError("fp64 accepted by the oneDNN backend")


def test_embedding_bag_combine_is_the_reference():
    """The CPU fast path of the unweighted combine (torch's embedding_bag) equals the reference bit for
    bit, and is refused where it would not (weights, holes, other dtypes)."""
    for T, K, E, drop, idle, pad_to, align in CASES:
        rm = build_row_map(routing(T, K, E, drop=drop, idle=idle), E, pad_to, align)
        for dtype in (torch.float32, torch.float64):
            h = torch.randn(rm.num_rows, 37, dtype=dtype)
            want = combine_rows_reference(h, rm.row_of_pair_TK, has_holes=rm.has_holes)
            if rm.has_holes or rm.num_rows == 0:
                try:
                    combine_rows(h, rm.row_of_pair_TK, backend="embedding_bag", has_holes=rm.has_holes)
                except RuntimeError:
                    continue
                raise AssertionError("embedding_bag combine accepted holes or an empty buffer")
            assert bits_equal(combine_rows(h, rm.row_of_pair_TK, backend="embedding_bag", has_holes=False), want)
    rm = build_row_map(routing(30, 3, 6), 6, may_drop=False)
    h = torch.randn(rm.num_rows, 8)
    for bad in (dict(w_TK=torch.rand(30, 3)), dict(out_dtype=torch.float64)):
        try:
            combine_rows(h, rm.row_of_pair_TK, backend="embedding_bag", has_holes=False, **bad)
        except RuntimeError:
            pass
        else:
            raise AssertionError(f"embedding_bag combine accepted {list(bad)}")


def test_scaled_swiglu_gradients():
    """SwiGLU with a per-row scale (the routing weight applied before the down projection): gradcheck
    in fp64, and equal to the unscaled SwiGLU times the scale."""
    gu = torch.randn(9, 8, dtype=torch.float64, requires_grad=True)
    s = torch.rand(9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(ScaledSwiGLU.apply, (gu, s))
    assert torch.allclose(ScaledSwiGLU.apply(gu, s), SwiGLU.apply(gu) * s[:, None])


def cpu_experts_reference(experts, x, scale_P, rm):
    """Per expert, per routed row: scale * expert(x[token]), summed per token in fp64 (autograd)."""
    y = torch.zeros(x.shape, dtype=torch.float64)
    starts = [0] + rm.offsets_E.tolist()[:-1]
    for e, (start, n) in enumerate(zip(starts, rm.tokens_per_expert_E.tolist())):
        tok = rm.token_of_row_P[start:start + n]
        h = experts[e](x[tok]).double() * scale_P[start:start + n, None].double()
        y = y.index_add(0, tok, h)
    return y


def test_cpu_experts_chains():
    """kernels.cpu_experts (the fused path's CPU expert compute) against a per-expert autograd
    reference: output, grad x, grad of the row scales and every expert weight; over the row-map cases
    (idle experts get zero weight grads, padding rows are skipped, dropped pairs add nothing), fp32 and
    bf16; two runs bitwise identical."""
    from model.experts import FeedForward
    if not cpu_experts_supported("cpu", torch.float32):
        raise Skip("this torch has no oneDNN CPU matmul")
    for T, K, E, drop, idle, pad_to, align in CASES + [(200, 2, 3, 0.1, (), None, 1)]:  # rows > a bucket
        torch.manual_seed(T + K + E)
        experts = torch.nn.ModuleList(FeedForward(12, 20) for _ in range(E))
        rm = build_row_map(routing(T, K, E, drop=drop, idle=idle), E, pad_to, align)
        x = torch.randn(T, 12, requires_grad=True)
        scale = torch.rand(rm.num_rows, requires_grad=True)
        g = torch.randn(T, 12)
        params = [x, scale, *experts.parameters()]
        got = torch.autograd.grad(cpu_experts(experts, x, scale, rm), params, g, allow_unused=True)
        y = cpu_experts(experts, x, scale, rm)
        want = torch.autograd.grad(cpu_experts_reference(experts, x, scale, rm), params, g.double(),
                                   allow_unused=True)
        what = f"T={T} K={K} E={E} drop={drop} idle={idle} pad={pad_to} align={align}"
        close(y, cpu_experts_reference(experts, x, scale, rm).detach(), what + " forward")
        for i, (a, b) in enumerate(zip(got, want)):
            assert a is not None, f"{what}: gradient {i} missing (idle experts need zero grads)"
            close(a, torch.zeros_like(a) if b is None else b, f"{what} grad {i}")
        again = torch.autograd.grad(cpu_experts(experts, x, scale, rm), params, g, allow_unused=True)
        assert all(bits_equal(a, b) for a, b in zip(got, again)), what + " rerun"
    if cpu_experts_supported("cpu", torch.bfloat16):
        experts = torch.nn.ModuleList(FeedForward(16, 32) for _ in range(4)).bfloat16()
        rm = build_row_map(routing(40, 2, 4), 4, may_drop=False)
        x = torch.randn(40, 16).bfloat16()
        scale = torch.rand(rm.num_rows)
        got = cpu_experts(experts, x, scale, rm).double()
        want = cpu_experts_reference(experts, x, scale, rm)
        assert (got - want).abs().max() <= 2e-2 * want.abs().max(), "bf16"
    try:
        cpu_experts(torch.nn.ModuleList([FeedForward(4, 4)]), torch.randn(2, 4, dtype=torch.float64),
                    torch.ones(2), build_row_map(torch.zeros(2, 1, dtype=torch.long), 1))
    except ValueError as e:
        assert "cpu_experts" in str(e)
    else:
        raise AssertionError("fp64 accepted by cpu_experts")


def test_cpu_experts_autograd_modes():
    """Backward twice with retain_graph, frozen experts (no weight grads computed), no_grad (nothing kept),
    and double backward refused with a clear error."""
    from model.experts import FeedForward
    if not cpu_experts_supported("cpu", torch.float32):
        raise Skip("this torch has no oneDNN CPU matmul")
    from kernels.cpu_experts import _bucket
    assert [_bucket(n) for n in (0, 1, 16, 17, 100, 512, 513, 1000)] == [0, 1, 16, 24, 104, 512, 544, 1024]
    torch.manual_seed(0)
    experts = torch.nn.ModuleList(FeedForward(8, 12) for _ in range(3))
    rm = build_row_map(routing(50, 2, 3), 3, may_drop=False)
    x = torch.randn(50, 8, requires_grad=True)
    scale = torch.rand(rm.num_rows, requires_grad=True)
    y = cpu_experts(experts, x, scale, rm)
    g1 = torch.autograd.grad(y.sum(), (x, scale), retain_graph=True)
    g2 = torch.autograd.grad(y.sum(), (x, scale))
    assert all(bits_equal(a, b) for a, b in zip(g1, g2)), "second backward with retain_graph"
    for p in experts.parameters():
        p.requires_grad_(False)
    gx, = torch.autograd.grad(cpu_experts(experts, x, scale, rm).sum(), x)
    assert bits_equal(gx, g1[0]) and all(p.grad is None for p in experts.parameters())
    with torch.no_grad():
        assert not cpu_experts(experts, x, scale, rm).requires_grad
    y = cpu_experts(experts, x, scale, rm)
    gx, = torch.autograd.grad(y.sum(), x, create_graph=True)
    try:
        gx.sum().backward()
    except RuntimeError as e:
        assert "once_differentiable" in str(e) or "double backward" in str(e) or "does not require grad" in str(e), e
    else:
        raise AssertionError("double backward through cpu_experts did not raise")


def test_cpu_values_refuses_device_tensors():
    """The host read of CPU kernels' segment bounds refuses tensors on other devices (a real sync)."""
    assert cpu_values(torch.tensor([3, 5])) == [3, 5]
    try:
        cpu_values(torch.empty(2, device="meta"))
    except ValueError as e:
        assert "CPU" in str(e)
    else:
        raise AssertionError("a non-CPU tensor was read")


def test_grouped_swiglu_matches_per_expert_ffn():
    from model.experts import FeedForward
    torch.manual_seed(0)
    lens, D, F_ = [6, 0, 9], 16, 12
    experts = [FeedForward(D, F_) for _ in lens]
    offsets = torch.tensor(lens).cumsum(0).to(torch.int32)
    x = torch.randn(sum(lens), D)
    w_gu = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in experts])
    w_d = torch.stack([e.down_proj.weight for e in experts])
    want = torch.cat([experts[e](x[int(s):int(s) + n]) for e, (s, n) in enumerate(zip([0, 6, 6], lens))])
    backends = ["reference", "torch"] + (["triton"] if triton_importable() else []) + (
        ["onednn"] if onednn_supports(x, x) else [])
    for be in backends:
        close(grouped_swiglu(x, w_gu, w_d, offsets, backend=be), want, be)
    g = torch.randn(7, 2 * F_, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(SwiGLU.apply, (g,))


def test_backend_choice_errors():
    x = torch.randn(2, 2)
    for bad in ("cuda", "", None):
        try:
            choose(bad, x, "gather_rows")
        except ValueError as e:
            assert "backend" in str(e)
        else:
            raise AssertionError(f"backend {bad!r} accepted")
    try:
        grouped_mm(torch.randn(3, 4), torch.randn(2, 5, 4), torch.tensor([1, 3], dtype=torch.int32))
    except ValueError as e:
        assert "do not fit" in str(e)
    else:
        raise AssertionError("mismatched shapes accepted")


def test_kernels_compile_for_hopper():
    """Every Triton kernel compiles to a cubin for sm_90 (H100/H200), fp32 and bf16, without a GPU
    (scripts/check_triton_compile.py, in a process without the interpreter): CI then catches what the
    interpreter lets through (loop-carried types, constexpr branches, dot precision flags)."""
    if not triton_importable():
        raise Skip("triton is not installed")
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "check_triton_compile.py")],
                       capture_output=True, text=True, env=env, timeout=600)
    if r.returncode == 2:
        raise Skip(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


def test_onednn_linear_matches_fp64():
    """kernels/cpu_linear.py against F.linear in fp64: forward, grad x, grad W within 1e-5 relative (fp32
    rounding of a K <= 384 dot product, in oneDNN's summation order; measured ~8e-7), for 2-D, 3-D and
    non-contiguous inputs; the "torch" backend is F.linear bitwise."""
    if not onednn_linear_fits(torch.zeros(1), torch.zeros(1)):
        raise Skip("this torch has no oneDNN for CPU fp32")
    gen = torch.Generator().manual_seed(0)
    for shape, N in [((1024, 256), 6400), ((8, 128, 256), 768), ((3, 5, 7), 9), ((1, 384), 256)]:
        x = torch.randn(*shape, generator=gen)
        if len(shape) == 3:
            x = x.transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous view
        w = torch.randn(N, shape[-1], generator=gen)
        g = torch.randn(*shape[:-1], N, generator=gen)
        x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = linear(x1, w1, "onednn")
        y.backward(g)
        xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
        yd = F.linear(xd, wd)
        yd.backward(g.double())
        for got, want, what in [(y, yd, "y"), (x1.grad, xd.grad, "grad x"), (w1.grad, wd.grad, "grad W")]:
            rel = ((got.double() - want).abs().max() / want.abs().max()).item()
            assert got.dtype == torch.float32 and rel < 1e-5, f"{shape} {what}: relative error {rel:.2e}"
        assert torch.equal(linear(x, w, "torch"), F.linear(x, w))


def test_onednn_linear_choices():
    """"auto" leaves autocast and non-fp32 operands to F.linear (bitwise), "onednn" refuses them, a bad
    backend is a ValueError; Linear keeps nn.Linear's parameters and state_dict keys."""
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not onednn_linear_fits(x, w)
        assert torch.equal(linear(x, w), F.linear(x, w)) and linear(x, w).dtype == torch.bfloat16
        try:
            linear(x, w, "onednn")
            raise AssertionError("onednn under autocast did not raise")
        except ValueError as e:
            assert "autocast" in str(e)
    xd, wd = x.double(), w.double()
    assert torch.equal(linear(xd, wd), F.linear(xd, wd))
    for bad in ("mkl", None):
        try:
            linear(x, w, bad)
            raise AssertionError(f"backend {bad!r} did not raise")
        except ValueError:
            pass
    layer = Linear(16, 8, "auto")
    assert isinstance(layer, torch.nn.Linear) and layer.bias is None and list(layer.state_dict()) == ["weight"]
    assert 0.0 <= bf16_gemm_speedup(64, 32, 64, reps=1) < 100


def test_linear_cross_entropy_matches_reference():
    """kernels/linear_cross_entropy.py against F.cross_entropy(F.linear(h, W)) in fp64: the loss and the
    gradients of h and W within 1e-5 relative to the largest value in fp32 (measured ~1e-6), for a row
    count that is not a multiple of the chunk, ignored labels and an incoming gradient other than 1;
    under bf16 autocast within 2e-2 of the fp64 reference and the same dtypes as autocast's path (fp32
    loss, fp32 leaf gradients); every label ignored gives nan like F.cross_entropy, with a zero gradient;
    bad shapes raise."""
    gen = torch.Generator().manual_seed(0)
    saved = lce.CHUNK_ELEMENTS
    try:
        lce.CHUNK_ELEMENTS = 7 * 500  # 7 rows a chunk: the last chunk of 300 rows is partial
        N, D, V = 300, 48, 500
        h = torch.randn(N, D, generator=gen)
        w = torch.randn(V, D, generator=gen) * 0.2
        labels = torch.randint(0, V, (N,), generator=gen)
        labels[::9] = -100
        hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
        want = F.cross_entropy(F.linear(hd, wd), labels, ignore_index=-100)
        (want * 0.37).backward()
        for bf16, tol in ((False, 1e-5), (True, 2e-2)):
            h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                got = lce.linear_cross_entropy(h1, w1, labels)
            (got * 0.37).backward()
            assert got.dtype == torch.float32 and h1.grad.dtype == w1.grad.dtype == torch.float32
            for g, r, what in ((got, want, "loss"), (h1.grad, hd.grad, "grad h"), (w1.grad, wd.grad, "grad W")):
                rel = ((g.double() - r).abs().max() / r.abs().max()).item()
                assert rel < tol, f"bf16={bf16} {what}: relative error {rel:.2e}"
        h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
        none = lce.linear_cross_entropy(h1, w1, torch.full((N,), -100))
        none.nan_to_num().backward()  # the trainer's zero share of an unsupervised micro-batch
        assert none.isnan() and not h1.grad.any() and not w1.grad.any()
        with torch.no_grad():  # no gradient wanted: the same loss
            assert torch.equal(lce.linear_cross_entropy(h, w, labels), lce.linear_cross_entropy(h, w, labels))
    finally:
        lce.CHUNK_ELEMENTS = saved
    for bad in ((h, w[:, :5], labels), (h, w, labels[:5]), (h[None], w, labels)):
        try:
            lce.linear_cross_entropy(*bad)
            raise AssertionError("bad shapes did not raise")
        except ValueError as e:
            assert "linear_cross_entropy" in str(e)
    assert lce.use_chunked("auto", "cpu") and lce.use_chunked("chunked", "cpu") and not lce.use_chunked("torch", "cpu")
    try:
        lce.use_chunked("fast", "cpu")
        raise AssertionError("a bad impl did not raise")
    except ValueError:
        pass


TESTS = [test_linear_cross_entropy_matches_reference, test_onednn_linear_matches_fp64, test_onednn_linear_choices, test_row_map_layout, test_gather_rows_bitwise, test_combine_rows_bitwise, test_hole_free_fast_path_is_the_same,
         test_permute_combine_autograd, test_grouped_mm_triton_forward_backward, test_grouped_mm_torch_backend_on_cpu,
         test_grouped_mm_onednn_backend_on_cpu, test_embedding_bag_combine_is_the_reference, test_scaled_swiglu_gradients,
         test_cpu_experts_chains, test_cpu_experts_autograd_modes, test_cpu_values_refuses_device_tensors,
         test_grouped_swiglu_matches_per_expert_ffn, test_backend_choice_errors, test_kernels_compile_for_hopper]

if __name__ == "__main__":
    run(TESTS)
