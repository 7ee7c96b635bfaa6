"""Mean cross-entropy of an LM head, h @ W^T -> softmax -> -log p[label], with the logits' gradient
made in the forward pass, chunk by chunk, in the logits' own buffer: the engine for the model's
lm_loss on CPU.

    logits_NV = h_ND @ W_VD^T                                   (one GEMM, compute dtype)
    per chunk of rows:  logp = log_softmax(logits[chunk]) (fp32, in cache); loss += -logp[label]
                        logits[chunk] = (softmax - onehot(label)) / n   (= dL/dlogits, in place)
    backward:  grad_h = G @ W * g,  grad_W = G^T @ h * g        (two GEMMs; g = the incoming grad)

On CPU the softmax is memory-bound and `F.cross_entropy(logits.float())` makes five passes over
[N, V]; here each chunk is rewritten while in cache. Liger-Kernel's fused linear cross-entropy (Hsu
et al. 2024) chunks to save GPU memory; this keeps the GEMMs whole and chunks the softmax. The
gradient is rounded once to the compute dtype, as autocast's backward would
(scripts/test_kernels.py: fp32 within 1e-5 of fp64, bf16 within 2e-2).
"""
import torch

from kernels.backend import first_order_only
from kernels.cpu_linear import linear

CHUNK_ELEMENTS = 1 << 18  # fp32 elements of one softmax chunk: 1 MiB, an L2 cache's worth


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, w_VD, labels_N, ignore_index):
        logits_NV = linear(h_ND, w_VD)  # oneDNN for CPU fp32 (kernels/cpu_linear.py)
        N, V = logits_NV.shape
        valid_N = labels_N != ignore_index
        label_N1 = torch.where(valid_N, labels_N, 0).unsqueeze(1)
        n_valid = valid_N.sum()
        # d(mean loss)/d(logit) of a row: (softmax - onehot) / n in fp32, zero for an ignored row
        # every label ignored: zero gradient
        row_scale_N1 = (valid_N / n_valid.clamp(min=1)).unsqueeze(1)
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        loss_sum = torch.zeros((), dtype=torch.float32, device=h_ND.device)
        rows = max(1, CHUNK_ELEMENTS // V)
        for a in range(0, N, rows):
            b = min(N, a + rows)
            logp = torch.log_softmax(logits_NV[a:b], dim=-1, dtype=torch.float32)
            loss_sum -= (logp.gather(1, label_N1[a:b]).squeeze(1) * valid_N[a:b]).sum()
            if need_grad:
                prob = logp.exp_()
                prob.scatter_add_(1, label_N1[a:b], prob.new_full((b - a, 1), -1.0))
                logits_NV[a:b].copy_(prob.mul_(row_scale_N1[a:b]))
        ctx.save_for_backward(h_ND, w_VD, logits_NV if need_grad else None)
        return loss_sum / n_valid  # nan when every label is ignored, as F.cross_entropy

    @staticmethod
    @first_order_only
    def backward(ctx, grad_loss):
        h_ND, w_VD, grad_NV = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        with torch.autocast(h_ND.device.type, enabled=False):  # (a backward called inside autocast)
            grad_h = linear(grad_NV, w_VD.t()) if need_h else None  # [N, D]
            # grad_W = G^T h as (h^T G)^T: oneDNN reads [N, V] G in place
            # as the transposed second operand
            grad_w = linear(h_ND.t().contiguous(), grad_NV.t()).t() if need_w else None  # [V, D]
        # the incoming gradient (1 for a plain loss.backward()) scales the two small products, in
        # fp32 (not read while torch.compile traces: a host read there breaks the graph)
        unit = (grad_loss.device.type == "cpu" and not torch.compiler.is_compiling()
                and grad_loss.item() == 1.0)
        if not unit:
            grad_h = None if grad_h is None else (grad_h.float() * grad_loss).to(h_ND.dtype)
            grad_w = None if grad_w is None else (grad_w.float() * grad_loss).to(w_VD.dtype)
        return grad_h, grad_w, None, None


def linear_cross_entropy(h_ND, weight_VD, labels_N, ignore_index=-100):
    """fp32 scalar mean over labels_N [N] int64 != ignore_index of -log softmax(h_ND [N, D] @
    weight_VD [V, D]^T) [label], without fp32 logits; under autocast h and W are cast first, as for
    F.linear. nan when every label is ignored (as F.cross_entropy; the gradient is then zero).
    Raises ValueError on shapes that do not fit."""
    if h_ND.dim() != 2 or weight_VD.dim() != 2 or h_ND.shape[1] != weight_VD.shape[1]:
        raise ValueError(f"linear_cross_entropy: h {tuple(h_ND.shape)} and weight "
                         f"{tuple(weight_VD.shape)} must be [N, D] and [V, D]")
    if labels_N.shape != (h_ND.shape[0],):
        raise ValueError(f"linear_cross_entropy: labels {tuple(labels_N.shape)} "
                         f"must be [{h_ND.shape[0]}]")
    device = h_ND.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h_ND.dtype
    with torch.autocast(device, enabled=False):
        return _LinearCrossEntropy.apply(h_ND.to(dtype), weight_VD.to(dtype),
                                         labels_N, ignore_index)
