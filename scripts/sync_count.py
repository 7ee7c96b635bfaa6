"""Count the calls that would force a device-to-host sync on CUDA, on any device (CPU included).

CI has no GPU, so "one sync per MoE layer" is checked by counting, under a TorchDispatchMode, the aten
ops whose output size or value must reach the host: `_local_scalar_dense` (`.item()`, `bool(t)`),
`nonzero`, `masked_select`, indexing or assigning with a boolean mask, `unique*`, `repeat_interleave`
with a tensor count and no `output_size`, and copies from a CUDA tensor to the CPU. `Tensor.tolist()`
copies to the host without passing through the aten dispatcher, so a TorchFunctionMode counts it (once
per call; what it does inside is not counted again), except on a tensor made from Python values
(`torch.tensor(list)`, aten's `lift_fresh`): such a tensor is made on the host, and reading it back is no
sync on any device.
"""
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_ALWAYS = {"_local_scalar_dense", "nonzero", "nonzero_static_no", "masked_select", "unique", "_unique",
           "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive"}


def _has_bool_index(indices):
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (indices or ()))


class SyncCounter:
    """Context manager: `with SyncCounter() as c: f(x)`; then `c.count` and `c.ops` (names, in order)."""

    def __init__(self):
        self.ops = []
        self._in_tolist = 0
        self._host_made = {}  # id -> weakref of the tensors made from Python values
        counter = self

        class _Fn(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func is torch.Tensor.tolist and not counter._made_on_host(args[0]):
                    counter.ops.append("Tensor.tolist")
                    counter._in_tolist += 1
                    try:
                        return func(*args, **(kwargs or {}))
                    finally:
                        counter._in_tolist -= 1
                return func(*args, **(kwargs or {}))

        class _Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if not counter._in_tolist and counter._syncs(func, args, kwargs):
                    counter.ops.append(str(func))
                out = func(*args, **kwargs)
                if func is torch.ops.aten.lift_fresh.default:
                    counter._host_made[id(out)] = weakref.ref(out)
                return out

        self._modes = (_Fn(), _Dispatch())

    def _made_on_host(self, t):
        ref = self._host_made.get(id(t))
        return ref is not None and ref() is t

    @staticmethod
    def _syncs(func, args, kwargs):
        name = func._schema.name.split("::")[-1]
        if name in _ALWAYS:
            return True
        if name in ("index", "_index_put_impl_", "index_put", "index_put_"):
            return _has_bool_index(args[1] if len(args) > 1 else kwargs.get("indices"))
        if name == "repeat_interleave":
            repeats = args[0] if func._overloadname == "Tensor" else (args[1] if len(args) > 1 else None)
            return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
        if name in ("_to_copy", "copy_"):
            src = args[1] if name == "copy_" else args[0]
            dst_dev = args[0].device if name == "copy_" else kwargs.get("device")
            return (isinstance(src, torch.Tensor) and src.device.type == "cuda"
                    and dst_dev is not None and torch.device(dst_dev).type == "cpu")
        return False

    @property
    def count(self):
        return len(self.ops)

    def __enter__(self):
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc):
        for m in reversed(self._modes):
            m.__exit__(*exc)
        return False


def count_syncs(fn, *args):
    """Run fn(*args) and return (result, number of sync-inducing calls)."""
    with SyncCounter() as c:
        out = fn(*args)
    return out, c.count
