"""The CPU speed paths keep the numbers: the fused AdamW, the --dtype auto choice on CPU and bf16 autocast's loss
curve against fp32. (A run's fixed thread count: scripts/test_reproducible.py.)

    python scripts/test_cpu_speed.py
"""
import builtins
import contextlib
import json
import os
import sys
import time
import timeit
from unittest import mock

from testlib import ROOT, Skip, run, tiny_run  # noqa: F401

import torch  # noqa: E402

import torch.nn.functional as F  # noqa: E402

import train.engines as engines  # noqa: E402
from kernels.attention import explicit_attention  # noqa: E402
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM  # noqa: E402
from train import loop  # noqa: E402


@contextlib.contextmanager
def no_clock_or_load():
    """Within, reading a clock (time's, timeit's timer) or the machine's load (os.getloadavg, os.times,
    /proc/loadavg, /proc/stat, /proc/pressure) raises AssertionError: what runs inside decides from facts alone."""
    def refuse(name):
        def read(*args, **kwargs):
            raise AssertionError(f"the dtype rule read {name}: its answer would move with the machine's load")
        return read
    real_open = builtins.open

    def open_(file, *args, **kwargs):
        if str(file) in ("/proc/loadavg", "/proc/stat") or str(file).startswith("/proc/pressure"):
            refuse(file)()
        return real_open(file, *args, **kwargs)
    clocks = [(time, n) for n in ("time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns",
                                  "process_time", "process_time_ns", "thread_time", "thread_time_ns")]
    with contextlib.ExitStack() as stack:
        for module, name in clocks + [(timeit, "default_timer"), (os, "getloadavg"), (os, "times")]:
            stack.enter_context(mock.patch.object(module, name, refuse(f"{module.__name__}.{name}")))
        stack.enter_context(mock.patch.object(builtins, "open", open_))
        yield


def test_dtype_auto_on_cpu():
    """--dtype auto on CPU is a function of the machine's facts alone (train.engines.bf16_pays of cpu_facts), with its
    reason logged: from fixed facts, bf16 on AMX and on AMD's AVX512-BF16, fp32 on Intel's AVX512-BF16 without AMX, on
    AVX2-only CPUs and where oneDNN has no bf16; neither the rule nor this machine's cpu_facts reads a clock or the
    load (`no_clock_or_load`: so the machine's load cannot change the choice), and on this machine auto gives the
    rule's answer for its facts, whose vendor is /proc/cpuinfo's; the
    attention the trainer builds the model with follows the dtype (explicit scores under bf16, SDPA in fp32:
    train.engines.engines_for); an explicit --dtype is taken as given (bf16 where oneDNN runs none with a line
    that says so), and CUDA's auto is bf16."""
    class Ctx:
        distributed = False

    def args(dtype):
        return type("A", (), {"device": "cpu", "dtype": dtype})

    def facts(vendor, amx=False, avx512_bf16=False, onednn_bf16=True):
        return {"vendor": vendor, "amx": amx, "avx512_bf16": avx512_bf16, "onednn_bf16": onednn_bf16}

    cases = [(facts("GenuineIntel", amx=True, avx512_bf16=True), "bfloat16", "AMX"),
             (facts("AuthenticAMD", avx512_bf16=True), "bfloat16", "AVX512-BF16 on AMD"),
             (facts("GenuineIntel", avx512_bf16=True), "float32", "without AMX"),
             (facts("", avx512_bf16=True), "float32", "without AMX"),
             (facts("AuthenticAMD"), "float32", "no native bf16"),
             (facts("GenuineIntel", amx=True, avx512_bf16=True, onednn_bf16=False), "float32", "oneDNN")]
    real = loop.cpu_facts
    try:
        for machine, want, why in cases:
            loop.cpu_facts = lambda: dict(machine)
            lines = []
            with no_clock_or_load():
                assert loop.resolve_dtype(args("auto"), Ctx, "cpu", lines.append) == getattr(torch, want), machine
            assert len(lines) == 1 and f"dtype auto: {want} (" in lines[0] and why in lines[0], lines
        loop.cpu_facts = lambda: facts("GenuineIntel", amx=True)
        lines = []
        assert loop.resolve_dtype(args("float32"), Ctx, "cpu", lines.append) == torch.float32
        assert loop.resolve_dtype(args("bfloat16"), Ctx, "cpu", lines.append) == torch.bfloat16
        assert not lines, lines
        loop.cpu_facts = lambda: facts("AuthenticAMD", onednn_bf16=False)  # asked for where it is emulated
        assert loop.resolve_dtype(args("bfloat16"), Ctx, "cpu", lines.append) == torch.bfloat16
        assert len(lines) == 1 and "no native bf16 GEMMs" in lines[0], lines
        lines.clear()
        loop.cpu_facts = lambda: facts("")
        assert loop.resolve_dtype(args("auto"), Ctx, "cuda", lines.append) == torch.bfloat16 and not lines, lines
    finally:
        loop.cpu_facts = real
    lines = []
    with no_clock_or_load():  # this machine, its own facts
        here = engines.cpu_facts()
        got = loop.resolve_dtype(args("auto"), Ctx, "cpu", lines.append)
    assert set(here) == {"vendor", "amx", "avx512_bf16", "onednn_bf16"}, here
    with open("/proc/cpuinfo") as cpuinfo:
        vendor = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("vendor_id")), "")
    assert here["vendor"] == vendor, (here, vendor)
    pays, why = engines.bf16_pays(here)
    assert got == (torch.bfloat16 if pays else torch.float32) and len(lines) == 1 and why in lines[0], (here, got, lines)
    for dtype, want in ((torch.bfloat16, explicit_attention), (torch.float32, F.scaled_dot_product_attention)):
        cfg = MiniMindConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2)
        model = MiniMindForCausalLM(cfg, engines.engines_for(cfg, "cpu", dtype))
        kinds = {layer.self_attn.attend for layer in model.model.layers}
        line = engines.describe(model)
        assert kinds == {want}, (dtype, kinds, line)
        assert ("explicit_attention x2" in line) == (want is explicit_attention), line
        # (a decode step attends with explicit_attention in either dtype: the cache's GQA heads read in place)
        assert {layer.self_attn.decode_attend for layer in model.model.layers} == {explicit_attention}, line


def test_resume_keeps_the_recorded_dtype():
    """A run trained under --dtype auto resumes in the dtype it recorded, even where the rule now says the other
    one (another machine, a changed rule): the checkpoint's flags name the dtype, and resolve_dtype takes a named
    dtype as given."""
    from train import flags
    from train.pretrain import STAGE
    ckpt = os.path.join(tiny_run(), "ckpt.pt")
    resumed = flags.parse_args(STAGE, ["--resume", ckpt, "--out_dir", os.path.dirname(ckpt)])
    recorded = resumed.dtype
    assert recorded in ("float32", "bfloat16"), recorded
    other = {"float32": True, "bfloat16": False}[recorded]  # what would make auto pick the other dtype

    class Ctx:
        distributed = False
    real = loop.bf16_pays
    try:
        loop.bf16_pays = lambda facts: (other, "the rule changed")
        lines = []
        assert loop.resolve_dtype(resumed, Ctx, "cpu", lines.append) == getattr(torch, recorded) and not lines, lines
    finally:
        loop.bf16_pays = real


def test_bf16_curve_tracks_fp32():
    """The golden tiny run (scripts/test_golden.py, 30 steps) under bf16 autocast: the same records (steps and
    fields) with the same learning rates as the fp32 golden curve, every logged training and
    validation loss within 1% of it (measured on an AMD EPYC with AVX512-BF16: 0.17%
    sorted, 0.14% fused), the router loss within 10% (it is a small difference of routing statistics:
    measured 3-4%)."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import test_golden
    want = json.load(open(test_golden.GOLDEN))["records"]
    for impl in ("sorted", "fused"):
        got = test_golden.golden_run(["--dtype", "bfloat16", "--moe_impl", impl])
        assert len(got) == len(want), f"{impl}: {len(got)} records, fp32 {len(want)}"
        for g, w in zip(got, want):
            assert sorted(g) == sorted(w), f"{impl}: record {g} has other fields than fp32's {w}"
            # the schedule does not depend on the dtype: the same steps logged, the same learning rate
            assert g["step"] == w["step"] and g.get("lr") == w.get("lr"), f"{impl}: bf16 {g} vs fp32 {w}"
            for key, tol in (("train_loss", 0.01), ("val_loss", 0.01), ("aux_loss", 0.10)):
                if key in w:
                    rel = abs(g[key] - w[key]) / abs(w[key])
                    assert rel < tol, f"{impl} step {w['step']} {key}: bf16 {g[key]:.4f} vs fp32 {w[key]:.4f}"


def test_fused_adamw_is_the_loop():
    """The trainer's optimizer is torch's fused AdamW on CPU (train/loop.make_optimizer), with the two
    weight-decay groups; 10 of its steps on fixed gradients end within 1e-6 relative to the largest weight
    (the update's rounding order; measured ~1e-7) of the per-parameter loop's."""
    def weights(fused):
        torch.manual_seed(0)
        cfg = MiniMindConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, use_moe=True, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32)
        model = MiniMindForCausalLM(cfg).train()
        args = type("Args", (), {"weight_decay": 0.1, "learning_rate": 3e-3})
        opt = loop.make_optimizer(model, args)
        assert opt.defaults["fused"] is True and len(opt.param_groups) == 2
        if not fused:
            for group in opt.param_groups:
                group["fused"], group["foreach"] = False, False
        gen = torch.Generator().manual_seed(1)
        for _ in range(10):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        return [p.detach() for p in model.parameters()]

    for a, b in zip(weights(True), weights(False)):
        rel = ((a - b).abs().max() / b.abs().max()).item()
        assert rel < 1e-6, f"fused AdamW {rel:.2e} from the loop"


TESTS = [test_fused_adamw_is_the_loop, test_dtype_auto_on_cpu, test_resume_keeps_the_recorded_dtype,
         test_bf16_curve_tracks_fp32]

if __name__ == "__main__":
    run(TESTS)
