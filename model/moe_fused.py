"""The zero-sync fused MoE expert path (`MiniMindConfig.moe_impl = "fused"`).

Shape legend as in model/moe.py; P = rows of the expert-sorted buffer (N = T*K, plus padding if any).

    build_row_map (device-only sort + counts) -> permute -> grouped SwiGLU GEMM -> unpermute + combine

Token counts never leave the device: no `.tolist()`/`.item()`/`nonzero`, so the layer makes zero
sync-inducing calls and has only static shapes (it can run under CUDA graphs / torch.compile without graph
breaks from data-dependent sizes). All experts run in one grouped GEMM instead of a Python loop.

Against the sorted path (the bitwise reference): the same routing and the same combine order (a token's
slots in ascending expert id, accumulated from zero), but the expert GEMMs are grouped kernels whose
blocking differs from per-expert `nn.Linear` calls, and the combine accumulates in fp32; so results agree
to rounding, not bitwise (tolerances in scripts/test_moe_fused.py). Two runs are bitwise identical.

Parameters stay the per-expert `experts.{e}.{gate,up,down}_proj.weight` of the sorted layer (same
`state_dict`). `pack_expert_weights` re-homes them as views of two contiguous buffers, so the grouped GEMM
reads all experts' weights without a per-forward copy; if something replaced them since (e.g.
`load_state_dict(assign=True)`, `from_pretrained`, `copy.deepcopy`), the next forward packs them again.
"""
import torch

from kernels.backend import interpreting, warn_once
from kernels.cpu_experts import cpu_experts, cpu_experts_supported
from kernels.grouped_gemm import grouped_swiglu
from kernels.permute import build_row_map, permute, row_weights, unpermute_combine


class _PackedStack(torch.autograd.Function):
    """[n, *shape] view over n same-shaped tensors that sit back to back in one storage (no copy).
    The gradient of the view is handed back to each tensor as its slice."""

    @staticmethod
    def forward(ctx, *weights):
        w0 = weights[0]
        return w0.detach().as_strided((len(weights), *w0.shape), (w0.numel(), *w0.stride()), w0.storage_offset())

    @staticmethod
    def backward(ctx, grad):
        return tuple(grad.unbind(0))


def _back_to_back(weights):
    w0 = weights[0]
    if not w0.is_contiguous():
        return False
    step = w0.numel() * w0.element_size()
    base = w0.data_ptr()
    return all(w.shape == w0.shape and w.dtype == w0.dtype and w.device == w0.device and w.is_contiguous()
               and w.data_ptr() == base + i * step for i, w in enumerate(weights))


def _stack(weights):
    if torch.compiler.is_compiling():  # data_ptr() is not traceable: let the compiler see a plain stack
        return torch.stack(weights)
    if _back_to_back(weights):
        return _PackedStack.apply(*weights)
    warn_once("moe-fused-unpacked", "fused MoE: expert weights are not packed (mixed dtypes/devices, or replaced "
              "inside inference_mode); stacking copies every forward. Call MOEFeedForward.pack_expert_weights().")
    return torch.stack(weights)


def _weight_lists(experts):
    return ([w for ex in experts for w in (ex.gate_proj.weight, ex.up_proj.weight)],
            [ex.down_proj.weight for ex in experts])


def expert_weight_stacks(experts):
    """(w_gate_up_E2FD [E, 2F, D], w_down_EDF [E, D, F]) for `experts` (SwiGLU FeedForward modules).

    Weights replaced since they were packed (from_pretrained, load_state_dict(assign=True), deepcopy,
    pickling) are packed again here, once; inside inference_mode (new storage would become inference
    tensors) they are stacked as copies instead.
    """
    E = len(experts)
    F_, D = experts[0].gate_proj.weight.shape
    repack_if_replaced(experts)
    gate_up, down = _weight_lists(experts)
    return _stack(gate_up).view(E, 2 * F_, D), _stack(down)


def repack_if_replaced(experts):
    """Pack the expert weights again if something replaced them since (see expert_weight_stacks)."""
    if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
        return
    gate_up, down = _weight_lists(experts)
    if not (_back_to_back(gate_up) and _back_to_back(down)):
        pack_expert_weights(experts)


@torch.no_grad()
def pack_expert_weights(experts):
    """Make every expert weight a view into two contiguous buffers, [E, 2, F, D] (gate, up) and
    [E, D, F] (down), keeping each Parameter object (optimizer / DDP references stay valid) and value."""
    if len(experts) == 0:
        return
    g0 = experts[0].gate_proj.weight
    E, (F_, D) = len(experts), g0.shape
    gate_up = torch.empty(E, 2, F_, D, dtype=g0.dtype, device=g0.device)
    down = torch.empty(E, D, F_, dtype=g0.dtype, device=g0.device)
    for e, ex in enumerate(experts):
        gate_up[e, 0].copy_(ex.gate_proj.weight)
        gate_up[e, 1].copy_(ex.up_proj.weight)
        down[e].copy_(ex.down_proj.weight)
    for e, ex in enumerate(experts):
        ex.gate_proj.weight.data = gate_up[e, 0]
        ex.up_proj.weight.data = gate_up[e, 1]
        ex.down_proj.weight.data = down[e]


def fused_experts_forward(experts, x_TD, topk_idx_TK, topk_weight_TK, training=True, stats=None, counts=None,
                          padding=None, may_drop=True, permute_backend="auto", gemm_backend="auto", impl="auto"):
    """Zero-sync dispatch -> grouped expert GEMM -> deterministic combine.

    Args (as `model.moe.sorted_experts_forward`, whose drop-in replacement this is):
        experts: E SwiGLU `FeedForward` modules. x_TD: [T, D]. topk_idx_TK: int64 [T, K] in [-1, E)
            (-1 = no expert; rows need not be sorted, the combine follows the slot order given).
        topk_weight_TK: [T, K] combine weights. training: unused (every expert is always in the graph,
            an idle one gets a zero gradient). counts: unused (kept for the EP transport's call).
        stats: if given, gets `last_tokens_per_expert` (int64 [E], on the device) and, with padding,
            `last_padded_counts` (int64 [E], on the device).
        padding: None or (pad_to, alignment): rows per expert padded with zero rows (see build_row_map).
        may_drop: False promises topk_idx has no -1 (saves masking work in the PyTorch kernels).
        permute_backend: "auto" | "triton" | "reference" for permute and combine (kernels.permute).
        gemm_backend: "auto" | "onednn" | "torch" | "triton" | "reference" for the grouped GEMM
            (kernels.grouped_gemm).
        impl: "grouped" (permute -> grouped SwiGLU GEMM -> combine, built for GPUs), "cpu_experts"
            (kernels.cpu_experts: one cache-sized chain per expert, for CPUs), or "auto": cpu_experts for
            CPU tensors it supports, unless compiling (the grouped path traces without graph breaks) or
            Triton runs in its CPU interpreter (TRITON_INTERPRET=1: the kernels under test), else grouped.
    Returns: y_TD [T, D] in x's dtype (expert GEMMs in the autocast dtype when autocast is on, as
        nn.Linear would run them; the combine accumulates in fp32).
    Raises ValueError / RuntimeError for an unknown or unusable backend.
    """
    T, D = x_TD.shape
    pad_to, alignment = padding if padding is not None else (None, 1)
    row_map = build_row_map(topk_idx_TK, len(experts), pad_to, alignment, may_drop)
    if stats is not None:
        stats.last_tokens_per_expert = row_map.tokens_per_expert_E
        if padding is not None:
            stats.last_padded_counts = row_map.padded_tokens_per_expert_E
    dev = x_TD.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x_TD.dtype
    if impl not in ("auto", "grouped", "cpu_experts"):
        raise ValueError(f"fused MoE impl must be 'auto', 'grouped' or 'cpu_experts', got {impl!r}")
    if impl == "auto":
        use_cpu = (cpu_experts_supported(x_TD.device, dtype) and not torch.compiler.is_compiling()
                   and not interpreting() and permute_backend == "auto" and gemm_backend in ("auto", "onednn"))
        impl = "cpu_experts" if use_cpu else "grouped"
    if impl == "grouped":
        w_gate_up, w_down = expert_weight_stacks(experts)
    else:
        repack_if_replaced(experts)
    # Each row's routing weight scales its SwiGLU output, before the down projection (linear, so the
    # same sum up to rounding): the combine is then an unweighted sum, and the weights' gradient a dot
    # product over F instead of D.
    scale_P = row_weights(topk_weight_TK, row_map)  # padding rows and dropped pairs: 0
    with torch.autocast(dev, enabled=False):  # the kernels take explicit dtypes
        if impl == "cpu_experts":  # (casts the weights to the autocast dtype itself)
            return cpu_experts(experts, x_TD.to(dtype), scale_P, row_map, out_dtype=x_TD.dtype)
        x_PD = permute(x_TD.to(dtype), row_map, permute_backend)
        y_PD = grouped_swiglu(x_PD, w_gate_up.to(dtype), w_down.to(dtype), row_map.offsets_E, gemm_backend,
                              row_scale_P=scale_P)
        return unpermute_combine(y_PD, None, row_map, permute_backend, out_dtype=x_TD.dtype)
