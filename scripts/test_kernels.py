"""Kernel tests: every Triton kernel against its plain-PyTorch reference (Triton's CPU interpreter, so
this runs in CI without a GPU; on a CUDA machine the same checks also run on the GPU).

    python scripts/test_kernels.py          # sets TRITON_INTERPRET=1 itself before triton is imported

permute / combine: bitwise (both are gathers plus the same fp32 add sequence); so is the CPU
embedding_bag combine inside the reference (a fused gather-and-sum that adds each bag's rows in index order).
grouped GEMM (Triton, torch, reference) and the CPU expert GEMMs (kernels/experts.py: cpu_experts_for): fp32
within 1e-5 relative to the largest |value|: each accumulates dot products in another order than the
reference's matmul (reassociation only; inputs are exact); bf16 within 2e-2 relative (8 mantissa bits,
rounded at different points).
chunked LM-head cross-entropy: against F.cross_entropy in fp64, loss and gradients within 1e-5 relative
in fp32 (the logits' GEMM and the softmax in another order), within 2e-2 under bf16 autocast.
"""
import contextlib
import os
import warnings
from unittest import mock

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from testlib import Skip, run  # noqa: E402,F401
from kernels.backend import cpu_values, interpreting, triton_importable, triton_runs_on  # noqa: E402
from kernels.experts import (GROUPED_EXPERTS, CPUExperts, cpu_experts_for, cpu_experts_rows_bucketed,  # noqa: E402
                             cpu_experts_rows_in_place)
from kernels.cpu_linear import OneDNNLinear, linear, onednn_linear_fits, onednn_runs  # noqa: E402
from kernels import linear_cross_entropy as lce  # noqa: E402
from kernels.cpu_linear import _OneDNNLinear as cpu_linear_function  # noqa: E402
from kernels.grouped_gemm import GROUPED_OPS, GroupedOps, GroupedSwiGLU, torch_grouped_mm_fits  # noqa: E402
from kernels.permute import gather_rows_triton, sum_rows_triton  # noqa: E402
from train.engines import TRITON_MOVERS, describe, engines_for, grouped_experts_for  # noqa: E402
from testlib import rebuilt  # noqa: E402
from model.dispatch import (PLAIN_MOVERS, Combine, Permute, build_row_map,  # noqa: E402
                            gather_rows, sum_rows)  # (the row maps the permute kernels read; the reference)
from model.moe import Experts, FeedForward, expert_loop  # noqa: E402

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


def num_rows(rm):
    return rm.pair_of_row_P.shape[0]


def test_row_map_layout():
    """Rows go expert by expert in ascending (token, slot) order, padding is -1, the maps invert."""
    for T, K, E, drop, idle, pad_to, align in CASES:
        idx = routing(T, K, E, drop=drop, idle=idle)
        rm = build_row_map(idx, E, pad_to, align)
        counts = [int((idx == e).sum()) for e in range(E)]
        assert rm.routed_E.tolist() == counts
        start, expect, padded = 0, [], []
        for e in range(E):
            pairs = [t * K + j for t in range(T) for j in range(K) if idx[t, j] == e]
            rows = max(counts[e], pad_to or 0)
            rows = -(-rows // align) * align
            expect += pairs + [-1] * (rows - len(pairs))
            padded.append(rows)
            start += rows
        assert rm.padded_E.tolist() == padded, (rm.padded_E, padded)
        got = rm.pair_of_row_P.tolist()
        assert got[:start] == expect and all(v == -1 for v in got[start:]), (got, expect)
        assert rm.token_of_row_P.tolist() == [-1 if v < 0 else v // K for v in got]
        P = E * (-(-pad_to // align) * align) if pad_to is not None else T * K + E * (align - 1)
        assert num_rows(rm) == P  # static: known without looking at the data
        for t in range(T):
            for j in range(K):
                r = int(rm.row_of_pair_TK[t, j])
                assert (r == -1) if idx[t, j] < 0 else (got[r] == t * K + j)


def case_maps(dev):
    """(T, K, E, row map) for every routing case, on `dev`."""
    for T, K, E, drop, idle, pad_to, align in CASES:
        yield T, K, E, build_row_map(routing(T, K, E, drop=drop, idle=idle, device=dev), E, pad_to, align)


DTYPE_PAIRS = [(torch.float32, None), (torch.float32, torch.bfloat16), (torch.bfloat16, None),
               (torch.bfloat16, torch.float32)]  # (input dtype, out_dtype): fp32 -> bf16 tests the rounding


def test_gather_rows_bitwise():
    """Triton gather_rows_triton == model/dispatch.py's gather_rows (the reference) bit for bit: every row-map
    case, odd widths, fp32 / bf16 in and out (the fp32 -> bf16 cast must round to nearest even as torch does),
    with and without holes."""
    need_triton()
    for dev in DEVICES:
        for T, K, E, rm in case_maps(dev):
            for D in (1, 33, 64):
                x = torch.randn(T, D, device=dev)
                for dtype, out_dtype in DTYPE_PAIRS:
                    xd = x.to(dtype)
                    want = gather_rows(xd, rm.token_of_row_P, out_dtype, rm.has_holes)
                    got = gather_rows_triton(xd, rm.token_of_row_P, out_dtype, rm.has_holes)
                    assert bits_equal(got, want), (T, K, E, D, dtype, out_dtype)


def test_combine_rows_bitwise():
    """Triton sum_rows_triton == model/dispatch.py's sum_rows bit for bit (fp32 accumulation, slots in
    order), fp32 / bf16 in and out, with and without holes."""
    need_triton()
    for dev in DEVICES:
        for T, K, E, rm in case_maps(dev):
            for D in (1, 33, 64):
                h = torch.randn(num_rows(rm), D, device=dev)
                for dtype, out_dtype in DTYPE_PAIRS:
                    hd = h.to(dtype)
                    want = sum_rows(hd, rm.row_of_pair_TK, out_dtype, rm.has_holes)
                    got = sum_rows_triton(hd, rm.row_of_pair_TK, out_dtype, rm.has_holes)
                    assert bits_equal(got, want), (T, K, E, D, dtype, out_dtype)


def test_hole_free_fast_path_is_the_same():
    """The reference's unmasked path (no -1, no padding) gives the same bits as the masked one."""
    idx = routing(40, 2, 8)
    rm = build_row_map(idx, 8, may_drop=False)
    assert not rm.has_holes
    general = build_row_map(idx, 8)  # the general path's maps are the same
    for f in ("row_of_pair_TK", "pair_of_row_P", "token_of_row_P", "routed_E", "padded_E"):
        assert torch.equal(getattr(rm, f), getattr(general, f)), f
    x = torch.randn(40, 16)
    h = torch.randn(num_rows(rm), 16)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        xd, hd = x.to(dtype), h.to(dtype)
        assert bits_equal(gather_rows(xd, rm.token_of_row_P, has_holes=False), gather_rows(xd, rm.token_of_row_P))
        assert bits_equal(sum_rows(hd, rm.row_of_pair_TK, has_holes=False), sum_rows(hd, rm.row_of_pair_TK))


MOVERS = {"reference": PLAIN_MOVERS, "triton": TRITON_MOVERS}  # (the tables the layer is built with)


def permute(x, rm, backend):
    return Permute.apply(x, rm.token_of_row_P, rm.row_of_pair_TK, rm.has_holes, MOVERS[backend])


def combine(h, rm, backend, out_dtype=None):
    return Combine.apply(h, rm.token_of_row_P, rm.row_of_pair_TK, rm.has_holes, MOVERS[backend], out_dtype)


def test_permute_combine_autograd():
    """Gradients of the differentiable Permute / Combine (model/dispatch.py; the fused path's permute /
    combine): on the plain movers they pass gradcheck in float64, and on the Triton movers their gradients
    equal the plain ones bitwise (fp32; and bf16 rows combined into fp32, as the layer does under autocast)."""
    for T, K, E, drop, idle, pad_to, align in CASES:
        if T == 0:
            continue
        rm = build_row_map(routing(T, K, E, drop=drop, idle=idle), E, pad_to, align)
        x = torch.randn(T, 5, dtype=torch.float64, requires_grad=True)
        h = torch.randn(num_rows(rm), 5, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda a: permute(a, rm, "reference"), (x,))
        assert torch.autograd.gradcheck(lambda a: combine(a, rm, "reference"), (h,))
        if not triton_importable() or not DEVICES:
            continue
        dev = DEVICES[0]
        rm = build_row_map(routing(T, K, E, drop=drop, idle=idle, device=dev), E, pad_to, align)
        g_x, g_y = torch.randn(num_rows(rm), 5, device=dev), torch.randn(T, 5, device=dev)
        for dtype, out_dtype in ((torch.float32, None), (torch.bfloat16, torch.float32)):
            xs, hs = (t.detach().to(dev, dtype).requires_grad_() for t in (x, h))
            grads = {}
            for be in ("reference", "triton"):
                gx, = torch.autograd.grad(permute(xs, rm, be), xs, g_x.to(dtype))
                gh, = torch.autograd.grad(combine(hs, rm, be, out_dtype), hs, g_y)
                grads[be] = (gx, gh)
            for a, b in zip(grads["reference"], grads["triton"]):
                assert bits_equal(a, b), (T, K, E, dtype)


def grouped_reference(a, b, offsets):
    """Per-segment fp64 matmuls: the exact product of the fp32 inputs (up to fp64 rounding)."""
    bounds = [0] + offsets.tolist()
    out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64)
    for e in range(b.shape[0]):
        out[bounds[e]:bounds[e + 1]] = a[bounds[e]:bounds[e + 1]].double() @ b[e].double()
    return out


def grouped_mm_loop(a_MK, b_EKN, offsets_E):
    """GROUPED_OPS' `mm` as per-segment matmuls (autograd's own backward), rows past the segments zero."""
    bounds = [0] + offsets_E.tolist()
    chunks = [a_MK[bounds[e]:bounds[e + 1]] @ b_EKN[e] for e in range(b_EKN.shape[0])]
    return torch.cat(chunks + [a_MK.new_zeros(a_MK.shape[0] - bounds[-1], b_EKN.shape[2])])


def segment_outer_loop(lhs_MX, rhs_MY, offsets_E):
    """GROUPED_OPS' `outer` as per-segment products."""
    bounds = [0] + offsets_E.tolist()
    return torch.stack([lhs_MX[bounds[e]:bounds[e + 1]].t() @ rhs_MY[bounds[e]:bounds[e + 1]]
                        for e in range(offsets_E.shape[0])])


# the reference the grouped ops are held to, in GroupedSwiGLU too
GROUPED_OPS_HERE = {**GROUPED_OPS, "reference": GroupedOps("reference", grouped_mm_loop, segment_outer_loop)}


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


def ops_here(device, dtype, K, N):
    """The GROUPED_OPS names that run rows of `dtype` and widths K, N on `device`: the reference, torch's
    grouped_mm where `torch_grouped_mm_fits` (as train/engines.py: grouped_experts_for decides), Triton
    where it runs (CUDA, or CPU in the interpreter)."""
    names = ["reference"] + (["torch"] if torch_grouped_mm_fits(device, dtype, K, N) else [])
    return names + (["triton"] if triton_runs_on(torch.empty(0, device=device)) else [])


def segment_outer_reference(lhs, rhs, offsets):
    """out[e] = lhs[rows of e]^T @ rhs[rows of e] in fp64."""
    bounds = [0] + offsets.tolist()
    return torch.stack([lhs[bounds[e]:bounds[e + 1]].double().t() @ rhs[bounds[e]:bounds[e + 1]].double()
                        for e in range(len(offsets))])


def test_grouped_ops_over_cases():
    """Every GROUPED_OPS entry that runs here (`ops_here`), called as GroupedSwiGLU calls it: `mm` with b a
    transposed view of a row-major weight [E, N, K] (the forward and the input gradient) and `outer` (the
    weight gradient, in the weight's layout), against fp64 per-segment products over GEMM_CASES (empty
    segments, M = 0 / 1, rows past the last segment, odd sizes), fp32 within 1e-5; rows in no segment zero
    (torch's: unspecified, never read); torch's in bf16 within 2e-2."""
    for dev in DEVICES or ["cpu"]:
        for lens, K, N, tail in GEMM_CASES:
            offsets = torch.tensor(lens, device=dev).cumsum(0).to(torch.int32)
            n, M = sum(lens), sum(lens) + tail
            a, w = torch.randn(M, K, device=dev), torch.randn(len(lens), N, K, device=dev)
            g = torch.randn(M, N, device=dev)
            for name in ops_here(dev, torch.float32, K, N):
                ops = GROUPED_OPS_HERE[name]
                c = ops.mm(a, w.transpose(1, 2), offsets)
                close(c[:n].cpu(), grouped_reference(a.cpu(), w.transpose(1, 2).cpu(), offsets.cpu())[:n],
                      f"{name} mm {lens} on {dev}")
                close(ops.outer(g, a, offsets).cpu(), segment_outer_reference(g.cpu(), a.cpu(), offsets.cpu()),
                      f"{name} outer {lens} on {dev}")
                if name != "torch":
                    assert not c[n:].any(), f"{name}: rows past the segments are not zero"
    a, w = torch.randn(20, 32), torch.randn(3, 16, 32)
    offsets = torch.tensor([7, 7, 20], dtype=torch.int32)
    if "torch" not in ops_here("cpu", torch.bfloat16, 32, 16):
        raise Skip("this torch has no CPU grouped_mm for bf16 (fp32 and the other ops passed)")
    got = GROUPED_OPS["torch"].mm(a.bfloat16(), w.bfloat16().transpose(1, 2), offsets).double()
    want = grouped_reference(a.bfloat16().float(), w.bfloat16().float().transpose(1, 2), offsets)
    assert (got - want).abs().max() <= 2e-2 * want.abs().max(), "bf16"


def test_grouped_engine_choice():
    """grouped_experts_for (the fused path's engine off the CPU GEMMs, chosen at build) takes torch's
    grouped_mm exactly where `torch_grouped_mm_fits`, else the plain expert_loop on CPU."""
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        for D, F_ in ((32, 24), (33, 17), (16, 12)):
            want = GROUPED_EXPERTS["torch"] if torch_grouped_mm_fits("cpu", dtype, D, F_) else expert_loop
            assert grouped_experts_for("cpu", dtype, D, F_) is want, (dtype, D, F_)
    assert not torch_grouped_mm_fits("cpu", torch.float64, 32, 32), "fp64 is the reference's"


def test_embedding_bag_combine_is_the_reference():
    """The CPU fast path inside the reference sum (model/dispatch.py: sum_rows; torch's embedding_bag over
    fp32 rows, no holes; fp32 / bf16 in and out) equals the general masked path and a plain fp32 loop bit
    for bit, and is taken exactly there (not with holes, an empty buffer or other dtypes)."""
    import model.dispatch as permute_module
    calls = []
    real = permute_module.F.embedding_bag

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    permute_module.F.embedding_bag = spy
    try:
        cases = CASES + [(30, 3, 6, 0.0, (), None, 1)]
        for T, K, E, drop, idle, pad_to, align in cases:
            for may_drop in (True, False):
                if not may_drop and (drop or pad_to is not None or align != 1):
                    continue
                rm = build_row_map(routing(T, K, E, drop=drop, idle=idle), E, pad_to, align, may_drop)
                for dtype, out_dtype in ((torch.float32, None), (torch.float64, None), (torch.float32, torch.float64),
                                         (torch.float32, torch.bfloat16), (torch.bfloat16, None)):
                    h = torch.randn(num_rows(rm), 37, dtype=dtype)
                    calls.clear()
                    got = sum_rows(h, rm.row_of_pair_TK, out_dtype, rm.has_holes)
                    fast = not rm.has_holes and num_rows(rm) > 0 and {dtype, out_dtype or dtype} <= {torch.float32,
                                                                                       torch.bfloat16}
                    assert bool(calls) == fast, (T, K, E, may_drop, dtype, out_dtype, calls)
                    general = sum_rows(h, rm.row_of_pair_TK, out_dtype, has_holes=True)
                    assert bits_equal(got, general), (T, K, E, may_drop, dtype, out_dtype)
                    acc = torch.zeros(T, 37, dtype=torch.promote_types(dtype, torch.float32))
                    for j in range(K):  # the documented order: slot 0 first, fp32 (fp64 stays fp64)
                        r = rm.row_of_pair_TK[:, j]
                        v = h.index_select(0, r.clamp(min=0)) if num_rows(rm) else h.new_zeros(T, 37)
                        v = torch.where((r >= 0)[:, None], v, 0.0)
                        acc = v.to(acc.dtype) if j == 0 else acc + v.to(acc.dtype)
                    assert bits_equal(got, acc.to(out_dtype or dtype)), (T, K, E, may_drop, dtype, out_dtype)
    finally:
        permute_module.F.embedding_bag = real


def test_scaled_swiglu_gradients():
    """SwiGLU with a per-row scale (the routing weight applied before the down projection): GroupedSwiGLU
    (the grouped engines' Function, on the reference ops) passes gradcheck in fp64 and scaled_swiglu_forward
    is silu(gate) * up times the scale; the forward/backward helpers (GroupedSwiGLU's and the CPU expert
    GEMMs') give the same values and gradients as autograd (with and without the scale's gradient)."""
    from kernels.grouped_gemm import scaled_swiglu_backward, scaled_swiglu_forward
    gu = torch.randn(9, 8, dtype=torch.float64, requires_grad=True)
    s = torch.rand(9, dtype=torch.float64, requires_grad=True)
    x, w_gu, w_down = (torch.randn(*shape, dtype=torch.float64, requires_grad=True)
                       for shape in ((9, 5), (3, 8, 5), (3, 5, 4)))
    offsets = torch.tensor([4, 4, 9], dtype=torch.int32)  # an expert without rows among them
    assert torch.autograd.gradcheck(lambda *a: GroupedSwiGLU.apply(*a[:3], offsets, a[3], GROUPED_OPS_HERE["reference"]),
                                    (x, w_gu, w_down, s))
    want = F.silu(gu[:, :4]) * gu[:, 4:] * s[:, None]
    assert torch.allclose(scaled_swiglu_forward(gu.detach().clone(), s.detach())[0], want)
    g = torch.randn(9, 4, dtype=torch.float64)
    ggu, gs = torch.autograd.grad(want, (gu, s), g)
    for dtype, scale_dtype in ((torch.float64, torch.float64), (torch.float32, torch.float32),
                               (torch.bfloat16, torch.float32)):
        gu_d, s_d = gu.detach().to(dtype), s.detach().to(scale_dtype)
        h, silu = scaled_swiglu_forward(gu_d.clone(), s_d)
        tol = 1e-12 if dtype == torch.float64 else (1e-5 if dtype == torch.float32 else 2e-2)
        assert h.dtype == dtype and (h.double() - want.detach()).abs().max() <= tol * max(1.0, want.abs().max()), dtype
        for need in (True, False):
            got_gu, got_s = scaled_swiglu_backward(g.to(dtype), gu_d, silu, s_d, need)
            assert got_gu.dtype == dtype and (got_gu.double() - ggu).abs().max() <= tol * max(1.0, ggu.abs().max())
            assert (got_s is None) == (not need)
            if need:
                assert got_s.dtype == scale_dtype and (got_s.double() - gs).abs().max() <= tol * max(1.0, gs.abs().max())


def expert_rows(T, K, E, drop, idle, pad_to, align, D, seed=0):
    """(rows_PD, tokens_per_expert_E, row_weight_P) as the row-map dispatcher hands them to the experts for
    this routing case: expert-sorted token rows with zero padding rows, rows per expert (padding included),
    routing weights (0 for padding rows)."""
    rm = build_row_map(routing(T, K, E, drop=drop, idle=idle, seed=seed), E, pad_to, align)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, D, generator=g)
    rows = gather_rows(x, rm.token_of_row_P)
    weight = torch.where(rm.pair_of_row_P >= 0, torch.rand(num_rows(rm), generator=g), 0.0)
    return rows, rm.padded_E, weight


def expert_gemms_reference(experts, rows_PD, tokens_per_expert_E, row_weight_P):
    """Per expert, on its segment: down(silu(gate(x)) * up(x) * w), in fp64 (autograd); rows outside every
    segment give zero rows."""
    out = torch.zeros(rows_PD.shape, dtype=torch.float64)
    start = 0
    for expert, n in zip(experts, tokens_per_expert_E.tolist()):
        w_gate, w_up, w_down = (w.double() for w in expert.weights())
        x = rows_PD[start:start + n].double()
        h = F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)
        out = out.index_add(0, torch.arange(start, start + n),
                            F.linear(h * row_weight_P[start:start + n, None].double(), w_down))
        start += n
    return out


@contextlib.contextmanager
def engine_calls():
    """Counts the runs of the two experts engines' Functions while inside: {"cpu": the CPU expert GEMMs
    (kernels.experts.CPUExperts: cpu_experts_for), "grouped": the grouped GEMMs (kernels.grouped_gemm.GroupedSwiGLU:
    GROUPED_EXPERTS)}."""
    calls = {"cpu": 0, "grouped": 0}

    def counting(key, function):
        real = function.forward

        def forward(*args, **kwargs):
            calls[key] += 1
            return real(*args, **kwargs)
        return mock.patch.object(function, "forward", staticmethod(forward))

    with counting("cpu", CPUExperts), counting("grouped", GroupedSwiGLU):
        yield calls


def cpu_expert_gemms(experts, rows_PD, tokens_per_expert_E, row_weight_P):
    """`experts` (a model/moe.py Experts built with a CPU experts engine) on these rows, checked to run the CPU
    expert GEMMs."""
    assert experts.engine in (cpu_experts_rows_in_place, cpu_experts_rows_bucketed), experts
    with engine_calls() as calls:
        out = experts(rows_PD, tokens_per_expert_E, row_weight_P)
    assert calls == {"cpu": 1, "grouped": 0}, f"{experts.engine.__name__} did not run the CPU expert GEMMs: {calls}"
    return out


def test_cpu_expert_gemms():
    """kernels.experts.cpu_experts_for (the fused layer's CPU experts engines: MKL's GEMMs in fp32, oneDNN's in bf16, on the
    expert-sorted rows of the dispatch and the stacked weights) against a per-expert autograd reference:
    output, grad of the rows, of the row weights and of both weight stacks; over the row-map cases (idle
    experts get zero weight grads, padding rows and rows past the segments give zero output), fp32 and bf16;
    two runs bitwise identical; fp32 rows on the bucketed layout too; the plain expert_loop (nn.Linear-style per expert) agrees too. (Rows it has no
    CPU GEMMs for: test_fp64_experts_take_the_plain_loop.)"""
    if not onednn_runs("cpu", torch.float32):
        raise Skip("this torch has no oneDNN CPU matmul")
    for T, K, E, drop, idle, pad_to, align in CASES + [(200, 2, 3, 0.1, (), None, 1)]:  # rows > a bucket
        torch.manual_seed(T + K + E)
        experts = Experts(E, 12, 20, cpu_experts_for(torch.float32))
        rows0, counts, weight0 = expert_rows(T, K, E, drop, idle, pad_to, align, 12, seed=T + E)
        rows, weight = rows0.clone().requires_grad_(), weight0.clone().requires_grad_()
        g = torch.randn(rows.shape)
        params = [rows, weight, *experts.parameters()]
        y = cpu_expert_gemms(experts, rows, counts, weight)
        got = torch.autograd.grad(y, params, g, allow_unused=True)
        ref = expert_gemms_reference(experts, rows, counts, weight)
        want = torch.autograd.grad(ref, params, g.double(), allow_unused=True)
        what = f"T={T} K={K} E={E} drop={drop} idle={idle} pad={pad_to} align={align}"
        assert y.shape == rows.shape and y.dtype == rows.dtype, what
        close(y, ref.detach(), what + " forward")
        end = int(counts.sum())
        assert not y[end:].any(), what + ": rows past the segments must be zero"
        for i, (a, b) in enumerate(zip(got, want)):
            assert a is not None, f"{what}: gradient {i} missing (idle experts need zero grads)"
            close(a, torch.zeros_like(a) if b is None else b, f"{what} grad {i}")
        again = torch.autograd.grad(cpu_expert_gemms(experts, rows, counts, weight), params, g, allow_unused=True)
        assert all(bits_equal(a, b) for a, b in zip(got, again)), what + " rerun"
        with engine_calls() as calls:  # the plain expert_loop on the same rows and weights (no copy)
            y_plain = expert_loop(rows, counts, weight, experts.gate_up_proj, experts.down_proj)
        assert calls == {"cpu": 0, "grouped": 0}, f"{what}: the plain expert_loop ran an engine: {calls}"
        close(y_plain[:end], ref.detach()[:end], what + " plain expert_loop")
        experts.engine = cpu_experts_rows_bucketed
        close(cpu_expert_gemms(experts, rows, counts, weight), ref.detach(), what + " bucketed layout")
    if onednn_runs("cpu", torch.bfloat16):
        experts = Experts(4, 16, 32, cpu_experts_for(torch.bfloat16)).bfloat16()
        rows, counts, weight = expert_rows(40, 2, 4, 0.0, (), None, 1, 16)
        got = cpu_expert_gemms(experts, rows.bfloat16(), counts, weight).double()
        want = expert_gemms_reference(experts, rows.bfloat16(), counts, weight)
        assert (got - want).abs().max() <= 2e-2 * want.abs().max(), "bf16"
        master = Experts(4, 16, 32, cpu_experts_for(torch.bfloat16))  # fp32 weights, bf16 rows (autocast)
        got = cpu_expert_gemms(master, rows.bfloat16(), counts, weight)
        assert got.dtype == torch.bfloat16
        want = expert_gemms_reference(master, rows.bfloat16(), counts, weight)
        assert (got.double() - want).abs().max() <= 2e-2 * want.abs().max(), "bf16 rows, fp32 weights"
        # 16 experts: batched GEMMs over groups of neighbouring experts, an idle expert among them; then a
        # skewed routing (groups cut where a count falls below 2/3 of the group's padded largest)
        master = Experts(16, 16, 32, cpu_experts_for(torch.bfloat16))
        skewed = torch.tensor([3, 40, 9, 8, 0, 7, 5, 30, 2, 2, 1, 0, 0, 1, 6, 6])
        for rows, counts, weight in (expert_rows(60, 4, 16, 0.0, (3,), None, 1, 16),
                                     (torch.randn(150, 16), skewed, torch.rand(150))):
            rows, weight = rows.bfloat16().requires_grad_(), weight.requires_grad_()
            params, g = [rows, weight, *master.parameters()], torch.randn(rows.shape)
            got = torch.autograd.grad(cpu_expert_gemms(master, rows, counts, weight), params, g.bfloat16())
            want = torch.autograd.grad(expert_gemms_reference(master, rows, counts, weight), params, g.double(),
                                       allow_unused=True)
            for i, (a, b) in enumerate(zip(got, want)):  # bf16 rounding of the rows' products: 2% of the largest
                b = torch.zeros(a.shape, dtype=torch.float64) if b is None else b
                assert (a.double() - b).abs().max() <= 2e-2 * b.abs().max() + 1e-6, f"bf16, 16 experts: grad {i}"


def test_fp64_experts_take_the_plain_loop():
    """For fp64 rows (no oneDNN GEMMs for them, and torch's grouped_mm takes no fp64 either) engines_for picks
    neither the CPU expert GEMMs nor a grouped engine but the plain expert_loop; it agrees with the reference."""
    assert not onednn_runs("cpu", torch.float64)
    from model.model_minimind import MiniMindConfig
    config = MiniMindConfig(hidden_size=12, num_attention_heads=1, num_key_value_heads=1, head_dim=8, use_moe=True,
                            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=20, moe_impl="fused")
    engine = engines_for(config, "cpu", torch.float64).experts
    assert engine is grouped_experts_for("cpu", torch.float64, 12, 20) is expert_loop, engine
    experts = Experts(4, 12, 20, engine).double()
    rows, counts, weight = expert_rows(13, 2, 4, 0.0, (), None, 1, 12)
    rows, weight = rows.double(), weight.double()
    with engine_calls() as calls, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (in case the reference loop warns about fp64)
        got = experts(rows, counts, weight)
    assert calls == {"cpu": 0, "grouped": 0}, f"fp64: {calls}"
    assert got.dtype == torch.float64
    close(got, expert_gemms_reference(experts, rows, counts, weight).detach(), "fp64 fallback")


def test_cpu_experts_autograd_modes():
    """The CPU expert GEMMs (cpu_experts_for): backward twice with retain_graph, frozen experts (no weight grads
    computed), no_grad (nothing kept), and double backward refused with an error that names it, never a first
    gradient silently detached from the graph."""
    if not onednn_runs("cpu", torch.float32):
        raise Skip("this torch has no oneDNN CPU matmul")
    from kernels.experts import _bucket
    assert [_bucket(n) for n in (0, 1, 16, 17, 100, 512, 513, 1000)] == [0, 1, 16, 24, 104, 512, 544, 1024]
    torch.manual_seed(0)
    experts = Experts(3, 8, 12, cpu_experts_for(torch.float32))
    rows0, counts, weight0 = expert_rows(50, 2, 3, 0.0, (), None, 1, 8)
    x, scale = rows0.requires_grad_(), weight0.requires_grad_()
    y = cpu_expert_gemms(experts, x, counts, scale)
    g1 = torch.autograd.grad(y.sum(), (x, scale), retain_graph=True)
    g2 = torch.autograd.grad(y.sum(), (x, scale))
    assert all(bits_equal(a, b) for a, b in zip(g1, g2)), "second backward with retain_graph"
    for p in experts.parameters():
        p.requires_grad_(False)
    gx, = torch.autograd.grad(cpu_expert_gemms(experts, x, counts, scale).sum(), x)
    assert bits_equal(gx, g1[0]) and all(p.grad is None for p in experts.parameters())
    with torch.no_grad():
        assert not cpu_expert_gemms(experts, x, counts, scale).requires_grad
    # double backward: a RuntimeError saying "double backward" at the create_graph=True backward, whether the
    # gradient reaching the GEMMs depends on their output (a nonlinear loss) or not (a sum); never a first
    # gradient detached from the graph, whose second-order term would be lost without a word
    for loss, of_y in (("square loss", lambda y: y.square().sum()), ("sum", lambda y: y.sum())):
        y = cpu_expert_gemms(experts, x, counts, scale)
        try:
            gx, = torch.autograd.grad(of_y(y), x, create_graph=True)
            assert gx.requires_grad, (f"{loss}: create_graph=True through the CPU expert GEMMs gave a gradient detached "
                                      "from the graph (its double backward silently drops their second derivative)")
            gx.sum().backward()
        except RuntimeError as e:
            assert "double backward" in str(e), f"{loss}: unclear refusal: {e}"
        else:
            raise AssertionError(f"{loss}: double backward through the CPU expert GEMMs did not raise")


def test_every_kernel_refuses_double_backward_clearly():
    """Each autograd.Function of kernels/ with a first-order backward (the oneDNN linear, the linear
    cross-entropy, the grouped SwiGLU) raises a RuntimeError saying "double backward" under
    create_graph=True, also where the gradient reaching it is constant (a sum), which torch's
    once_differentiable lets through as a first gradient detached from the graph."""
    torch.manual_seed(0)
    x, w = torch.randn(6, 8, requires_grad=True), torch.randn(5, 8, requires_grad=True)
    offsets = torch.tensor([2, 6], dtype=torch.int32)
    w_gu, w_d = torch.randn(2, 8, 8, requires_grad=True), torch.randn(2, 8, 4, requires_grad=True)
    calls = {"_OneDNNLinear": lambda: cpu_linear_function.apply(x, w),
             "_LinearCrossEntropy": lambda: lce.linear_cross_entropy(x, w, torch.tensor([0, 1, 2, 3, 4, 0])),
             "GroupedSwiGLU": lambda: GroupedSwiGLU.apply(x, w_gu, w_d, offsets, torch.ones(6), GROUPED_OPS["torch"])}
    if not onednn_runs("cpu", torch.float32):  # (no oneDNN in this torch: the Function cannot run)
        del calls["_OneDNNLinear"]
    for name, call in calls.items():
        for loss, of_y in (("square loss", lambda y: y.square().sum()), ("sum", lambda y: y.sum())):
            try:
                torch.autograd.grad(of_y(call()), x, create_graph=True)
            except RuntimeError as e:
                assert "double backward" in str(e), f"{name}, {loss}: unclear refusal: {e}"
            else:
                raise AssertionError(f"{name}, {loss}: create_graph=True through it did not raise")


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
    """GroupedSwiGLU on every GROUPED_OPS entry that runs here: with unit row scales the per-expert FFN,
    with routing weights down(silu(gate) * up * w); gradients of the rows, both weight stacks and the scales
    equal the reference ops'; a stride-0 gradient (`.sum().backward()`) runs."""
    torch.manual_seed(0)
    lens, D, F_ = [6, 0, 9], 16, 12
    experts = [FeedForward(D, F_) for _ in lens]
    offsets = torch.tensor(lens).cumsum(0).to(torch.int32)
    x = torch.randn(sum(lens), D)
    w_gu = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in experts]).detach()
    w_d = torch.stack([e.down_proj.weight for e in experts]).detach()
    starts = [0, 6, 6]
    want = torch.cat([experts[e](x[s:s + n]) for e, (s, n) in enumerate(zip(starts, lens))]).detach()
    scale = torch.rand(sum(lens))
    h = [F.silu(experts[e].gate_proj(x[s:s + n])) * experts[e].up_proj(x[s:s + n]) * scale[s:s + n, None]
         for e, (s, n) in enumerate(zip(starts, lens))]
    want_scaled = torch.cat([experts[e].down_proj(h[e]) for e in range(len(lens))]).detach()
    backends = ops_here("cpu", x.dtype, D, F_)
    g = torch.randn(sum(lens), D)
    grads = {}
    for be in backends:
        ops = GROUPED_OPS_HERE[be]
        close(GroupedSwiGLU.apply(x, w_gu, w_d, offsets, torch.ones(sum(lens)), ops), want, be)
        args = [t.clone().requires_grad_() for t in (x, w_gu, w_d, scale)]
        y = GroupedSwiGLU.apply(args[0], args[1], args[2], offsets, args[3], ops)
        close(y, want_scaled, be + " scaled")
        grads[be] = torch.autograd.grad(y, args, g)
        GroupedSwiGLU.apply(*args[:3], offsets, args[3], ops).sum().backward()  # a stride-0 gradient
    for be in backends[1:]:
        for i, (a, b) in enumerate(zip(grads[be], grads["reference"])):
            close(a, b, f"{be} grad {i}")


def test_triton_movers_say_where_they_cannot_run():
    """gather_rows_triton and sum_rows_triton refuse, with a RuntimeError saying "Triton cannot run", a tensor on a
    device Triton does not run on, before launching anything: a meta tensor (never), and a CPU tensor while
    TRITON_INTERPRET is not 1 (kernels/backend.py reads it at each call, so a run without the interpreter is
    simulated here by setting it to 0). Runs everywhere, Triton installed or not."""
    for where, device, env in (("a meta tensor", "meta", {}),
                               ("a CPU tensor without the interpreter", "cpu", {"TRITON_INTERPRET": "0"})):
        with mock.patch.dict(os.environ, env):
            x = torch.randn(3, 4, device=device)
            assert not triton_runs_on(x), where
            index = torch.zeros(2, 1, dtype=torch.int64, device=device)
            calls = (("gather_rows_triton", lambda: gather_rows_triton(x, index[:, 0])),
                     ("sum_rows_triton", lambda: sum_rows_triton(x, index)))
            for name, call in calls:
                try:
                    call()
                except RuntimeError as e:
                    assert "Triton cannot run" in str(e), f"{name} on {where}: {e}"
                else:
                    raise AssertionError(f"{name} ran on {where}, where Triton cannot")


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
    non-contiguous inputs, through `linear` and through the OneDNNLinear module (the engine for nn.Linear),
    which give the same bits; operands oneDNN does not take (fp64) are F.linear bitwise."""
    if not onednn_linear_fits(torch.zeros(1), torch.zeros(1)):
        raise Skip("this torch has no oneDNN for CPU fp32")
    gen = torch.Generator().manual_seed(0)
    for shape, N in [((1024, 256), 6400), ((8, 128, 256), 768), ((3, 5, 7), 9), ((1, 384), 256)]:
        x = torch.randn(*shape, generator=gen)
        if len(shape) == 3:
            x = x.transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous view
        w = torch.randn(N, shape[-1], generator=gen)
        g = torch.randn(*shape[:-1], N, generator=gen)
        assert onednn_linear_fits(x, w)
        x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = linear(x1, w1)
        y.backward(g)
        xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
        yd = F.linear(xd, wd)
        yd.backward(g.double())
        for got, want, what in [(y, yd, "y"), (x1.grad, xd.grad, "grad x"), (w1.grad, wd.grad, "grad W")]:
            rel = ((got.double() - want).abs().max() / want.abs().max()).item()
            assert got.dtype == torch.float32 and rel < 1e-5, f"{shape} {what}: relative error {rel:.2e}"
        module = OneDNNLinear(shape[-1], N, bias=False)
        with torch.no_grad():
            module.weight.copy_(w)
        x2 = x.clone().requires_grad_()
        y2 = module(x2)
        y2.backward(g)
        assert bits_equal(y2.detach(), y.detach()) and bits_equal(x2.grad, x1.grad) and bits_equal(module.weight.grad, w1.grad)
        if shape[0] <= 8:  # (fp64 is small enough only here)
            assert torch.equal(linear(xd.detach(), wd.detach()), F.linear(xd.detach(), wd.detach()))


def test_onednn_linear_choices():
    """`linear` leaves autocast, non-fp32 operands and, outside autograd, at most FEW_ROWS rows to F.linear
    (bitwise); OneDNNLinear keeps nn.Linear's
    parameters and state_dict keys and is within fp32 rounding of nn.Linear (1e-5 relative); engines_for
    picks it on CPU under fp32 only, and a model built with those engines has it exactly at the bias-free
    projections outside the MoE router and routed experts (attention, dense FFN, shared experts, LM head)
    and computes the plain model's logits within 1e-5 relative."""
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not onednn_linear_fits(x, w)
        assert torch.equal(linear(x, w), F.linear(x, w)) and linear(x, w).dtype == torch.bfloat16
    xd, wd = x.double(), w.double()
    assert not onednn_linear_fits(xd, wd) and torch.equal(linear(xd, wd), F.linear(xd, wd))
    if onednn_runs("cpu", torch.float32):  # a decode step's few rows: MKL (bitwise F.linear); autograd or many: oneDNN
        from kernels.cpu_linear import FEW_ROWS
        many = torch.randn(FEW_ROWS + 1, 16)
        assert onednn_linear_fits(x, w) and onednn_linear_fits(many, w)
        with torch.no_grad():
            assert not onednn_linear_fits(x, w) and torch.equal(linear(x, w), F.linear(x, w))
            assert onednn_linear_fits(many, w) and not onednn_linear_fits(many[:FEW_ROWS].view(4, -1, 16), w)
    layer = OneDNNLinear(16, 8, bias=False)
    assert isinstance(layer, torch.nn.Linear) and layer.bias is None and list(layer.state_dict()) == ["weight"]
    plain = torch.nn.Linear(16, 8, bias=False)
    plain.load_state_dict(layer.state_dict())
    rel = ((layer(x) - plain(x)).abs().max() / plain(x).abs().max()).item()
    assert rel < 1e-5, f"OneDNNLinear vs nn.Linear: relative error {rel:.2e}"
    from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
    base = dict(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=32,
                num_hidden_layers=2, intermediate_size=24)
    ids = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(0))
    for kw in ({}, {"use_moe": True, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                    "n_shared_experts": 1}):
        config = MiniMindConfig(**base, **kw)
        torch.manual_seed(0)
        plain = MiniMindForCausalLM(config).eval()
        assert describe(plain) == "engines: plain PyTorch", describe(plain)
        for device, dtype in (("cpu", torch.bfloat16), ("cuda", torch.float32), ("cuda", torch.bfloat16)):
            assert engines_for(config, device, dtype).linear is torch.nn.Linear, (kw, device, dtype)
        model = rebuilt(plain, engines_for(config, "cpu", torch.bfloat16))
        assert not any(type(m) is OneDNNLinear for m in model.modules()), "bf16: no OneDNNLinear"
        if not onednn_runs("cpu", torch.float32):
            continue
        engines = engines_for(config, "cpu", torch.float32)
        assert engines.linear is OneDNNLinear, kw
        model = rebuilt(plain, engines)
        linears = {n: type(m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        routed = {n for n in linears if n.endswith("mlp.gate") or ".mlp.experts." in n}
        assert routed or not kw, kw
        assert all(linears[n] is torch.nn.Linear for n in routed), f"router / routed experts: {linears}"
        assert all(t is OneDNNLinear for n, t in linears.items() if n not in routed), f"projections: {linears}"
        assert all(m.bias is None for n, m in model.named_modules() if type(m) is OneDNNLinear), "only bias-free"
        assert f"OneDNNLinear x{len(linears) - len(routed)}" in describe(model), describe(model)
        y = plain(ids).logits
        assert (model(ids).logits - y).abs().max() <= 1e-5 * y.abs().max(), kw


def test_linear_cross_entropy_matches_reference():
    """kernels/linear_cross_entropy.py against F.cross_entropy(F.linear(h, W)) in fp64: the loss and the
    gradients of h and W within 1e-5 relative to the largest value in fp32 (measured ~1e-6), for a row
    count that is not a multiple of the chunk, ignored labels and an incoming gradient other than 1;
    under bf16 autocast within 2e-2 of the fp64 reference and the same dtypes as autocast's path (fp32
    loss, fp32 leaf gradients); under no_grad (no gradient made) the loss within 1e-5 of the fp64 reference and
    bitwise the fp32 loss computed with gradients; every label ignored gives nan like F.cross_entropy, with a
    zero gradient; bad shapes raise."""
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
            if not bf16:
                fp32_loss = got.detach()
            (got * 0.37).backward()
            assert got.dtype == torch.float32 and h1.grad.dtype == w1.grad.dtype == torch.float32
            for g, r, what in ((got, want, "loss"), (h1.grad, hd.grad, "grad h"), (w1.grad, wd.grad, "grad W")):
                rel = ((g.double() - r).abs().max() / r.abs().max()).item()
                assert rel < tol, f"bf16={bf16} {what}: relative error {rel:.2e}"
        h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
        none = lce.linear_cross_entropy(h1, w1, torch.full((N,), -100))
        none.nan_to_num().backward()  # the trainer's zero share of an unsupervised micro-batch
        assert none.isnan() and not h1.grad.any() and not w1.grad.any()
        with torch.no_grad():  # no gradient wanted (no gradient written): the fp64 loss within 1e-5, and the same bits
            no_grad_loss = lce.linear_cross_entropy(h, w, labels)  # as with gradients (the same log-softmax sums)
        rel = ((no_grad_loss.double() - want).abs() / want.abs()).item()
        assert rel < 1e-5, f"no_grad: relative error {rel:.2e} from F.cross_entropy in fp64"
        assert torch.equal(no_grad_loss, fp32_loss), f"no_grad loss {no_grad_loss.item()!r} != {fp32_loss.item()!r}"
    finally:
        lce.CHUNK_ELEMENTS = saved
    for bad in ((h, w[:, :5], labels), (h, w, labels[:5]), (h[None], w, labels)):
        try:
            lce.linear_cross_entropy(*bad)
            raise AssertionError("bad shapes did not raise")
        except ValueError as e:
            assert "linear_cross_entropy" in str(e)


def test_explicit_attention_matches_reference():
    """kernels/attention.py's explicit_attention (query heads of a group stacked, k and v read once) against
    softmax(q k^T / sqrt(Dh) + mask) v written here with k and v repeated per query head: fp64 forward and
    q / k / v gradients within 1e-12 (the same products, summed in another order across a group), bf16
    within 2e-2 of the fp64 values; causal, a bool mask [B, 1, S, L] after a cache (S < L), one [S, L], one
    with a head axis [B, H, S, L], grouped (H = 2G) and plain (H = G)."""
    from kernels.attention import explicit_attention

    def reference(q, k, v, mask):
        H, G = q.shape[1], k.shape[1]
        k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v

    gen = torch.Generator().manual_seed(0)
    B, S, L, Dh = 2, 5, 7, 16
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    after_cache = torch.ones(S, L, dtype=torch.bool).tril(diagonal=L - S)
    padded = after_cache.expand(B, 1, S, L).clone()
    padded[0, :, :, :2] = False  # row 0: two left-padded keys
    cases = [(4, 2, S, dict(is_causal=True), causal), (4, 4, S, dict(is_causal=True), causal),
             (4, 2, L, dict(attn_mask=padded), padded), (4, 2, L, dict(attn_mask=after_cache), after_cache),
             (4, 2, L, dict(attn_mask=padded.expand(B, 4, S, L)), padded)]
    for H, G, keys, kwargs, mask in cases:
        q64, k64, v64 = (torch.randn(B, heads, n, Dh, generator=gen, dtype=torch.float64)
                         for heads, n in ((H, S), (G, keys), (G, keys)))
        g64 = torch.randn(B, H, S, Dh, generator=gen, dtype=torch.float64)
        want = [t.clone().requires_grad_() for t in (q64, k64, v64)]
        out = reference(*want, mask)
        out.backward(g64)
        for dtype, tol in ((torch.float64, 1e-12), (torch.bfloat16, 2e-2)):
            got = [t.detach().to(dtype).requires_grad_() for t in (q64, k64, v64)]
            y = explicit_attention(*got, **kwargs)
            y.backward(g64.to(dtype))
            for name, a, b in [("out", y, out), *zip(("grad q", "grad k", "grad v"), (t.grad for t in got),
                                                       (t.grad for t in want))]:
                err = (a.double() - b).abs().max().item() / b.abs().max().item()
                assert err < tol, f"H={H} G={G} {sorted(kwargs)} {dtype}: {name} off by {err:.2e} (> {tol})"


TESTS = [test_explicit_attention_matches_reference, test_linear_cross_entropy_matches_reference, test_onednn_linear_matches_fp64, test_onednn_linear_choices,
         test_row_map_layout, test_gather_rows_bitwise, test_combine_rows_bitwise, test_hole_free_fast_path_is_the_same,
         test_permute_combine_autograd, test_grouped_ops_over_cases, test_grouped_engine_choice,
         test_embedding_bag_combine_is_the_reference, test_scaled_swiglu_gradients,
         test_cpu_expert_gemms, test_fp64_experts_take_the_plain_loop, test_cpu_experts_autograd_modes,
         test_every_kernel_refuses_double_backward_clearly, test_cpu_values_refuses_device_tensors,
         test_grouped_swiglu_matches_per_expert_ffn, test_triton_movers_say_where_they_cannot_run,
         test_kernels_compile_for_hopper]

if __name__ == "__main__":
    run(TESTS)
