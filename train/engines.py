"""The one place that decides which engines a model is built with on a device (torchtitan's model
converters, applied before the model is built rather than after).

`engines_for(config, device, dtype)` returns the model/engines.py `Engines` that pay on `device`
under autocast `dtype` (fp32 = none); the trainer builds `MiniMindForCausalLM(config, engines)` with
them and logs `describe(model)`. Each engine keeps the parameters and state_dict keys of the plain
part, so checkpoints and exports are the same either way. The rules (measured ones, not the CPU's
name):

    Engines.linear     OneDNNLinear (kernels/cpu_linear.py)         CPU fp32 where oneDNN runs (it beats MKL)
    Engines.attend     explicit_attention (kernels/attention.py)    CPU under bf16 autocast
    Engines.decode_attend  explicit_attention                       CPU (no copy of the cache's GQA heads)
    Engines.lm_loss    linear_cross_entropy (chunked, no logits)    CPU
    Engines.experts    cpu_experts_for(dtype) (kernels/experts.py:  moe_impl "fused", CPU with oneDNN, eager
                       CPUExperts, its layout for the dtype)
                       GROUPED_EXPERTS (kernels/experts.py)         moe_impl "fused" elsewhere, or compiled,
                                                                    where torch's grouped_mm or Triton runs
                       expert_loop (model/moe.py)                   the rest (e.g. fp64; sorted's always)
    Engines.movers     TRITON_MOVERS: kernels/permute.py's row      CUDA with Triton (moe_impl "fused"; on
                       movers, run by the fused path's Permute /    CPU model/dispatch.py's PLAIN_MOVERS,
                       Combine (model/dispatch.py)                  also the reference)

moe_impl "sorted" keeps the plain expert_loop of nn.Linear-style chains: its contract is bitwise
equality with the masked loop. Tolerances of each engine against the plain part:
scripts/test_kernels.py, test_model.py.
"""
import torch
from torch import nn

from kernels.attention import explicit_attention
from kernels.cpu_linear import OneDNNLinear, onednn_runs
from kernels.experts import GROUPED_EXPERTS, cpu_experts_for
from kernels.grouped_gemm import torch_grouped_mm_fits
from kernels.linear_cross_entropy import linear_cross_entropy
from kernels.backend import triton_importable
from kernels.permute import gather_rows_triton, sum_rows_triton
from model.dispatch import RowMovers
from model.engines import PLAIN, Engines
from model.moe import Experts, MOEFeedForward

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
    elif cpu and onednn_runs("cpu", dtype) and not compiled:
        experts = cpu_experts_for(dtype)
    else:
        experts = grouped_experts_for(device, dtype, config.hidden_size, config.moe_intermediate_size,
                                      compiled)
    return Engines(linear=(OneDNNLinear
                           if cpu and dtype == torch.float32 and onednn_runs("cpu", torch.float32)
                           else nn.Linear),
                   attend=explicit_attention if cpu and dtype == torch.bfloat16 else PLAIN.attend,
                   decode_attend=explicit_attention if cpu else None,
                   lm_loss=linear_cross_entropy if cpu else None,
                   experts=experts,
                   movers=(TRITON_MOVERS if torch.device(device).type == "cuda" and triton_importable()
                           else PLAIN.movers))


def grouped_experts_for(device, dtype, hidden_size, intermediate_size, compiled=False):
    """The fused path's experts engine off the CPU GEMMs, for rows of `dtype` on `device`: torch's
    grouped_mm where it takes them (through custom ops when `compiled`), else our Triton kernels on
    CUDA, else the plain per-expert loop."""
    if torch_grouped_mm_fits(device, dtype, hidden_size, intermediate_size):
        return GROUPED_EXPERTS["torch_compiled" if compiled else "torch"]
    if torch.device(device).type == "cuda" and triton_importable():
        return GROUPED_EXPERTS["triton"]
    return PLAIN.experts


TRITON_MOVERS = RowMovers("triton", gather_rows_triton, sum_rows_triton)


def describe(model):
    """One log line naming the engines `model` runs that are not plain PyTorch."""
    counts = {}
    for m in model.modules():
        names = [type(m).__name__] if type(m) is OneDNNLinear else []
        if isinstance(m, Experts) and m.engine is not PLAIN.experts:
            names.append(m.engine.__name__)
        if isinstance(m, MOEFeedForward) and getattr(m.dispatcher, "movers", None) == TRITON_MOVERS:
            names.append("triton row movers")
        if getattr(m, "attend", None) is explicit_attention:
            names.append("explicit_attention")
        elif getattr(m, "decode_attend", None) is explicit_attention:
            names.append("explicit_attention at decode")
        if getattr(m, "chunked_lm_loss", None) is not None:
            names.append(m.chunked_lm_loss.__name__)
        for n in names:
            counts[n] = counts.get(n, 0) + 1
    return "engines: " + (", ".join(f"{name} x{n}" for name, n in counts.items()) if counts
                          else "plain PyTorch")
