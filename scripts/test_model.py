"""The causal LM: config validation, shapes and losses, tied embeddings, KV-cache generation.

    python scripts/test_model.py
"""
import math
import os
from unittest import mock

import torch

from testlib import Skip, run  # noqa: F401
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM, MOEFeedForward


def tiny(cpu_engines=False, **kw):
    """A tiny model; cpu_engines=True: built with the CPU fp32 engines of train.engines.engines_for (what
    the trainer runs: OneDNNLinear, the chunked LM loss, the fused MoE engines); the same weights either way."""
    cfg = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               use_moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=128)
    cfg.update(kw)
    config = MiniMindConfig(**cfg)
    torch.manual_seed(0)
    if cpu_engines:
        from train.engines import engines_for
        return MiniMindForCausalLM(config, engines_for(config, "cpu", torch.float32))
    return MiniMindForCausalLM(config)


def test_config_errors_name_the_field():
    cases = [(dict(num_experts=4, num_experts_per_tok=5), "num_experts_per_tok"),
             (dict(hidden_size=64, num_attention_heads=5), "num_attention_heads"),
             (dict(num_attention_heads=8, num_key_value_heads=3), "num_key_value_heads"),
             (dict(num_experts=0), "num_experts"), (dict(dropout=1.5), "dropout"),
             (dict(hidden_size=60, num_attention_heads=4), "head_dim"),
             (dict(router_aux_loss_coef=-1.0), "router_aux_loss_coef"),
             (dict(router_aux_loss_coef=float("nan")), "router_aux_loss_coef"),
             (dict(router_z_loss_coef=float("inf")), "router_z_loss_coef"),
             (dict(use_moe=True, router_bias_update_rate=float("inf")), "router_bias_update_rate"),
             (dict(use_moe=False, router_bias_update_rate=0.1), "router_bias_update_rate"),  # dense: no router
             (dict(use_moe=True, router_aux_loss_type="switchy"), "router_aux_loss_type"),
             (dict(use_moe=True, router_dtype="bfloat16"), "router_dtype"),
             (dict(use_moe=True, moe_impl="triton"), "moe_impl"),
             (dict(use_moe=True, capacity_factor=float("inf")), "capacity_factor")]
    for kw, field in cases:
        try:
            MiniMindConfig(**kw)
        except ValueError as e:
            assert field in str(e), f"{kw}: message {e!r} does not name {field}"
        else:
            raise AssertionError(f"{kw}: no error")
    try:
        MiniMindConfig(hidden_size="64")
    except TypeError as e:
        assert "hidden_size" in str(e)
    else:
        raise AssertionError("a str hidden_size was accepted")


def test_checkpoint_roundtrip():
    """save_checkpoint -> load_checkpoint -> model_from_checkpoint (how every tool builds a model) gives the
    trainer's engines (train/engines.py: engines_for) and the same logits, bitwise (the RoPE tables are
    rebuilt, not read from the file), for the sorted and the fused MoE path; attention_mask must have the
    batch shape."""
    import tempfile

    from train.engines import describe, engines_for
    from train.checkpoint import load_checkpoint, model_from_checkpoint, save_checkpoint
    for impl in ("sorted", "fused"):
        torch.manual_seed(0)
        config = MiniMindConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                num_key_value_heads=1, use_moe=True, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32, moe_impl=impl)
        model = MiniMindForCausalLM(config, engines_for(config, "cpu", torch.float32)).eval()  # as the trainer
        ids = torch.randint(0, 64, (2, 9))
        with tempfile.TemporaryDirectory() as d:
            save_checkpoint(os.path.join(d, "ckpt.pt"), model)
            again = model_from_checkpoint(load_checkpoint(d)).eval()  # as chat, generate, eval_sft, export
        assert describe(again) == describe(model), (describe(again), describe(model))
        assert torch.equal(model(ids).logits, again(ids).logits), impl
    try:
        model(ids, attention_mask=torch.ones(3, 9))
    except ValueError as e:
        assert "attention_mask" in str(e)
    else:
        raise AssertionError("a mis-shaped attention_mask was accepted")


def test_checkpoint_layout():
    """The module's state_dict keeps HF's per-expert keys (the user's acceptance test pins them); checkpoints
    hold the stacked tensors under their own names (`model_state`, `optimizer_state`: torch's state_dict
    helpers)."""
    from train.checkpoint import model_state, optimizer_state
    model = tiny(cpu_engines=True, moe_impl="fused").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 97, (2, 8))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    E, F, D = 4, 32, 64
    keys = set(model.state_dict())
    assert {f"model.layers.0.mlp.experts.{E - 1}.{p}_proj.weight" for p in ("gate", "up", "down")} <= keys
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in keys)
    want = {"model": model_state(model), "optimizer": optimizer_state(model, optimizer)}
    assert want["model"]["model.layers.0.mlp.experts.gate_up_proj"].shape == (E, 2 * F, D)
    assert "model.layers.1.mlp.experts.down_proj" in want["optimizer"]["state"]


def test_experts_load_and_pickle_edge_cases():
    """Per-expert loading: a misshapen entry is a size-mismatch error naming its key (a wrong gate / up
    split too) whose slot keeps its weights while the entries that fit load, absent experts are reported missing by their own keys while
    the rest load (strict=False), entries of mixed dtypes load exactly;
    a model on the grouped experts engine pickles."""
    import io

    from train.engines import engines_for
    layer = MOEFeedForward(MiniMindConfig(hidden_size=32, num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=16))
    state = dict(layer.state_dict())
    split = {**state, "experts.0.gate_proj.weight": torch.zeros(24, 32), "experts.0.up_proj.weight": torch.zeros(8, 32)}
    try:
        MOEFeedForward(layer.config).load_state_dict(split)
    except RuntimeError as e:
        assert "size mismatch for experts.0.gate_proj.weight" in str(e) and "gate_up_proj" not in str(e), e
    else:
        raise AssertionError("a 24 + 8 gate / up split loaded")
    partial = {k: v for k, v in state.items() if k != "experts.3.down_proj.weight"}
    other = MOEFeedForward(layer.config)
    result = other.load_state_dict(partial, strict=False)
    assert result.missing_keys == ["experts.3.down_proj.weight"] and not result.unexpected_keys, result
    assert torch.equal(other.experts.gate_up_proj, layer.experts.gate_up_proj)
    other.experts.gate_up_proj.data[2, 16:] = 7.0  # all given, one misshapen: it keeps its weights, the rest load
    try:
        other.load_state_dict({**state, "experts.2.up_proj.weight": torch.zeros(5, 32)}, strict=False)
    except RuntimeError as e:
        assert "size mismatch for experts.2.up_proj.weight" in str(e), e
    assert (other.experts.gate_up_proj[2, 16:] == 7.0).all()
    assert torch.equal(other.experts.down_proj, layer.experts.down_proj)
    mixed = {**state, "experts.0.gate_proj.weight": state["experts.0.gate_proj.weight"].bfloat16()}
    other.load_state_dict(mixed)  # one bf16 entry: the others load exactly (the stack promotes, as torch.cat would)
    assert torch.equal(other.experts.gate_up_proj[1:], layer.experts.gate_up_proj[1:])
    config = MiniMindConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, num_experts=4, moe_intermediate_size=16, moe_impl="fused")
    torch.save(MiniMindForCausalLM(config, engines_for(config, "cpu", torch.float32, compiled=True)), io.BytesIO())


def forward_allocations(layer, x):
    """(op name, output shape, bytes) of every tensor with new memory (not a view of an input) that the ops of
    `layer(x)` return (TorchDispatchMode)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                    seen.append((str(func.overloadpacket.__name__), tuple(t.shape), t.nbytes))
            return out

    seen = []
    with Record():
        layer(x)
    return seen


def test_no_expert_weight_copy_per_forward():
    """The experts' stacked weights are read as they are: a forward of the fused layer built with the trainer's
    CPU engines makes no tensor the shape or size of the experts' weights, whole or one expert's (no per-step
    concatenation, stack or copy); under bf16 autocast the one pass over them is the cast, one `_to_copy` per
    stacked tensor. Also the sorted layer's loop (views, no copy). Prints the bytes the layer's forward makes."""
    from train.engines import engines_for
    from testlib import rebuilt
    E, D, F = 6, 40, 24
    plain = MOEFeedForward(MiniMindConfig(hidden_size=D, num_experts=E, num_experts_per_tok=2, moe_intermediate_size=F,
                                          moe_impl="fused")).train()
    weight_shapes = {(E, 2 * F, D), (E, D, F), (E * 2 * F, D), (2 * F, D), (F, D), (D, F)}
    weight_sizes = {E * 2 * F * D, E * D * F, E * 3 * F * D}
    x = torch.randn(2, 5, D)
    for dtype in (torch.float32, torch.bfloat16):
        layer = rebuilt(plain, engines_for(plain.config, "cpu", dtype))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            seen = forward_allocations(layer, x)
        copies = [s for s in seen if s[1] in weight_shapes or math.prod(s[1]) in weight_sizes]
        casts = [(E, 2 * F, D), (E, D, F)] if dtype == torch.bfloat16 else []
        assert sorted(shape for _, shape, _ in copies) == sorted(casts), (dtype, copies)
        assert all(op == "_to_copy" for op, _, _ in copies), copies
        print(f"        fused layer forward, {str(dtype)[6:]}: {sum(b for *_, b in seen):,} bytes made in "
              f"{len(seen)} tensors (expert weights {4 * E * 3 * F * D:,} bytes in fp32)")
    sorted_layer = MOEFeedForward(MiniMindConfig(hidden_size=D, num_experts=E, num_experts_per_tok=2,
                                                 moe_intermediate_size=F)).train()
    copies = [s for s in forward_allocations(sorted_layer, x) if s[1] in weight_shapes]
    assert not copies, copies


def test_config_defaults_and_roundtrip():
    """The defaults are the main job's model (4 layers of width 256, 4 experts, top-2, expert width 384,
    sorted dispatch); derived fields fill in; to_dict / from_dict round-trips."""
    c = MiniMindConfig()
    assert c.head_dim == c.hidden_size // c.num_attention_heads and c.rope_theta == 1e6 and c.tie_word_embeddings
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.max_position_embeddings) == (256, 4, 4, 2, 2048), c
    assert c.use_moe and (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (4, 2, 384), c
    assert c.moe_impl == "sorted" and c.intermediate_size == 832  # ceil(256 * pi / 64) * 64
    for name in ("linear_backend", "attn_impl", "lm_loss_impl"):  # engines are chosen when built, not configured
        assert name not in MiniMindConfig.__dataclass_fields__, name
    assert MiniMindConfig(moe_intermediate_size=None).moe_intermediate_size == c.intermediate_size
    from model.config import trained_config  # the main job's model: the trainer's two departures, named once
    job = trained_config()
    assert (job.moe_impl, job.routed_scaling_factor) == ("fused", 2.0), job
    assert {k: v for k, v in job.to_dict().items() if k not in ("moe_impl", "routed_scaling_factor")} == \
        {k: v for k, v in c.to_dict().items() if k not in ("moe_impl", "routed_scaling_factor")}
    assert trained_config(num_experts_per_tok=3).routed_scaling_factor == 3.0
    assert not any(isinstance(layer.mlp, MOEFeedForward) for layer in tiny(use_moe=False).model.layers)
    c2 = MiniMindConfig.from_dict(MiniMindConfig(use_moe=True, num_experts=8, num_experts_per_tok=2).to_dict())
    assert c2.num_experts == 8 and c2.num_experts_per_tok == 2 and c2.use_moe


def test_readme_states_the_main_jobs_parameter_counts():
    """README.md's first paragraph ("7.2M parameters (4.8M active per token), 4 layers, width 256, ...") is the
    main job's model: train/pretrain.py's default flags -> flags.build_config, built on the meta device (no
    memory, no init). The total and the active count round (to 0.1M) to README's figures, read from README.md,
    so either drifting fails here; the active count is taken from the model's own stacked expert tensors (a token
    skips E - k of every layer's E experts), and train/report.py's param_counts (the run's `model:` line)
    agrees with both. The shape README states (layers, width, heads, KV heads, experts, expert width, top-k) too."""
    import re
    from testlib import ROOT
    from train.flags import build_config
    from train.pretrain import parse_args
    from train.report import param_counts
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = " ".join(f.read().split())
    m = re.search(r"([\d.]+)M parameters \(([\d.]+)M active per token\), (\d+) layers, width (\d+), (\d+) attention "
                  r"heads \((\d+) KV heads.*?MoE feed-forward of (\d+) SwiGLU experts \(width (\d+)\), softmax top-(\d+)",
                  readme)
    assert m, "README.md no longer states the main job's model as this test reads it"
    config = build_config(parse_args([]))
    with torch.device("meta"):
        model = MiniMindForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())  # (the tied LM head counted once)
    experts = [p for n, p in model.named_parameters() if ".mlp.experts." in n]
    assert experts and all(p.shape[0] == config.num_experts for p in experts), [p.shape for p in experts]
    skipped = sum(p.numel() for p in experts) // config.num_experts * (config.num_experts - config.num_experts_per_tok)
    active = total - skipped
    print(f"        main job's model: {total:,} parameters ({total / 1e6:.1f}M), {active:,} active ({active / 1e6:.1f}M);"
          f" README.md: {m.group(1)}M ({m.group(2)}M active)")
    assert (f"{total / 1e6:.1f}", f"{active / 1e6:.1f}") == (m.group(1), m.group(2)), (total, active, m.group(0))
    assert param_counts(model, config) == (total, active), (param_counts(model, config), total, active)
    shape = (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
             config.num_experts, config.moe_intermediate_size, config.num_experts_per_tok)
    assert shape == tuple(int(g) for g in m.groups()[2:]), (shape, m.group(0))


def test_forward_loss_and_aux():
    for use_moe in (True, False):
        model = tiny(use_moe=use_moe).train()
        ids = torch.randint(0, 97, (3, 17))
        out = model(ids, labels=ids)
        assert out.logits.shape == (3, 17, 97)
        assert torch.allclose(out.loss, out.ce_loss + out.aux_loss)
        if use_moe:
            assert out.aux_loss > 0 and all(isinstance(l.mlp, MOEFeedForward) for l in model.model.layers)
        else:
            assert out.aux_loss == 0
        out.loss.backward()
        assert all(p.grad is not None for p in model.parameters()), "a parameter got no gradient"


def test_chunked_lm_loss_is_the_torch_loss():
    """The model built with the engines train.engines.engines_for picks on CPU fp32 (the chunked LM loss
    linear_cross_entropy, OneDNNLinear where oneDNN runs) gives the plain model's F.cross_entropy loss and
    gradients (fp32: within 1e-5 relative to the largest value, rounding of the GEMM and softmax order) with
    ignored labels, tied and untied heads, and returns no logits; without labels the logits are there. The
    chunked loss alone (Engines with only lm_loss set) too. Built with the same seed, the engines' model has
    every state_dict key and tensor of the plain one (and a tied head stays tied)."""
    import dataclasses

    from kernels.cpu_linear import OneDNNLinear, onednn_runs
    from train.engines import describe, engines_for
    from kernels.linear_cross_entropy import linear_cross_entropy
    from model.engines import PLAIN
    ids = torch.randint(0, 97, (3, 17))
    labels = ids.clone()
    labels[:, :4] = -100
    onednn = onednn_runs("cpu", torch.float32)
    for tied in (True, False):
        outs = {}
        for engines in ("plain", "loss only", "engines_for"):
            model = tiny(tie_word_embeddings=tied).train()
            before = model.state_dict()
            if engines == "loss only":
                torch.manual_seed(0)
                model = MiniMindForCausalLM(model.config, dataclasses.replace(PLAIN, lm_loss=linear_cross_entropy)).train()
                assert model.chunked_lm_loss is linear_cross_entropy and describe(model) == "engines: linear_cross_entropy x1"
                assert not any(isinstance(m, OneDNNLinear) for m in model.modules())
            elif engines == "engines_for":
                assert engines_for(model.config, "cpu", torch.float32).lm_loss is linear_cross_entropy
                model = tiny(cpu_engines=True, tie_word_embeddings=tied).train()
                # attention projections x 4 per layer and the LM head; each layer's decode attention
                want = ("engines: linear_cross_entropy x1, explicit_attention at decode x2"
                        + (", OneDNNLinear x9" if onednn else ""))
                assert describe(model) == want, describe(model)
                assert sum(type(m) is OneDNNLinear for m in model.modules()) == (2 * 4 + 1 if onednn else 0)
                assert model.chunked_lm_loss is linear_cross_entropy
            if engines != "plain":
                after = model.state_dict()
                assert list(after) == list(before) and all(
                    torch.equal(after[k], before[k]) for k in before), f"{engines}: other weights than the plain model's"
                if tied:
                    assert model.lm_head.weight is model.model.embed_tokens.weight
            out = model(ids, labels=labels)
            out.loss.backward()
            outs[engines] = (out, {n: p.grad for n, p in model.named_parameters()})
        want, want_grads = outs["plain"]
        assert want.logits.shape == (3, 17, 97)
        for engines in ("loss only", "engines_for"):
            got, grads = outs[engines]
            assert got.logits is None and abs(got.ce_loss.item() - want.ce_loss.item()) < 1e-5 * want.ce_loss.item()
            assert torch.allclose(got.loss, got.ce_loss + got.aux_loss)
            assert grads.keys() == want_grads.keys()
            for name, g in grads.items():
                rel = ((g - want_grads[name]).abs().max() / want_grads[name].abs().max()).item()
                assert rel < 1e-5, f"tied={tied} {engines} {name}: {rel:.2e}"
    assert tiny(cpu_engines=True)(ids).logits.shape == (3, 17, 97)
    assert tiny()(ids).logits.shape == (3, 17, 97)


def test_tied_and_untied_embeddings():
    m = tiny()
    assert m.lm_head.weight is m.model.embed_tokens.weight
    m = tiny(tie_word_embeddings=False)
    assert m.lm_head.weight is not m.model.embed_tokens.weight
    sd = tiny().state_dict()
    m2 = tiny()
    m2.load_state_dict(sd, strict=True)
    assert m2.lm_head.weight is m2.model.embed_tokens.weight


def test_causal():
    """Changing a later token never changes earlier logits."""
    model = tiny().eval()
    ids = torch.randint(0, 97, (1, 12))
    ids2 = ids.clone()
    ids2[0, 8] = (ids[0, 8] + 1) % 97
    a, b = model(ids).logits, model(ids2).logits
    assert torch.allclose(a[:, :8], b[:, :8], atol=1e-6) and not torch.allclose(a[:, 8:], b[:, 8:])


def test_kv_cache_matches_full_forward():
    """Prefill + chunked continuation with the cache equals one forward over the whole sequence (the plain
    model and the one built with the trainer's CPU engines)."""
    for cpu_engines in (False, True):
        model = tiny(cpu_engines=cpu_engines, use_moe=True).eval()
        ids = torch.randint(0, 97, (2, 20))
        full = model(ids).logits
        out1 = model(ids[:, :7], use_cache=True)
        out2 = model(ids[:, 7:12], past_key_values=out1.past_key_values, use_cache=True)
        out3 = model(ids[:, 12:13], past_key_values=out2.past_key_values, use_cache=True)
        got = torch.cat([out1.logits, out2.logits, out3.logits], dim=1)
        # Different query-block shapes change the GEMM/attention blocking: equal up to fp32 rounding.
        assert torch.allclose(got, full[:, :13], atol=2e-5, rtol=1e-4), (cpu_engines, (got - full[:, :13]).abs().max())
    # under autograd too (each layer reads a copy of the cache, written in place after it), fp64: the same gradients
    model = tiny(use_moe=True).double().eval()
    ids = torch.randint(0, 97, (2, 9))
    grads = []
    for chunks in ((9,), (4, 5)):
        model.zero_grad()
        cache, logits = None, []
        for n in chunks:
            start = cache.length if cache is not None else 0
            out = model(ids[:, start:start + n], past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, logits + [out.logits]
        (torch.cat(logits, dim=1) ** 2).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert all(torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip(*grads)), "cached forward: other gradients"
    for bad, error in (([(torch.zeros(1), torch.zeros(1))], TypeError), (cache, ValueError)):
        try:  # an old-style list; a cache of batch 2 given batch 3
            model(ids[:1].repeat(3, 1)[:, :1], past_key_values=bad, use_cache=True)
        except error as e:
            assert "past_key_values" in str(e) or "KVCache holds" in str(e), e
        else:
            raise AssertionError(f"{type(bad).__name__} past_key_values accepted")


def test_generate_cache_equals_no_cache():
    """Greedy ids with and without the KV cache are equal, seeded sampling repeats: dense and MoE, the plain
    model and the one built with the trainer's CPU engines (the end-of-run sample uses that one)."""
    for use_moe, cpu_engines in ((True, False), (False, False), (True, True), (False, True)):
        model = tiny(cpu_engines=cpu_engines, use_moe=use_moe).eval()
        prompt = torch.randint(0, 97, (2, 5))
        a = model.generate(prompt, max_new_tokens=24, temperature=0, use_cache=True)
        b = model.generate(prompt, max_new_tokens=24, temperature=0, use_cache=False)
        assert a.shape == (2, 29) and torch.equal(a, b), "greedy ids differ with/without the KV cache"
        g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        s1 = model.generate(prompt, 10, temperature=1.0, top_k=5, top_p=0.9, generator=g1)
        s2 = model.generate(prompt, 10, temperature=1.0, top_k=5, top_p=0.9, generator=g2)
        assert torch.equal(s1, s2), "seeded sampling is not reproducible"


def test_sampling_filters_match_a_plain_reference():
    """sample_next against the filters written out per row in plain Python (softmax at the temperature,
    the k most likely, then the smallest prefix of those whose mass reaches top_p, renormalised): at
    temperature 0 the argmax; else 20,000 draws per case land only on the kept tokens, at the reference's
    probabilities within 0.02 (about 6 standard errors of a frequency)."""
    from model.model_minimind import sample_next
    logits_BV = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0],
                              [0.1, 3.0, -1.0, 2.2, 0.3, 2.9, -2.0, 1.1]])
    assert sample_next(logits_BV, temperature=0).tolist() == [0, 1]
    draws = 20_000
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.7, 3, 1.0), (1.0, 0, 0.6), (1.3, 5, 0.8), (1.0, 8, 0.99)):
        generator = torch.Generator().manual_seed(0)
        picked = sample_next(logits_BV.repeat_interleave(draws, 0), temperature, top_k, top_p, generator)
        for row, logits in enumerate(logits_BV.tolist()):
            weights = [math.exp(v / temperature) for v in logits]
            order = sorted(range(len(logits)), key=lambda i: -logits[i])[:top_k or len(logits)]
            total = sum(weights[i] for i in order)
            kept, mass = [], 0.0
            for i in order:
                if mass >= top_p:
                    break
                kept.append(i)
                mass += weights[i] / total
            want = {i: weights[i] / sum(weights[j] for j in kept) for i in kept}
            counts = torch.bincount(picked[row * draws:(row + 1) * draws], minlength=len(logits)).tolist()
            case = (temperature, top_k, top_p, row)
            assert all(counts[i] == 0 for i in range(len(logits)) if i not in want), (case, counts, want)
            assert all(abs(counts[i] / draws - p) < 0.02 for i, p in want.items()), (case, counts, want)


def test_generate_stops_at_eos_and_max_len():
    model = tiny().eval()
    prompt = torch.randint(0, 97, (1, 3))
    first = model.generate(prompt, 1, temperature=0)[0, -1].item()
    out = model.generate(prompt, 20, temperature=0, eos_token_id=first)
    assert out.shape[1] == 4, "generation did not stop at eos"
    out = tiny(max_position_embeddings=10).eval().generate(prompt, 50, temperature=0)
    assert out.shape[1] == 10, "generation ran past max_position_embeddings"
    try:
        tiny(max_position_embeddings=10)(torch.zeros(1, 11, dtype=torch.long))
    except ValueError as e:
        assert "max_position_embeddings" in str(e)
    else:
        raise AssertionError("an over-long input was accepted")


def test_generate_at_the_edges():
    """The preallocated KV cache at its limits (the trainer's CPU engines: the decode-step paths): a prompt one
    short of max_position_embeddings gets exactly one token, as without the cache; 64 left-padded prompts with
    an end-of-text id stop row by row: each row equals that prompt generated alone up to its first end-of-text,
    then repeats it, and the batch ends once every row has one; the cache is written in place (one buffer per
    generate, no reallocation)."""
    from model.model_minimind import KVCache, left_pad
    model = tiny(cpu_engines=True, max_position_embeddings=24).eval()
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 97, (1, 23), generator=g)
    cached, uncached = (model.generate(prompt, 5, temperature=0, use_cache=c) for c in (True, False))
    assert cached.shape == (1, 24) and torch.equal(cached, uncached), (cached.shape, uncached.shape)
    model = tiny(cpu_engines=True).eval()
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in torch.randint(1, 9, (64,), generator=g)]
    alone = [model.generate(torch.tensor([p]), 12, temperature=0)[0, len(p):] for p in prompts]
    eos = int(torch.cat(alone).bincount().argmax())  # the id most rows produce
    ids, mask = left_pad(prompts)
    reserved = []
    original = KVCache._reserve
    with mock.patch.object(KVCache, "_reserve", lambda self, *a: reserved.append(a[1]) or original(self, *a)):
        out = model.generate(ids, 12, temperature=0, attention_mask=mask, eos_token_id=eos)
    assert reserved == [ids.shape[1] + 12], f"the cache was allocated {len(reserved)} times: {reserved}"
    new = out[:, ids.shape[1]:]
    for b, row in enumerate(new):
        stop = (alone[b] == eos).nonzero()
        n = int(stop[0]) + 1 if len(stop) else len(alone[b])
        assert torch.equal(row[:n], alone[b][:n]) and (row[n:] == eos).all(), f"row {b}: {row} vs {alone[b]}"
    assert (new == eos).any(dim=1).all() or new.shape[1] == 12, "stopped before every row ended"


def test_overfit_one_batch():
    """The whole model can learn: 60 Adam steps on one batch drive the loss far down (with the engines the
    trainer builds with on CPU fp32: the chunked LM loss and OneDNNLinear)."""
    model = tiny(cpu_engines=True).train()
    ids = torch.randint(0, 97, (4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(60):
        out = model(ids[:, :-1], labels=ids[:, 1:])
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        first = first or out.ce_loss.item()
    assert out.ce_loss.item() < 0.3 * first, f"{first:.3f} -> {out.ce_loss.item():.3f}"


def _padded(prompts, side):
    """Prompts (lists of ids) -> ids, attention_mask with the padding on `side` ("left" or "right")."""
    from model.model_minimind import left_pad
    ids, mask = left_pad(prompts, pad_id=5)
    if side == "right":
        ids, mask = torch.zeros_like(ids), torch.zeros_like(mask)
        for b, p in enumerate(prompts):
            ids[b, :len(p)], mask[b, :len(p)] = torch.tensor(p), 1
    return ids, mask


def test_attention_mask_hides_left_and_right_padding():
    """A padded batch: every real token's logits equal those of its sequence alone (1e-5), whichever side
    the padding is on, for the dense model and both MoE paths, the fused one also built with the trainer's
    CPU engines (train.engines: GroupedExperts, KernelRowMapDispatcher) (positions count real tokens only)."""
    for kw in (dict(use_moe=False), dict(moe_impl="sorted"), dict(moe_impl="fused"), dict(moe_impl="fused", cpu_engines=True)):
        model = tiny(**kw).eval()
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (3, 11, 7, 1)]
        alone = [model(torch.tensor([p])).logits[0] for p in prompts]
        for side in ("left", "right"):
            ids, mask = _padded(prompts, side)
            with torch.no_grad():
                out = model(ids, attention_mask=mask).logits
            for b, p in enumerate(prompts):
                real = out[b][mask[b].bool()]
                diff = (real - alone[b]).abs().max().item()
                assert diff <= 1e-5, f"{kw} {side} padding, prompt {b}: max |logit diff| {diff:.2e}"


def test_batched_generation_of_different_lengths():
    """Left-padded prompts of lengths 2..9 generated in one batch: greedy ids equal generating each alone,
    with and without the KV cache; the padding stays in front of each row (the fused MoE path also built
    with the trainer's CPU engines)."""
    from model.model_minimind import left_pad
    for kw in (dict(use_moe=False), dict(moe_impl="sorted"), dict(moe_impl="fused"), dict(moe_impl="fused", cpu_engines=True)):
        model = tiny(**kw).eval()
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (2, 9, 5)]
        ids, mask = left_pad(prompts, pad_id=0)
        cached = model.generate(ids, 16, temperature=0, attention_mask=mask)
        uncached = model.generate(ids, 16, temperature=0, attention_mask=mask, use_cache=False)
        assert torch.equal(cached, uncached), f"{kw}: KV cache vs no cache differ on a padded batch"
        for b, p in enumerate(prompts):
            alone = model.generate(torch.tensor([p]), 16, temperature=0)[0]
            assert torch.equal(cached[b, ids.shape[1] - len(p):], alone), f"{kw}: prompt {b} differs from alone"
            assert torch.equal(cached[b, :ids.shape[1] - len(p)], ids[b, :ids.shape[1] - len(p)])
    for bad in ([], [[1, 2], []]):
        try:
            left_pad(bad)
        except ValueError:
            continue
        raise AssertionError(f"left_pad accepted {bad}")


def test_empty_inputs_refused_or_kept_in_the_graph():
    """model(ids) with no sequence or no token: a ValueError naming the shape; an MoE layer given no token
    (eval or train) returns an empty tensor still attached to its input's graph."""
    model = tiny().eval()
    for shape in ((0, 5), (2, 0)):
        try:
            model(torch.zeros(shape, dtype=torch.long))
        except ValueError as e:
            assert "empty" in str(e) and str(shape) in str(e), e
        else:
            raise AssertionError(f"input_ids of shape {shape} accepted")
    layer = model.model.layers[0].mlp
    for training in (False, True):
        layer.train(training)
        x = torch.randn(0, 4, 64, requires_grad=True)
        y = layer(x)
        assert y.shape == x.shape and y.requires_grad, (training, y.shape, y.requires_grad)


TESTS = [test_config_errors_name_the_field, test_sampling_filters_match_a_plain_reference, test_config_defaults_and_roundtrip,
         test_readme_states_the_main_jobs_parameter_counts, test_checkpoint_roundtrip,
         test_no_expert_weight_copy_per_forward, test_checkpoint_layout,
         test_experts_load_and_pickle_edge_cases,
         test_forward_loss_and_aux, test_chunked_lm_loss_is_the_torch_loss, test_tied_and_untied_embeddings, test_causal, test_kv_cache_matches_full_forward,
         test_generate_cache_equals_no_cache, test_generate_stops_at_eos_and_max_len, test_generate_at_the_edges, test_overfit_one_batch,
         test_attention_mask_hides_left_and_right_padding, test_batched_generation_of_different_lengths,
         test_empty_inputs_refused_or_kept_in_the_graph]

if __name__ == "__main__":
    run(TESTS)
