"""Where the kernels run: whether Triton is installed and runs on a tensor's device, and small
helpers the kernels share.

Triton runs on CUDA tensors, and on CPU ones when TRITON_INTERPRET=1 is set before triton is first
imported (a numpy interpreter: slow, but CI tests the kernels without a GPU). Engines are chosen
when the model is built (train/engines.py).
"""
import os


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
