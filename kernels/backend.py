"""Which implementation a kernel call runs: Triton, a torch built-in, or the plain-PyTorch
reference.

Triton runs on CUDA tensors, and on CPU ones when TRITON_INTERPRET=1 is set before triton is first
imported (a numpy interpreter: slow, but CI tests the kernels without a GPU). Public kernels take
`backend` in {"auto", "triton", "reference"} (grouped GEMM also "torch"); "auto" picks Triton where
it runs, else the reference.
"""
import os
import warnings

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


def cast(t, dtype):
    """t in `dtype`: t itself, with no `.to()` call, when it has that dtype already. The kernels'
    autograd Functions return through this: torch 2.11's compile (aot_eager too) gives a wrong
    gradient, zero or partial, for a Function whose forward returns a no-op `.to()` or the result of
    an in-place op; 2.13 does not."""
    return t if t.dtype == dtype else t.to(dtype)


def cpu_values(t) -> list:
    """A CPU tensor's values as a list (a host read, not a sync: callers stay sync-free), for CPU
    kernels that loop over segment bounds. Raises ValueError on any other device, where it would be
    a device-to-host sync."""
    if t.device.type != "cpu":
        raise ValueError(f"cpu_values: expected a CPU tensor, got one on {t.device} "
                         "(reading it would sync)")
    return t.numpy().tolist()


_warned = set()


def warn_once(key: str, message: str):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def choose(backend: str, tensor, what: str) -> str:
    """Resolve `backend` for a kernel on `tensor` to "triton" or "reference". Raises ValueError for
    an unknown backend, RuntimeError when "triton" is forced where it cannot run."""
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'reference' for {what}, "
                         f"got {backend!r}")
    if backend == "triton" and not triton_runs_on(tensor):
        raise RuntimeError(f"{what}: Triton cannot run on this {tensor.device.type} tensor "
                           f"(installed: {triton_importable()}; "
                           "on CPU set TRITON_INTERPRET=1 before importing)")
    if backend == "auto":
        if triton_runs_on(tensor):
            return "triton"
        if tensor.is_cuda:
            warn_once(what, f"{what}: Triton is not available, using the plain-PyTorch reference")
        return "reference"
    return backend
