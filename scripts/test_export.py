"""HuggingFace export: parity of logits and greedy ids with transformers' Qwen3(-MoE), clean loading,
exact round trip, refusal of unrepresentable features, and the main job's checkpoint end to end. GGUF export
(scripts/export_gguf.py): llama.cpp's logits, greedy ids and tokenization against ours, through llama-cpp-python
in `.venv-llama` (what `.ci/run` makes; the tests skip by name without it).

    python scripts/test_export.py
"""
import io
import json
import logging
import os
import shutil
import sys
import warnings

import torch

import testlib  # noqa: E402
from testlib import ROOT, Skip, run, run_script  # noqa: F401
from model import hf_adapter
from model.hf_adapter import ExportError, from_hf_config, from_hf_state_dict
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM, RMSNorm
from train.checkpoint import save_checkpoint
from train.hf_folder import load_hf_checked
from data.tokenizer import save_tokenizer, train_tokenizer

_TMP = testlib.scratch_dir("test_export_")
__import__("transformers").utils.logging.disable_progress_bar()
# fp32 logits from two implementations of the same function differ by reassociation only (SDPA vs
# eager attention, fused vs separate expert GEMMs): ~1e-6 here; 1e-4 leaves room for other BLAS builds.
TOL = 1e-4


def _tokenizer_dir():
    path = os.path.join(_TMP, "tok")
    if not os.path.exists(path):
        texts = ["Return the number of items in the container.", "The quick brown fox jumps over the dog."] * 20
        save_tokenizer(train_tokenizer(texts, vocab_size=300), path)
    return path


def tiny_run(use_moe=True, tie=True, k=2, seed=0, scale=1.0, expert_width=48):
    """A random model with O(1) logits and non-trivial norm weights (so a dropped q/k norm would show),
    saved as a run directory (ckpt.pt + tokenizer/); scale: its routed_scaling_factor; expert_width: its
    moe_intermediate_size (hidden size 64). Every weight is moved off its initial value (as training would)."""
    cfg = MiniMindConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, use_moe=use_moe, num_experts=4, num_experts_per_tok=k,
                         moe_intermediate_size=expert_width, intermediate_size=96, tie_word_embeddings=tie,
                         max_position_embeddings=256, initializer_range=0.1, routed_scaling_factor=scale)
    torch.manual_seed(seed)
    model = MiniMindForCausalLM(cfg).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1 + 0.3 * torch.randn_like(m.weight))
        for p in model.parameters():
            p.mul_(1 + 0.1 * torch.randn_like(p))
    run_dir = os.path.join(_TMP, f"run_moe{int(use_moe)}_tie{int(tie)}_k{k}_s{scale:g}_f{expert_width}")
    save_checkpoint(os.path.join(run_dir, "ckpt.pt"), model, extra={"step": 0, "args": {}})
    tok = os.path.join(run_dir, "tokenizer")
    if not os.path.exists(tok):
        save_tokenizer(__import__("transformers").AutoTokenizer.from_pretrained(_tokenizer_dir()), tok)
    return model, run_dir


def export(run_dir, dtype="float32"):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from export_hf import export as do_export
    out = run_dir + f"_hf_{dtype}"
    do_export(run_dir, out, dtype, log=lambda *_: None, force=True)
    return out


def load_hf_quietly(path):
    """AutoModelForCausalLM.from_pretrained, returning (model, loading_info, everything it logged/warned)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    hf_logger = hf_logging.get_logger("transformers")
    hf_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    finally:
        hf_logger.removeHandler(handler)
    text = buf.getvalue() + "\n".join(str(x.message) for x in w)
    return model.eval(), info, text


CASES = [(True, True, 1), (True, True, 2), (True, False, 1), (True, False, 2), (False, True, 1), (False, False, 1)]


def test_routed_scaling_factor_goes_into_the_down_projections():
    """Qwen3-MoE has no routed_scaling_factor: the export multiplies the experts' down projections by it, so
    transformers' logits match ours (fp32, TOL), and the import reads a model of factor 1 computing the same."""
    ours, run_dir = tiny_run(True, True, 2, scale=2.0)
    hf, _, _ = load_hf_quietly(export(run_dir))
    back = load_hf_checked(run_dir + "_hf_float32")
    ids = torch.randint(0, 300, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = ours(ids).logits
        for other in (hf(ids).logits, back(ids).logits):
            assert (a - other).abs().max().item() <= TOL
    assert back.config.routed_scaling_factor == 1.0


def test_logits_parity_fp32():
    """Our plain model, and the same weights in the model built with the trainer's CPU fp32 engines
    (train.engines.engines_for: OneDNNLinear, the chunked LM loss, the fused MoE engines), give
    transformers' logits."""
    from kernels.cpu_linear import onednn_runs
    from train.engines import describe, engines_for
    for use_moe, tie, k in CASES:
        ours, run_dir = tiny_run(use_moe, tie, k)
        hf, _, _ = load_hf_quietly(export(run_dir))
        assert type(hf).__name__ == ("Qwen3MoeForCausalLM" if use_moe else "Qwen3ForCausalLM"), type(hf).__name__
        ids = torch.randint(0, 300, (3, 40), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            a, b = ours(ids).logits, hf(ids).logits
        assert a.abs().max() > 1.0, "logits too small for the test to mean anything"
        diff = (a - b).abs().max().item()
        assert diff <= TOL, f"moe={use_moe} tie={tie} k={k}: max |logit diff| {diff:.2e}"
        for impl in ("sorted", "fused") if use_moe else ("sorted",):  # the same weights, the trainer's engines
            config = MiniMindConfig.from_dict({**ours.config.to_dict(), "moe_impl": impl})
            engined = MiniMindForCausalLM(config, engines_for(config, "cpu", torch.float32)).eval()
            engined.load_state_dict(ours.state_dict(), strict=True)
            line = describe(engined)
            assert not onednn_runs("cpu", torch.float32) or "OneDNNLinear" in line, line
            with torch.no_grad():
                diff = (engined(ids).logits - b).abs().max().item()
            assert diff <= TOL, f"moe={use_moe} tie={tie} k={k} {impl} {line}: max |logit diff| {diff:.2e}"


def test_greedy_generation_identical():
    """Greedy ids: ours (with and without the KV cache, plain and built with the trainer's CPU engines)
    equal transformers'."""
    from transformers import GenerationConfig
    from train.engines import engines_for
    from testlib import rebuilt
    for use_moe, tie, k in CASES:
        ours, run_dir = tiny_run(use_moe, tie, k)
        hf, _, _ = load_hf_quietly(export(run_dir))
        prompt = torch.randint(3, 300, (1, 6), generator=torch.Generator().manual_seed(2))
        mine = ours.generate(prompt, max_new_tokens=32, temperature=0, use_cache=True)
        mine_nocache = ours.generate(prompt, max_new_tokens=32, temperature=0, use_cache=False)
        hf.generation_config = GenerationConfig(max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
        theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt))
        assert mine.shape == (1, 38), mine.shape
        assert torch.equal(mine, mine_nocache), f"moe={use_moe} tie={tie} k={k}: our cache vs no-cache"
        assert torch.equal(mine, theirs), f"moe={use_moe} tie={tie} k={k}:\n{mine}\n{theirs}"
        engined = rebuilt(ours, engines_for(ours.config, "cpu", torch.float32))  # the trainer's CPU fp32 engines
        mine = engined.generate(prompt, max_new_tokens=32, temperature=0, use_cache=True)  # (its end-of-run sample)
        assert torch.equal(mine, theirs), f"moe={use_moe} tie={tie} k={k} engines_for:\n{mine}\n{theirs}"


def test_loads_without_key_warnings():
    for use_moe, tie, k in [(True, True, 2), (True, False, 2), (False, True, 1)]:
        _, run_dir = tiny_run(use_moe, tie, k)
        out = export(run_dir)
        _, info, text = load_hf_quietly(out)
        for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
            assert not info.get(key), f"{key}: {info[key]}"
        low = text.lower()
        for bad in ("missing", "unexpected", "newly initialized", "not used", "not initialized"):
            assert bad not in low, f"load printed {bad!r}:\n{text}"
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                     "generation_config.json"):
            assert os.path.exists(os.path.join(out, name)), f"{name} missing"
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(out)
        assert tok.chat_template and "<|im_start|>" in tok.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False)


def test_round_trip_bitwise():
    for use_moe, tie, k in CASES:
        ours, run_dir = tiny_run(use_moe, tie, k)
        back = load_hf_checked(export(run_dir))
        sa, sb = ours.state_dict(), back.state_dict()
        assert set(sa) == set(sb), set(sa) ^ set(sb)
        for key in sa:
            assert torch.equal(sa[key], sb[key]), f"{key} changed in the round trip"
        skip = {"transformers_version", "architectures", "dtype"} | (set() if use_moe else set(hf_adapter._MOE_ONLY))
        fields = [f for f in MiniMindConfig.__dataclass_fields__ if f not in skip]  # dense: MoE fields unused
        diff = {f: (getattr(ours.config, f), getattr(back.config, f)) for f in fields
                if getattr(ours.config, f) != getattr(back.config, f)}
        assert not diff, f"config changed in the round trip: {diff}"


def test_layout_ambiguous_shapes_and_no_expert_left_at_init():
    """The expert widths where a transposed or mis-split weight still fits (2F == D, F == D: unsloth-zoo 849):
    transformers' logits equal ours, the trainer's engines' too; an export then an import brings back every
    expert tensor to the bit, drops none, and leaves none at its initial value (a fresh model of the same
    seed: what a converter that skipped the experts would give, as Megatron-Bridge PR 4706); transformers'
    in-memory state_dict (its fused experts) imports to the same bits."""
    from train.engines import engines_for
    for width in (32, 64):
        ours, run_dir = tiny_run(True, True, 2, expert_width=width)
        hf, _, _ = load_hf_quietly(export(run_dir))
        config = MiniMindConfig.from_dict({**ours.config.to_dict(), "moe_impl": "fused"})
        engined = MiniMindForCausalLM(config, engines_for(config, "cpu", torch.float32)).eval()
        engined.load_state_dict(ours.state_dict(), strict=True)
        ids = torch.randint(0, 300, (3, 40), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = hf(ids).logits
            for name, model in (("ours", ours), ("trainer's engines", engined)):
                diff = (model(ids).logits - want).abs().max().item()
                assert diff <= TOL, f"F={width} {name}: max |logit diff| {diff:.2e}"
        back = load_hf_checked(run_dir + "_hf_float32").state_dict()
        torch.manual_seed(0)
        fresh = MiniMindForCausalLM(ours.config).state_dict()
        source = ours.state_dict()
        experts = [key for key in source if ".mlp.experts." in key]
        assert len(experts) == 2 * 4 * 3 and set(back) == set(source), (len(experts), set(back) ^ set(source))
        for key in experts:
            assert torch.equal(back[key], source[key]), f"F={width}: {key} changed in the round trip"
            assert not torch.equal(back[key], fresh[key]), f"F={width}: {key} is at its initial value"
        fused = from_hf_state_dict(hf.state_dict(), from_hf_config(hf.config))  # transformers' own layout
        assert {k for k in fused if k.endswith(("experts.gate_up_proj", "experts.down_proj"))}, sorted(fused)[:8]
        again = MiniMindForCausalLM(from_hf_config(hf.config))
        again.load_state_dict(fused, strict=True)
        assert all(torch.equal(again.state_dict()[k], v) for k, v in source.items()), f"F={width}: fused import"


def test_bf16_export_loads_and_agrees():
    ours, run_dir = tiny_run(True, True, 2)
    hf, _, _ = load_hf_quietly(export(run_dir, "bfloat16"))
    assert next(hf.parameters()).dtype == torch.bfloat16
    back = load_hf_checked(run_dir + "_hf_bfloat16")
    for key, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[key], v.to(torch.bfloat16).float()), key


def test_refuses_what_qwen3_cannot_represent():
    ours, run_dir = tiny_run(True, True, 2)
    for cfg, field in ((MiniMindConfig(use_moe=True, capacity_factor=1.25), "capacity_factor"),
                       (MiniMindConfig(use_moe=True, moe_drop_policy="position"), "moe_drop_policy")):
        try:  # Qwen3-MoE is dropless: a capacity-limited model computes something else
            hf_adapter.check_exportable(cfg)
        except ExportError as e:
            assert field in str(e), e
        else:
            raise AssertionError(f"{field} was exported")
    hf_adapter.check_exportable(MiniMindConfig(use_moe=True, moe_expert_alignment=16))  # padding only
    from transformers import Qwen3MoeConfig
    for kw, word in [(dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0,
                                            "original_max_position_embeddings": 128}), "rope_type"),
                     (dict(attention_bias=True), "attention_bias"), (dict(mlp_only_layers=[0]), "mlp_only_layers"),
                     (dict(hidden_act="gelu"), "hidden_act='gelu'"), (dict(qk_norm_scale=2.0), "qk_norm_scale=2.0"),
                     (dict(num_hidden_layers=1, layer_types=["sliding_attention"]), "layer_types")]:
        try:
            from_hf_config(Qwen3MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, **kw))
        except ExportError as e:
            assert word in str(e), e
        else:
            raise AssertionError(f"{kw} imported")
    r = run_script("scripts/export_hf.py", "--ckpt", os.path.join(_TMP, "nothing"), "--out", os.path.join(_TMP, "x"))
    assert r.returncode == 2 and "checkpoint not found" in r.stderr, r.stderr
    before = sorted(os.listdir(run_dir))  # --out pointing at a run (or any non-export folder) is refused, not wiped
    r = run_script("scripts/export_hf.py", "--ckpt", run_dir, "--out", run_dir)
    assert r.returncode == 2 and "not an earlier export" in r.stderr and sorted(os.listdir(run_dir)) == before, r.stderr
    afile = os.path.join(_TMP, "a_file")
    open(afile, "w").write("keep me")
    r = run_script("scripts/export_hf.py", "--ckpt", run_dir, "--out", afile)
    assert r.returncode == 2 and "not an earlier export" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert open(afile).read() == "keep me"
    r = run_script("scripts/export_hf.py", "--ckpt", run_dir, "--out", os.path.join(afile, "sub"))  # under a file
    assert r.returncode == 2 and "is a file, not a folder" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    # an exported folder with a changed config field is refused by import_hf.py, not imported as another model
    hf_dir = export(run_dir)
    odd = os.path.join(_TMP, "gelu_export")
    shutil.copytree(hf_dir, odd, dirs_exist_ok=True)
    cfg = json.load(open(os.path.join(odd, "config.json")))
    json.dump({**cfg, "hidden_act": "gelu"}, open(os.path.join(odd, "config.json"), "w"))
    r = run_script("scripts/import_hf.py", "--hf", odd, "--out", os.path.join(_TMP, "gelu_run"))
    assert r.returncode == 2 and "hidden_act='gelu'" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert not os.path.exists(os.path.join(_TMP, "gelu_run"))


def test_main_job_checkpoint_exports_and_generates():
    """A (short) run of the main job -> export -> transformers generate prints text; generate.py works on
    both sides and gives the same greedy text."""
    from train.pretrain import parse_args, train
    out_dir = testlib.tiny_run()
    hf_dir = os.path.join(_TMP, "pretrain_hf")
    r = run_script("scripts/export_hf.py", "--ckpt", out_dir, "--out", hf_dir)
    assert r.returncode == 0 and "parity" in r.stdout, r.stdout + r.stderr
    texts = []
    for src in (out_dir, hf_dir):
        r = run_script("scripts/generate.py", "--ckpt", src, "--prompt", "Return the", "--temperature", "0", "--max_new_tokens", "20")
        # 20 greedy tokens of a 40-step model may well be whitespace: count them, do not judge them
        assert r.returncode == 0 and r.stdout.startswith("Return the") and len(r.stdout) > len("Return the") + 1, \
            r.stdout + r.stderr
        texts.append(r.stdout)
    assert texts[0] == texts[1], f"ours {texts[0]!r} vs transformers {texts[1]!r}"
    # and an imported copy trains on (fine-tuning path)
    train(parse_args(["--init_from", hf_dir, "--out_dir", os.path.join(_TMP, "ft"), "--max_steps", "3",
                      "--eval_tokens", "1024", "--no_progress", "--sample_tokens", "0"]), log=lambda *_: None)


def test_eval_sft_takes_runs_and_exports_and_refuses_in_one_line():
    """scripts/eval_sft.py: a run folder and its export as --base / --sft both score; a missing run (its own
    defaults in a fresh folder), a damaged checkpoint and a folder that is neither: one `error:` line, exit 2."""
    run_dir = testlib.tiny_run()
    hf_dir = os.path.join(_TMP, "eval_hf")
    assert run_script("scripts/export_hf.py", "--ckpt", run_dir, "--out", hf_dir, "--no_verify").returncode == 0
    r = run_script("scripts/eval_sft.py", "--base", hf_dir, "--sft", run_dir, "--n", "2", "--examples", "0")
    assert r.returncode == 0 and "2 held-out questions" in r.stdout, r.stdout + r.stderr[-2000:]
    damaged = os.path.join(_TMP, "eval_damaged")
    os.makedirs(damaged, exist_ok=True)
    open(os.path.join(damaged, "ckpt.pt"), "wb").write(b"not a checkpoint")
    fresh = os.path.join(_TMP, "eval_fresh")
    os.makedirs(fresh, exist_ok=True)
    for argv, needle in (([], "checkpoints/pretrain: checkpoint not found"),
                         (["--base", damaged, "--sft", run_dir], "not a readable checkpoint"),
                         (["--base", _TMP, "--sft", run_dir], "checkpoint not found")):
        r = run_script("scripts/eval_sft.py", *argv, cwd=fresh)
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.returncode == 2 and len(errors) == 1 and needle in errors[0] and "Traceback" not in r.stderr, \
            (argv, r.stderr[-2000:])


def test_short_context_model_exports_and_pads_like_hf():
    """A model with max_position_embeddings 40 (below the 48 tokens the export's parity check used to
    feed) exports and verifies; a left-padded batch of prompts of different lengths generates the same
    greedy ids with our generate and with transformers' (both take positions from the attention mask)."""
    from transformers import GenerationConfig
    from model.model_minimind import left_pad
    cfg = MiniMindConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, use_moe=True, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=48, max_position_embeddings=40, initializer_range=0.1)
    torch.manual_seed(3)
    ours = MiniMindForCausalLM(cfg).eval()
    run_dir = os.path.join(_TMP, "run_short_ctx")
    save_checkpoint(os.path.join(run_dir, "ckpt.pt"), ours, extra={"step": 0, "args": {}})
    save_tokenizer(__import__("transformers").AutoTokenizer.from_pretrained(_tokenizer_dir()),
                   os.path.join(run_dir, "tokenizer"))
    hf, _, _ = load_hf_quietly(export(run_dir))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (3, 8, 5)]
    ids, mask = left_pad(prompts, pad_id=0)
    mine = ours.generate(ids, max_new_tokens=12, temperature=0, attention_mask=mask)
    hf.generation_config = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    theirs = hf.generate(ids, attention_mask=mask)
    assert torch.equal(mine, theirs), f"\n{mine}\n{theirs}"


def llama_cpp(gguf_path, prompt, new_tokens=0, texts=()):
    """llama.cpp (llama-cpp-python in .venv-llama, or $LLAMA_CPP_PYTHON) on a GGUF file: bench_decode's runner
    (its LLAMA_CPP says what comes back)."""
    python = testlib.venv_python("LLAMA_CPP_PYTHON", ".venv-llama", "llama_cpp",
                                 "python3 -m venv .venv-llama && .venv-llama/bin/pip install llama-cpp-python numpy")
    sys.path.insert(0, os.path.join(ROOT, "scripts", "bench"))
    from bench_decode import run_llama_cpp
    return run_llama_cpp(gguf_path, prompt, new_tokens, texts, python=python)


def export_gguf(run_dir, dtype="float32"):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from export_gguf import export_gguf as do_export
    out = run_dir + f"_{dtype}.gguf"
    do_export(run_dir, out, dtype, force=True, log=lambda *_: None)
    return out


# llama.cpp's fp32 CPU kernels (with an fp32 KV cache) against ours: the same function, other summation orders
# (its GEMMs, its softmax and RMSNorm): ~3e-6 on these O(1) logits, TOL's room for other CPUs; f16 / bf16 weights
# on both sides, its activations rounded to the weights' dtype for its GEMMs: 5e-2 / 1e-1 (4e-2 measured in bf16)
GGUF_TOL = {"float32": TOL, "float16": 5e-2, "bfloat16": 1e-1}


def test_gguf_llama_cpp_computes_our_logits():
    """A random MoE (tied, k=2, routed scaling 2: folded into the experts' down projections), an untied top-1 MoE
    and a dense model, exported to GGUF: llama.cpp's logits of a 40-token prompt equal ours within GGUF_TOL
    (fp32; f16 and bf16 weights against our model rounded the same way), and its 32 greedy ids after it are
    ours (fp32)."""
    g = torch.Generator().manual_seed(0)
    for use_moe, tie, k, scale in ((True, True, 2, 2.0), (True, False, 1, 1.0), (False, True, 1, 1.0)):
        ours, run_dir = tiny_run(use_moe, tie, k, scale=scale)
        prompt = torch.randint(3, 300, (1, 40), generator=g)
        for dtype in GGUF_TOL:
            got = llama_cpp(export_gguf(run_dir, dtype), prompt[0].tolist(), new_tokens=32 if dtype == "float32" else 0)
            model = ours if dtype == "float32" else MiniMindForCausalLM(ours.config).eval()
            if dtype != "float32":  # (norms and the router stay fp32 in the file)
                rounded = getattr(torch, dtype)
                model.load_state_dict({k: v if v.dim() == 1 or ".mlp.gate." in k else v.to(rounded).float()
                                       for k, v in ours.state_dict().items()})
            with torch.no_grad():
                diff = (torch.tensor(got["logits"]) - model(prompt).logits[0].double()).abs().max().item()
            case = (use_moe, tie, k, scale, dtype)
            assert diff <= GGUF_TOL[dtype], f"{case}: max |logit diff| llama.cpp vs ours {diff:.2e}"
            if dtype == "float32":
                want = ours.generate(prompt, 32, temperature=0)[0, 40:].tolist()
                assert got["greedy"] == want, f"{case}: llama.cpp greedy {got['greedy']} vs ours {want}"


def test_gguf_of_the_main_job_tokenizes_and_decodes_like_us():
    """The tiny pretrained run through `scripts/export_gguf.py`: llama.cpp encodes code, unicode, whitespace runs
    and digits to our tokenizer's ids, and greedy-decodes from a prompt the 32 tokens scripts/generate.py
    --temperature 0 prints."""
    from transformers import AutoTokenizer
    run_dir = testlib.tiny_run()
    out = os.path.join(_TMP, "main_job.gguf")
    r = run_script("scripts/export_gguf.py", "--ckpt", run_dir, "--out", out, "--force")
    assert r.returncode == 0 and "exported qwen3moe" in r.stdout, r.stdout + r.stderr
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(run_dir, "tokenizer"))
    texts = ["def f(x):\n    return x  # twice\n\n\n", "naïve café — 日本語 😀 ok", "tabs\t\tand   spaces   ",
             "3.14159 + 2,718 = 12345678", "  leading and trailing  ", "it's we'll they've I'd"]
    prompt = tokenizer("def count_items(container):\n    ", add_special_tokens=False)["input_ids"]
    got = llama_cpp(out, prompt, new_tokens=32, texts=texts)
    for text, ids in zip(texts, got["ids"]):
        want = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids == want, f"{text!r}: llama.cpp {ids} vs ours {want}"
    r = run_script("scripts/generate.py", "--ckpt", run_dir, "--prompt", "def count_items(container):\n    ",
                   "--temperature", "0", "--max_new_tokens", "32")
    # (no end-of-text stop on llama.cpp's side: compare up to ours, which may stop early)
    text = tokenizer.decode(prompt + got["greedy"])
    assert r.returncode == 0 and (text.startswith(r.stdout.rstrip("\n")) or r.stdout.startswith(text)), \
        f"generate.py {r.stdout!r} vs llama.cpp {text!r}"


def test_gguf_export_refuses_bad_input_in_one_line_and_leaves_nothing_half_written():
    """--out an existing file (without --force) or a folder, and a model llama.cpp cannot express (unnormalised
    top-k weights) end in one `error:` line, the file there untouched; a write that fails half-way leaves
    neither --out nor its temporary file."""
    from unittest import mock
    _, run_dir = tiny_run(True, True, 2)
    out = os.path.join(_TMP, "refused.gguf")
    with open(out, "w") as f:
        f.write("not ours")
    for argv, want in (([out], "exists; pass --force"), ([_TMP], "is a folder")):
        r = run_script("scripts/export_gguf.py", "--ckpt", run_dir, "--out", *argv)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and want in lines[0], r.stderr
    assert open(out).read() == "not ours"
    cfg = MiniMindConfig(vocab_size=300, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                         use_moe=True, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)
    bad_dir = os.path.join(_TMP, "unnormalised")
    save_checkpoint(os.path.join(bad_dir, "ckpt.pt"), MiniMindForCausalLM(cfg), extra={"step": 0, "args": {}})
    r = run_script("scripts/export_gguf.py", "--ckpt", bad_dir, "--out", os.path.join(_TMP, "never.gguf"))
    assert r.returncode == 2 and "norm_topk_prob" in r.stderr and not os.path.exists(os.path.join(_TMP, "never.gguf"))
    import gguf
    failing = os.path.join(_TMP, "failing")
    os.makedirs(failing, exist_ok=True)
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from export_gguf import export_gguf as do_export
    with mock.patch.object(gguf.GGUFWriter, "write_tensors_to_file", side_effect=OSError("disk full")):
        try:
            do_export(run_dir, os.path.join(failing, "m.gguf"), log=lambda *_: None)
        except OSError as e:
            assert "disk full" in str(e)
        else:
            raise AssertionError("a failed write was not raised")
    assert os.listdir(failing) == [], os.listdir(failing)


TESTS = [test_logits_parity_fp32, test_greedy_generation_identical, test_loads_without_key_warnings,
         test_round_trip_bitwise, test_layout_ambiguous_shapes_and_no_expert_left_at_init,
         test_bf16_export_loads_and_agrees, test_refuses_what_qwen3_cannot_represent,
         test_routed_scaling_factor_goes_into_the_down_projections, test_main_job_checkpoint_exports_and_generates, test_short_context_model_exports_and_pads_like_hf,
         test_eval_sft_takes_runs_and_exports_and_refuses_in_one_line, test_gguf_llama_cpp_computes_our_logits,
         test_gguf_of_the_main_job_tokenizes_and_decodes_like_us,
         test_gguf_export_refuses_bad_input_in_one_line_and_leaves_nothing_half_written]

if __name__ == "__main__":
    run(TESTS)
