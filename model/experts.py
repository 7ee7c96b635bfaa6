"""The experts of the MoE layer: E SwiGLU FFNs and the ways to run them on dispatched rows.

Shape legend as in model/dispatch.py; F expert intermediate size.

Parameters are always E `FeedForward` modules in an nn.ModuleList (`experts.{e}.{gate,up,down}_proj.weight`,
the HF / Qwen3-MoE names), whatever runs them (`SwiGLUExperts.impl`):

  "loop"        one `FeedForward` call per expert on its rows (the SortedDispatcher's per-expert list):
                nn.Linear's GEMMs, bitwise the masked reference loop.
  "grouped"     all experts in two grouped GEMMs over device offsets (kernels.grouped_gemm.grouped_swiglu:
                torch's grouped_mm, our Triton kernel or per-segment oneDNN on CPU), each row's routing
                weight applied before the down projection; no host read. Needs the RowMapDispatcher's rows.
  "cpu_chains"  CPU only (kernels.cpu_experts): one chain per expert, gather -> oneDNN GEMM -> SwiGLU x
                routing weight -> oneDNN GEMM -> add into the token rows, on rows that stay in cache. It
                fuses the permute and the combine into the experts, so it takes token-order rows: the layer
                then dispatches with `permute=False` and the combine only casts. Its GEMMs run on
                bucketed row counts, which bounds oneDNN's kernel cache. fwd+bwd vs "grouped" on oneDNN
                (`scripts/bench_moe.py`, the fused-grouped row; 2-core CPU): up to 10% faster where
                experts get hundreds of rows, 11% slower at ~32 rows per expert (kernels/README.md).
  "auto"        per call: "cpu_chains" where it runs (CPU, oneDNN, fp32 or native bf16; not while
                torch.compile traces, nor in Triton's CPU interpreter), else "grouped".

The grouped and chain implementations read all experts' weights as two stacks; `pack_weights` lays the
weights out back to back (views of two buffers) so that costs no copy, and a forward packs them again if
something replaced them since (load_state_dict(assign=True), from_pretrained, deepcopy).
"""
import torch
import torch.nn.functional as F
from torch import nn

from kernels.backend import interpreting, warn_once
from kernels.cpu_experts import cpu_experts, cpu_experts_supported
from kernels.cpu_linear import Linear
from kernels.grouped_gemm import grouped_swiglu
from model.dispatch import compute_dtype

IMPLS = ("loop", "grouped", "cpu_chains", "auto")


class FeedForward(nn.Module):
    """SwiGLU FFN: down(silu(gate(x)) * up(x)). x: [..., D] -> [..., D]. Names match HF (`gate_proj`...).

    linear_backend (kernels/cpu_linear.py): "torch" (default) = nn.Linear's F.linear, what the experts use
    (the sorted layer's bitwise contract is with the masked loop over these modules); the dense FFN of a
    dense model passes its config's `linear_backend`."""

    def __init__(self, hidden_size: int, intermediate_size: int, linear_backend: str = "torch"):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, linear_backend)
        self.up_proj = Linear(hidden_size, intermediate_size, linear_backend)
        self.down_proj = Linear(intermediate_size, hidden_size, linear_backend)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SwiGLUExperts(nn.ModuleList):
    """E SwiGLU experts (an nn.ModuleList of `FeedForward`) and how they run (module docstring).

    SwiGLUExperts(experts=None, impl="loop", gemm_backend="auto"); `impl` and `gemm_backend` are also
    plain attributes, checked when set. gemm_backend ("auto" | "onednn" | "torch" | "triton" |
    "reference", kernels.grouped_gemm) is the grouped GEMM's; "auto" resolves to the chains only with
    gemm_backend "auto" or "onednn".

    forward(rows, tokens_per_expert, handle) -> rows_out, for a dispatcher's (rows, tokens_per_expert,
    handle) (model/dispatch.py), running experts handle.first_expert + [0, len(tokens_per_expert)):
        "loop": rows a list of [n_e, D] tensors -> list of [n_e, D] outputs; in eval an expert without
            rows is skipped (None), in training it runs on its empty slice so it gets a (zero) gradient.
        "grouped": rows [P, D] expert-sorted -> [P, D], each row scaled by handle.row_weight_P.
        "cpu_chains": rows [T, D] in token order -> y_TD [T, D] in handle.out_dtype (already combined).
    Raises ValueError for an unknown impl / backend, or rows from a dispatcher the impl cannot take.
    """

    def __init__(self, experts=None, impl="loop", gemm_backend="auto"):
        super().__init__(experts)
        self.impl = impl
        self.gemm_backend = gemm_backend
        if impl != "loop":
            self.pack_weights()

    def __setattr__(self, name, value):
        if name == "impl" and value not in IMPLS:
            raise ValueError(f"SwiGLUExperts.impl must be one of {IMPLS}, got {value!r}")
        if name == "gemm_backend" and value not in ("auto", "onednn", "torch", "triton", "reference"):
            raise ValueError("SwiGLUExperts.gemm_backend must be auto, onednn, torch, triton or reference, "
                             f"got {value!r}")
        super().__setattr__(name, value)

    def resolve_impl(self, x):
        """The implementation a call on rows like x ([*, D], before any autocast cast) runs."""
        if self.impl != "auto":
            return self.impl
        if (cpu_experts_supported(x.device, compute_dtype(x)) and not torch.compiler.is_compiling() and not interpreting()
                and self.gemm_backend in ("auto", "onednn")):
            return "cpu_chains"
        return "grouped"

    def gathers_own_rows(self, x):
        """Whether a call on x runs the CPU chains, which take token-order rows (dispatch(permute=False))."""
        return self.resolve_impl(x) == "cpu_chains"

    def forward(self, rows, tokens_per_expert, handle):
        if self.impl == "loop":
            if not isinstance(rows, list):
                raise ValueError("SwiGLUExperts impl='loop' takes the SortedDispatcher's per-expert rows")
            return self._loop(rows, tokens_per_expert, handle.first_expert)
        # "auto" was resolved when the layer dispatched: token-order rows are for the chains
        chains = not handle.permuted
        if handle.row_map is None or self.impl == ("grouped" if chains else "cpu_chains"):
            raise ValueError(f"SwiGLUExperts impl={self.impl!r} takes the RowMapDispatcher's rows, dispatched "
                             f"with permute={self.impl != 'cpu_chains'} (see gathers_own_rows)")
        experts = self._slice(handle.first_expert, handle.row_map.offsets_E.shape[0])
        if chains:
            repack_if_replaced(experts)
            with torch.autocast(rows.device.type, enabled=False):  # casts the weights to rows' dtype itself
                return cpu_experts(experts, rows, handle.row_weight_P, handle.row_map, out_dtype=handle.out_dtype)
        w_gate_up_E2FD, w_down_EDF = expert_weight_stacks(experts)
        dtype = rows.dtype
        with torch.autocast(rows.device.type, enabled=False):  # the kernels take explicit dtypes
            return grouped_swiglu(rows, w_gate_up_E2FD.to(dtype), w_down_EDF.to(dtype), handle.row_map.offsets_E,
                                  self.gemm_backend, row_scale_P=handle.row_weight_P)

    def _loop(self, rows, tokens_per_expert, first_expert):
        experts = self._slice(first_expert, len(rows))
        return [None if n == 0 and not self.training else expert(x_e)
                for expert, x_e, n in zip(experts, rows, tokens_per_expert)]

    def _slice(self, first, count):
        # (a plain list: slicing an nn.ModuleList builds a new module of this class)
        return self if first == 0 and count == len(self) else list(self)[first:first + count]

    def pack_weights(self):
        """Lay the expert weights out back to back (see pack_expert_weights)."""
        pack_expert_weights(self)

    def _apply(self, fn, *args, **kwargs):
        # .to() / .cuda() / .half() give every parameter its own new storage: pack them again.
        out = super()._apply(fn, *args, **kwargs)
        if self.impl != "loop":
            self.pack_weights()
        return out


# ------------------------------------------------------------------ packed weight stacks

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
