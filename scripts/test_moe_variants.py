"""Shared experts, the routed scaling factor and sparse upcycling, against plain references.

    python scripts/test_moe_variants.py

Shared experts (config n_shared_experts / shared_expert_intermediate_size): the layer's output is the routed
layer's plus a plain FeedForward of the same weights, bitwise on the sorted and masked paths (the same ops
in the same order; x's gradient within 1e-6: autograd sums its three branches in its own order) and
within 1e-6 on the fused path, plain and built with train.engines.engines_for's CPU engines (the shared
FFN's GEMMs run on oneDNN there, and its sum with the routed output rounds once more); under EP on 2 ranks
training equals one process. routed_scaling_factor s: the layer equals the unscaled layer with every
expert's down projection times s (within 1e-6: one product rounds in another place), sorted == masked stays
bitwise. Upcycling (`--upcycle_from`, MOEFeedForward.upcycle_from): at step 0 the
upcycled model's logits equal the dense model's (fp32, within 1e-5: the slices of the dense FFN's GEMMs are
summed in another order), every expert is chosen by some token, and training continues from there.
"""
import copy
import os

import torch

import testlib
from testlib import run, spawn_ranks  # noqa: F401
from kernels.cpu_linear import OneDNNLinear, onednn_runs
from train.engines import engines_for
from testlib import rebuilt
from kernels.experts import cpu_experts_rows_in_place
from model.hf_adapter import ExportError, check_exportable
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM, MOEFeedForward
from model.moe import FeedForward
from moe_reference import masked_layer_forward

_TMP = testlib.scratch_dir("test_moe_variants_")
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=300)


def _layer(impl, **kw):
    """The layer of moe_impl `impl` ("fused+engines": "fused" built with the trainer's CPU fp32 engines;
    "masked": a sorted layer, for `_fwd_bwd` to run through scripts/moe_reference.py's masked loop)."""
    torch.manual_seed(0)
    impl = "sorted" if impl == "masked" else impl
    cfg = MiniMindConfig(**TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                         moe_impl=impl.split("+")[0], n_shared_experts=1, shared_expert_intermediate_size=48, **kw)
    layer = MOEFeedForward(cfg)
    return rebuilt(layer, engines_for(cfg, "cpu", torch.float32)) if impl.endswith("+engines") else layer


def _fwd_bwd(layer, x, dy, impl=None):
    """y, x's gradient and the parameters' gradients of `layer` (impl "masked": run by the masked loop)."""
    x = x.clone().requires_grad_(True)
    y = masked_layer_forward(layer, x) if impl == "masked" else layer(x)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


def test_shared_expert_is_the_routed_layer_plus_a_plain_ffn():
    """y(layer with a shared expert) == y(the same layer without it) + FeedForward(x) with its weights, forward and
    backward, on every path: bitwise for sorted / masked (but x's gradient), within 1e-6 for fused (plain and
    with the trainer's CPU engines) and for x's gradient."""
    x, dy = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
    for impl in ("sorted", "masked", "fused", "fused+engines"):
        layer = _layer(impl).train()
        if impl.endswith("engines"):  # the CPU expert GEMMs, and OneDNNLinear in the shared FFN, only where oneDNN runs
            assert layer.experts.engine is engines_for(layer.config, "cpu", torch.float32).experts, layer
            assert (layer.experts.engine is cpu_experts_rows_in_place) == onednn_runs("cpu", torch.float32), layer
            onednn = {n for n, m in layer.named_modules() if type(m) is OneDNNLinear}
            assert onednn == ({f"shared_experts.{p}_proj" for p in ("gate", "up", "down")}
                              if onednn_runs("cpu", torch.float32) else set()), onednn
        ffn = FeedForward(64, 48)
        ffn.load_state_dict(layer.shared_experts.state_dict())
        routed = copy.deepcopy(layer)
        routed.shared_experts = None
        y, gx, grads = _fwd_bwd(layer, x, dy, impl)
        y_r, gx_r, grads_r = _fwd_bwd(routed, x, dy, impl)
        y_f, gx_f, grads_f = _fwd_bwd(ffn, x, dy)
        exact = impl in ("sorted", "masked")
        same = (lambda a, b: torch.equal(a, b)) if exact else (lambda a, b: (a - b).abs().max().item() < 1e-6)
        assert same(y, y_r + y_f), impl
        # (x's gradient sums three branches, router / experts / shared, in autograd's order: not bitwise)
        assert (gx - (gx_r + gx_f)).abs().max() < 1e-6, impl
        for n, g in grads_f.items():
            assert same(grads[f"shared_experts.{n}"], g), (impl, n)
        for n, g in grads_r.items():
            assert torch.equal(grads[n], g) if exact else (grads[n] - g).abs().max() < 1e-6, (impl, n)
    keys = set(_layer("sorted").state_dict())
    assert {k for k in keys if k.startswith("shared_experts.")} == {f"shared_experts.{p}_proj.weight" for p in
                                                                    ("gate", "up", "down")}


def test_shared_expert_config_checks_and_export_refusal():
    cfg = MiniMindConfig(**TINY, n_shared_experts=2, moe_intermediate_size=32)
    assert cfg.shared_expert_intermediate_size == 64  # n_shared_experts x moe_intermediate_size
    for kw, word in ((dict(n_shared_experts=-1), "n_shared_experts"), (dict(shared_expert_intermediate_size=8),
                                                                       "needs n_shared_experts"),
                     (dict(use_moe=False, n_shared_experts=1), "needs use_moe")):
        try:
            MiniMindConfig(**TINY, **kw)
        except ValueError as e:
            assert word in str(e), e
        else:
            raise AssertionError(f"{kw} accepted")
    try:  # Qwen3-MoE has no shared expert (Qwen2-MoE's is gated by a sigmoid: another function)
        check_exportable(cfg)
    except ExportError as e:
        assert "n_shared_experts" in str(e), e
    else:
        raise AssertionError("a shared expert was exported")


def test_routed_scaling_factor_is_the_down_projections_times_s():
    """s = 2.5: y and x's gradient equal the unscaled layer's with each expert's down projection times s
    (every path, within 1e-6); sorted == masked bitwise; a bad s is refused. (Export: scripts/test_export.py.)"""
    x, dy = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
    outs = {}
    for impl in ("sorted", "masked", "fused", "fused+engines"):
        scaled, plain = _layer(impl, routed_scaling_factor=2.5).train(), _layer(impl).train()
        with torch.no_grad():
            plain.experts.down_proj.mul_(2.5)  # every expert's down projection (stacked [E, D, F])
        (y, gx, _), (y_p, gx_p, _) = _fwd_bwd(scaled, x, dy, impl), _fwd_bwd(plain, x, dy, impl)
        assert (y - y_p).abs().max() < 1e-6 and (gx - gx_p).abs().max() < 1e-6, impl
        outs[impl] = y, gx
    assert torch.equal(outs["sorted"][0], outs["masked"][0]) and torch.equal(outs["sorted"][1], outs["masked"][1])
    for bad in (0.0, -1.0, float("nan")):
        try:
            MiniMindConfig(**TINY, routed_scaling_factor=bad)
        except ValueError as e:
            assert "routed_scaling_factor" in str(e), e
        else:
            raise AssertionError(f"routed_scaling_factor={bad} accepted")


def _ep_worker(rank, world, argv):
    from train.pretrain import parse_args, train
    return train(parse_args(argv), log=lambda *_: None)["final_val_loss"]


CLI = ["--hidden_size", "64", "--num_hidden_layers", "2", "--num_attention_heads", "4", "--num_key_value_heads", "2",
       "--moe_intermediate_size", "32", "--seq_len", "32", "--vocab_size", "300", "--eval_tokens", "1024",
       "--warmup_steps", "2", "--no_progress", "--sample_tokens", "0", "--dtype", "float32", "--save_interval", "100",
       "--router_aux_loss_coef", "0", "--eval_interval", "1000"]


def _data():
    from data.corpus import default_corpus
    return default_corpus()["train"]


def test_shared_experts_train_under_ep_like_one_process():
    """2 ranks x EP=2 (4 sequences each) against one process (8), fused, shared expert on: the final validation
    losses agree within 1e-5 relative (fp32 reassociation of the partial sums)."""
    common = CLI + ["--data_path", _data(), "--num_experts", "4", "--n_shared_experts", "1", "--max_steps", "8"]
    ep = spawn_ranks(_ep_worker, 2, common + ["--batch_size", "4", "--ep_size", "2", "--out_dir",
                                              os.path.join(_TMP, "ep")], init_group=False)
    one = _ep_worker(0, 1, common + ["--batch_size", "8", "--out_dir", os.path.join(_TMP, "one")])
    assert ep[0] == ep[1] and abs(ep[0] - one) / one < 1e-5, (ep, one)


def test_upcycled_model_computes_the_dense_model_at_step_0():
    """Fine-grained upcycling (dense F=128 into E=8 top-2 experts of F=64, and into E=16 top-4 of F=32, with and
    without a shared expert, with and without a routed scaling factor) and the classic copy (F=128, E=4 top-2): logits equal the dense model's within
    1e-5, and every expert is the top choice of some token."""
    from train.init_weights import upcycle
    torch.manual_seed(0)
    dense = MiniMindForCausalLM(MiniMindConfig(**TINY, use_moe=False, intermediate_size=128)).eval()
    ids = torch.randint(0, 300, (4, 64))
    ref = dense(ids).logits
    for E, k, F, shared, s in ((8, 2, 64, 0, 1.0), (16, 4, 32, 0, 1.0), (8, 2, 64, 1, 1.0), (4, 2, 128, 0, 1.0),
                               (8, 2, 64, 0, 2.0), (16, 4, 32, 0, 4.0)):
        moe = MiniMindForCausalLM(MiniMindConfig(**TINY, intermediate_size=128, num_experts=E, num_experts_per_tok=k,
                                                 moe_intermediate_size=F, n_shared_experts=shared,
                                                 routed_scaling_factor=s)).eval()
        upcycle(moe, dense, seed=1)
        diff = (moe(ids).logits - ref).abs().max().item()
        assert diff < 1e-5, (E, k, F, shared, s, diff)
        h = dense.model.embed_tokens(ids).reshape(-1, 64)
        chosen = torch.topk(moe.model.layers[0].mlp.gate(h), k, dim=-1).indices.unique()
        assert len(chosen) == E, (E, chosen.tolist())
    for kw, message in ((dict(num_experts=4, moe_intermediate_size=48), "--moe_intermediate_size 48 must divide"),
                        (dict(num_experts=4, num_experts_per_tok=1, moe_intermediate_size=64),
                         "--num_experts_per_tok 1 must be a multiple of the 2 slices")):
        try:  # (k = 1 of 2 slices: top-1 takes half a copy, so step 0 would not compute the dense model)
            upcycle(MiniMindForCausalLM(MiniMindConfig(**TINY, intermediate_size=128, **kw)), dense)
        except ValueError as e:
            assert message in str(e), e
        else:
            raise AssertionError(f"{kw} upcycled")


def test_upcycle_from_trains_on():
    """--upcycle_from a dense run: the first logged validation loss is the dense run's last (step 0 computes the
    dense model), training goes on and resumes; an MoE source is refused with one line."""
    from train.checkpoint import load_checkpoint
    from train.pretrain import parse_args, train
    common = CLI + ["--data_path", _data(), "--batch_size", "4", "--eval_interval", "4"]
    dense_dir, moe_dir = os.path.join(_TMP, "dense"), os.path.join(_TMP, "upcycled")
    d = train(parse_args(common + ["--use_moe", "0", "--intermediate_size", "64", "--max_steps", "8",
                                   "--out_dir", dense_dir]), log=lambda *_: None)
    m = train(parse_args(common + ["--upcycle_from", dense_dir, "--num_experts", "4", "--num_experts_per_tok", "2",
                                   "--moe_intermediate_size", "32", "--max_steps", "8", "--stop_after", "4",
                                   "--out_dir", moe_dir]), log=lambda *_: None)
    assert abs(m["first_val_loss"] - d["final_val_loss"]) < 1e-4, (m["first_val_loss"], d["final_val_loss"])
    train(parse_args(["--resume", "--out_dir", moe_dir, "--no_progress"]), log=lambda *_: None)
    ckpt = load_checkpoint(moe_dir)
    assert ckpt["config"]["use_moe"] and ckpt["config"]["num_experts"] == 4 and ckpt["step"] == 8
    try:
        train(parse_args(common + ["--upcycle_from", moe_dir, "--max_steps", "1", "--out_dir",
                                   os.path.join(_TMP, "again")]), log=lambda *_: None)
    except ValueError as e:
        assert "an MoE model already" in str(e), e
    else:
        raise AssertionError("an MoE was upcycled")


TESTS = [test_shared_expert_is_the_routed_layer_plus_a_plain_ffn, test_shared_expert_config_checks_and_export_refusal,
         test_routed_scaling_factor_is_the_down_projections_times_s,
         test_shared_experts_train_under_ep_like_one_process, test_upcycled_model_computes_the_dense_model_at_step_0,
         test_upcycle_from_trains_on]

if __name__ == "__main__":
    run(TESTS)
