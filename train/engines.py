"""The one place that decides which engines a model is built with on a device (torchtitan's model
converters, applied before the model is built rather than after).

`engines_for(config, device, dtype)` returns the model/engines.py `Engines` that pay on `device`
under autocast `dtype` (fp32 = none); the trainer builds `MiniMindForCausalLM(config, engines)` with
them and logs `describe(model)`. Each engine keeps the parameters and state_dict keys of the plain
part, so checkpoints and exports are the same either way. The rules (measured ones, not the CPU's
name):

    Engines.linear     OneDNNLinear (kernels/cpu_linear.py)         CPU fp32 where oneDNN runs (it beats MKL)
    Engines.attend     explicit_attention (kernels/attention.py)    CPU under bf16 autocast
    Engines.lm_loss    linear_cross_entropy (chunked, no logits)    CPU
    Engines.experts    CPUExperts (kernels/experts.py)              moe_impl "fused", CPU with oneDNN, eager
                       grouped_experts_for (kernels/experts.py)     moe_impl "fused" elsewhere, or compiled
    Engines.permute    permute_triton, combine_triton: the fused    CUDA with Triton (moe_impl "fused"; on
      and .combine     path's Permute / Combine on the row movers   CPU model/dispatch.py's plain ones, also
                       of kernels/permute.py                        the reference)

moe_impl "sorted" keeps the plain expert_loop of nn.Linear-style chains: its contract is bitwise
equality with the masked loop. Tolerances of each engine against the plain part:
scripts/test_kernels.py, test_model.py.
"""
import torch
from torch import nn

from kernels.attention import explicit_attention
from kernels.cpu_linear import OneDNNLinear, onednn_runs
from kernels.experts import cpu_experts, grouped_experts_for
from kernels.linear_cross_entropy import linear_cross_entropy
from kernels.backend import triton_importable
from kernels.permute import gather_rows_triton, sum_rows_triton
from model.dispatch import RowMovers, combine_rows, permute_rows
from model.engines import PLAIN, Engines
from model.moe import Experts, MOEFeedForward, engine_name

def cpu_facts():
    """What --dtype auto reads of this CPU: {"vendor": /proc/cpuinfo's vendor_id ("GenuineIntel",
    "AuthenticAMD", "" where unknown), "amx": AMX tiles usable, "avx512_bf16": AVX512-BF16 usable,
    "onednn_bf16": oneDNN runs bf16 GEMMs here}. Properties of the machine, not timings."""
    vendor = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            vendor = next((line.split(":", 1)[1].strip() for line in cpuinfo
                           if line.startswith("vendor_id")), "")
    except OSError:
        pass
    def has(name):
        return bool(getattr(torch.cpu, name, lambda: False)())
    return {"vendor": vendor, "amx": has("_is_amx_tile_supported"),
            "avx512_bf16": has("_is_avx512_bf16_supported"),
            "onednn_bf16": onednn_runs("cpu", torch.bfloat16)}


def bf16_pays(facts):
    """(True if bf16 autocast trains faster than fp32 on a CPU with these `cpu_facts`, the reason
    in words): --dtype auto's rule on CPU, from the CPU kinds measured (scripts/README.md:
    bench_train's rows per kind). bf16 where oneDNN runs it on AMX tiles, or on AVX512-BF16 of an
    AMD CPU; fp32 on an Intel CPU with AVX512-BF16 but no AMX (oneDNN's avx512_core_bf16 GEMMs run
    below its fp32 ones there), on AVX2-only CPUs (bf16 emulated) and where oneDNN cannot run bf16.
    A pure function of the facts."""
    if not facts["onednn_bf16"]:
        return False, "oneDNN runs no bf16 GEMMs here"
    if facts["amx"]:
        return True, "AMX tiles: native bf16 GEMMs"
    if facts["avx512_bf16"] and facts["vendor"] == "AuthenticAMD":
        return True, "AVX512-BF16 on AMD: native bf16 GEMMs, faster than fp32"
    if facts["avx512_bf16"]:
        vendor = facts["vendor"] or "an unknown vendor"
        return False, f"AVX512-BF16 without AMX on {vendor}: bf16 GEMMs slower than fp32"
    return False, "no native bf16 GEMMs (bf16 would be emulated)"


def engines_for(config, device, dtype, compiled=False) -> Engines:
    """The engines that pay for `config` on `device` ("cpu" | "cuda...") under autocast `dtype` (see
    the module doc); compiled: the model will run under torch.compile (its graph cannot hold the CPU
    experts engine's host-side layout)."""
    cpu = torch.device(device).type == "cpu"
    if not (config.use_moe and config.moe_impl == "fused"):
        experts = PLAIN.experts
    else:
        experts = (cpu_experts if cpu and onednn_runs("cpu", dtype) and not compiled else
                   grouped_experts_for(device, dtype, config.hidden_size,
                                       config.moe_intermediate_size, compiled))
    return Engines(linear=(OneDNNLinear
                           if cpu and dtype == torch.float32 and onednn_runs("cpu", torch.float32)
                           else nn.Linear),
                   attend=explicit_attention if cpu and dtype == torch.bfloat16 else PLAIN.attend,
                   lm_loss=linear_cross_entropy if cpu else None,
                   experts=experts,
                   **(dict(permute=permute_triton, combine=combine_triton)
                      if torch.device(device).type == "cuda" and triton_importable() else {}))


TRITON_MOVERS = RowMovers(gather_rows_triton, sum_rows_triton)


def permute_triton(x_TD, rm):
    """model/dispatch.py: permute_rows on the Triton row movers (kernels/permute.py)."""
    return permute_rows(x_TD, rm, TRITON_MOVERS)


def combine_triton(rows_PD, rm):
    """model/dispatch.py: combine_rows on the Triton row movers (kernels/permute.py)."""
    return combine_rows(rows_PD, rm, TRITON_MOVERS)


def describe(model):
    """One log line naming the engines `model` runs that are not plain PyTorch."""
    counts = {}
    for m in model.modules():
        names = [type(m).__name__] if type(m) is OneDNNLinear else []
        if isinstance(m, Experts) and m.engine is not PLAIN.experts:
            names.append(engine_name(m.engine))
        if (isinstance(m, MOEFeedForward)
                and getattr(m.dispatcher, "permute", None) is permute_triton):
            names.append("permute_triton/combine_triton")
        if getattr(m, "attend", None) is explicit_attention:
            names.append("explicit_attention")
        if getattr(m, "chunked_lm_loss", None) is not None:
            names.append(m.chunked_lm_loss.__name__)
        for n in names:
            counts[n] = counts.get(n, 0) + 1
    return "engines: " + (", ".join(f"{name} x{n}" for name, n in counts.items()) if counts
                          else "plain PyTorch")
