"""Where the kernels run: whether Triton is installed and runs on a tensor's device, and small
helpers the kernels share.

Triton runs on CUDA tensors, and on CPU ones when TRITON_INTERPRET=1 is set before triton is first
imported (a numpy interpreter: slow, but CI tests the kernels without a GPU). Engines are chosen
when the model is built (train/engines.py).
"""
import functools
import os

import torch


def _probe_triton() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install (no compiler / driver)
        return False
    return True


_TRITON_IMPORTABLE = _probe_triton()


def triton_importable() -> bool:
    return _TRITON_IMPORTABLE


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runs_on(tensor) -> bool:
    return triton_importable() and (tensor.is_cuda
                                    or (interpreting() and tensor.device.type == "cpu"))


def cpu_values(t) -> list:
    """A CPU tensor's values as a list (a host read, not a sync: callers stay sync-free), for CPU
    kernels that loop over segment bounds. Raises ValueError on any other device, where it would be
    a device-to-host sync."""
    if t.device.type != "cpu":
        raise ValueError(f"cpu_values: expected a CPU tensor, got one on {t.device} "
                         "(reading it would sync)")
    return t.numpy().tolist()


def first_order_only(backward):
    """Decorator for an autograd.Function's backward that has no derivative of its own: under
    create_graph=True (a double backward, e.g. a gradient penalty) it raises RuntimeError saying
    so at once. (torch's once_differentiable raises only at the second backward, and only where the
    incoming gradient requires grad: under a loss whose gradient here is constant, such as a sum,
    it hands back a first gradient detached from the graph, without a word.)"""
    @functools.wraps(backward)
    def first_order_backward(ctx, *grads):
        if torch.is_grad_enabled():
            name = backward.__qualname__.split(".")[0]
            raise RuntimeError(f"{name}: no double backward (a backward with create_graph=True): "
                               f"its backward is not differentiable")
        return backward(ctx, *grads)
    return first_order_backward
