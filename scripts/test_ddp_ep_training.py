"""Multi-process training (DDP + expert parallelism) on 2 and 4 gloo processes, against one process.

    python scripts/test_ddp_ep_training.py
"""
import json
import os

import torch

import testlib
from testlib import ROOT, SHARED, Skip, run, spawn_ranks  # noqa: F401

_TMP = testlib.scratch_dir("test_ddp_ep_")
TINY = ["--hidden_size", "64", "--num_hidden_layers", "2", "--num_attention_heads", "4", "--num_key_value_heads", "2",
        "--num_experts", "4", "--num_experts_per_tok", "2", "--moe_intermediate_size", "64", "--seq_len", "32",
        "--vocab_size", "512", "--eval_tokens", "1024", "--warmup_steps", "3", "--log_interval", "1",
        "--eval_interval", "1000", "--no_progress", "--sample_tokens", "0", "--learning_rate", "3e-3"]


def data_file():
    path = os.path.join(SHARED, "data", "tinyshakespeare.txt")
    if os.path.exists(path):
        return path
    from data.corpus import default_corpus
    return default_corpus()["train"]


def _train_rank(rank, world, argvs):
    """train/pretrain.py's command line (its parse_args, then train.loop.run_cli) on this rank: {"ok": True}, or the exit code
    and what it wrote to stderr (a refusal: the one "error:" line, or a peer's note)."""
    import contextlib
    import io
    from train.loop import run_cli
    from train.pretrain import STAGE, parse_args
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            run_cli(STAGE, parse_args(argvs[rank]), log=lambda *_: None)
        return {"ok": True}
    except SystemExit as e:
        return {"ok": False, "error": err.getvalue(), "exit": e.code}


def launch(world, argv, per_rank=None):
    """Run train() on `world` gloo ranks (like torchrun); per_rank(r) may add flags for rank r."""
    argvs = [argv + (per_rank(r) if per_rank else []) for r in range(world)]
    return spawn_ranks(_train_rank, world, argvs, init_group=False)


def single(argv):
    from train.pretrain import parse_args, train
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(parse_args(argv), log=lambda *_: None)
    finally:
        torch.set_num_threads(threads)


def losses(run_dir):
    return {r["step"]: r["train_loss"] for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl")))
            if "train_loss" in r}


def test_ddp_ep_matches_single_process():
    """20 steps on 2 ranks (DDP x EP=2, 4 seqs each) vs one process (8 seqs): same data, losses agree, on the
    sorted and the fused path.

    Without the aux loss the only difference is reassociated fp32 sums (per-rank partial GEMMs for the
    router/dense grads, DDP's average): tight bound. With it, each rank's aux loss is a nonlinear function
    of its own routing statistics, not the global batch's (as in MiniMind and most DDP MoE code), which
    changes the gradients slightly every step and compounds over 20 steps: looser bound."""
    for impl, coef, bound in (("sorted", "0", 1e-6), ("fused", "0", 1e-6), ("sorted", "0.01", 5e-3)):
        common = TINY + ["--data_path", data_file(), "--max_steps", "20", "--save_interval", "20",
                         "--router_aux_loss_coef", coef, "--dtype", "float32", "--moe_impl", impl]
        ep_dir, one_dir = os.path.join(_TMP, f"ep2_{impl}_{coef}"), os.path.join(_TMP, f"one_{impl}_{coef}")
        assert all(r["ok"] for r in launch(2, common + ["--batch_size", "4", "--ep_size", "2", "--out_dir", ep_dir]))
        single(common + ["--batch_size", "8", "--out_dir", one_dir])
        a, b = losses(ep_dir), losses(one_dir)
        assert sorted(a) == sorted(b) == list(range(1, 21))
        worst = max(abs(a[s] - b[s]) / b[s] for s in a)
        print(f"        {impl}, aux coef {coef}: max relative loss difference over 20 steps: {worst:.1e}")
        assert worst < bound, f"{impl}, aux coef {coef}: loss curves differ by up to {worst:.2e} relative (> {bound})"


def test_fused_ep_runs_where_a_rank_gets_no_token():
    """Fused + EP runs that aborted in gloo ("Received data size doesn't match") once a rank's experts got no
    token: batch 1 x 8 at a high LR without aux loss, 4 x 32 with --grad_accum 2, and a one-process (fused)
    checkpoint resumed with --ep_size 2. Every rank runs the same collectives whatever it receives."""
    base = TINY + ["--data_path", data_file(), "--ep_size", "2", "--moe_impl", "fused", "--save_interval", "1000"]
    for name, extra in (("starved", ["--batch_size", "1", "--seq_len", "8", "--router_aux_loss_coef", "0",
                                     "--learning_rate", "3e-2", "--max_steps", "20"]),
                        ("accum", ["--batch_size", "4", "--grad_accum", "2", "--max_steps", "12"])):
        out = os.path.join(_TMP, f"fused_{name}")
        results = launch(2, base + extra + ["--out_dir", out])
        assert all(r["ok"] for r in results), (name, results)
        assert max(losses(out)) == int(extra[extra.index("--max_steps") + 1]), name
    one = os.path.join(_TMP, "fused_one")
    single(TINY + ["--data_path", data_file(), "--batch_size", "8", "--max_steps", "12", "--stop_after", "6",
                   "--out_dir", one])
    results = launch(2, ["--resume", "--out_dir", one, "--ep_size", "2", "--batch_size", "4", "--no_progress"])
    assert all(r["ok"] for r in results), results
    from train.checkpoint import load_checkpoint
    assert max(losses(one)) == 12 and load_checkpoint(one)["args"]["moe_impl"] == "fused"


def dense_state_worker(rank, world, argv):
    """Train, then return the non-expert parameters as this rank sees them (at its last checkpoint)."""
    import train.loop as loop
    from torch.distributed.tensor import DTensor
    from train.pretrain import parse_args, train
    captured = {}
    original = loop.save

    def capture_then_save(run, state, plots=True):
        captured["dense"] = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                             for n, p in run.model.named_parameters() if ".experts." not in n}
        return original(run, state, plots)
    loop.save = capture_then_save
    train(parse_args(argv), log=lambda *_: None)
    return captured["dense"]


def test_dense_weights_identical_across_ranks():
    """4 ranks (EP 2 x 2 replicas, --grad_accum 2), 8 steps: every non-expert parameter bitwise the same on
    every rank at the last checkpoint (a missed or partial gradient reduction shows from the first step)."""
    argv = TINY + ["--data_path", data_file(), "--max_steps", "8", "--save_interval", "8", "--batch_size", "2",
                   "--ep_size", "2", "--grad_accum", "2", "--out_dir", os.path.join(_TMP, "dense4")]
    states = spawn_ranks(dense_state_worker, 4, argv, init_group=False)
    for r in range(1, 4):
        for n, v in states[0].items():
            assert torch.equal(v, states[r][n]), f"{n} differs between rank 0 and rank {r}"


def first_step_grads(argv):
    """Train one step with `argv` on this rank; return every parameter's whole gradient as the optimizer gets
    it (after the ranks' reductions and clipping; FSDP's shards and EP's experts gathered), by name."""
    import train.loop as loop
    from torch.distributed.tensor import DTensor
    from train.pretrain import parse_args, train
    grads, make_optimizer = {}, loop.make_optimizer

    def capturing(model, args):
        optimizer = make_optimizer(model, args)
        step = optimizer.step

        def capture_then_step(*a, **kw):
            for name, p in model.named_parameters():  # (the same order on every rank: full_tensor pairs up)
                grads[name] = (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            return step(*a, **kw)
        optimizer.step = capture_then_step
        return optimizer
    loop.make_optimizer = capturing
    try:
        train(parse_args(argv), log=lambda *_: None)
    finally:
        loop.make_optimizer = make_optimizer
    return grads


def first_step_grads_worker(rank, world, argv):
    return first_step_grads(argv)


def test_every_gradient_matches_one_process():
    """The field's silent EP bug (a path that trains while some gradients are lost or wrong: transformers PR
    48205, issue 48687): after one step on 4 ranks with --ep_size 2, and with --ep_size 2 --fsdp, the gradient
    of every parameter (embeddings, attention, norms, router, experts) equals one process's on the same global
    batch, the router's checked on its own. Not bitwise: the ranks' partial sums are added in another order
    than one process's GEMMs (fp32 reassociation), so within 2e-6 of each tensor's largest entry (train/README.md's
    bound). Measured on a 2-core Intel Xeon (AMX), 1 thread per rank: 8.5e-7 with --ep_size 2, 1.1e-6 with --fsdp
    (both attention's v_proj; the router 4.4e-7 / 7.7e-7): 2e-6 leaves a 1.8x margin for other CPUs' GEMM orders
    and catches an error of a few 1e-6 (one rank's loss share weighted 1e-5 more: 6.1e-6), which 1e-5 let by."""
    common = TINY + ["--data_path", data_file(), "--max_steps", "1", "--save_interval", "1000",
                     "--router_aux_loss_coef", "0", "--dtype", "float32", "--moe_impl", "fused"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = first_step_grads(common + ["--batch_size", "8", "--out_dir", os.path.join(_TMP, "grads_one")])
    finally:
        torch.set_num_threads(threads)
    for extra in ([], ["--fsdp"]):
        argv = common + ["--batch_size", "2", "--ep_size", "2", "--out_dir", os.path.join(_TMP, f"grads_ep{extra}")]
        ranks = spawn_ranks(first_step_grads_worker, 4, argv + extra, init_group=False)
        worst = {}
        for name, want in one.items():
            got = ranks[0][name]
            assert got.shape == want.shape, (extra, name, got.shape, want.shape)
            for r, rank in enumerate(ranks[1:], 1):  # every rank sees the same reduced gradient
                assert torch.equal(rank[name], got), (extra, name, r)
            worst[name] = float((got - want).abs().max() / want.abs().max())
        router = max(v for n, v in worst.items() if n.endswith("mlp.gate.weight"))
        name = max(worst, key=worst.get)
        print(f"        ep 2{' --fsdp' if extra else ''}: {len(worst)} parameters, worst {name} {worst[name]:.1e} "
              f"of its largest entry; router {router:.1e}")
        assert worst[name] < 2e-6 and router < 2e-6, (extra, name, worst[name], router)


def bias_update_worker(rank, world, argv):
    """Train with `argv` (one step) on this rank; return, per MoE layer, the router load this rank counted
    (its own tokens, before the ranks' all-reduce), expert_bias before and after the router's update."""
    import train.loop as loop
    from model.moe import MOEFeedForward
    from train.parallel import moe_layers
    from train.pretrain import parse_args, train
    seen, router_step, pop_load = {}, loop.router_step, MOEFeedForward.pop_load

    def recording_pop_load(self):
        load = pop_load(self)
        seen.setdefault("local", []).append(load.clone())
        return load

    def recording_router_step(model, distributed):
        seen["before"] = [m.expert_bias.clone() for m in moe_layers(model)]
        MOEFeedForward.pop_load = recording_pop_load
        try:
            return router_step(model, distributed)
        finally:
            MOEFeedForward.pop_load = pop_load
            seen["after"] = [m.expert_bias.clone() for m in moe_layers(model)]
    loop.router_step = recording_router_step
    train(parse_args(argv), log=lambda *_: None)
    return seen


def test_router_bias_update_counts_every_ranks_tokens():
    """The aux-loss-free router bias (--router_bias_update_rate > 0) moves by the load of the global batch: after a
    step on 2 ranks fed different rows (DDP, and EP 2), every rank's expert_bias of every layer equals the update
    the docstring of model/router.py's expert_bias_update states, bias += rate * sign(mean(load) - load), computed
    here from the sum of the ranks' own counts (so the same on every rank), and differs from what a rank's own
    counts alone would give (the load is all-reduced before update_expert_bias)."""
    rate = 0.01
    argv = TINY + ["--data_path", data_file(), "--max_steps", "1", "--save_interval", "1000", "--dtype", "float32",
                   "--router_bias_update_rate", str(rate), "--batch_size", "4", "--num_experts", "8"]
    for ep in (1, 2):
        ranks = spawn_ranks(bias_update_worker, 2, argv + ["--ep_size", str(ep), "--out_dir",
                                                           os.path.join(_TMP, f"bias_ep{ep}")], init_group=False)
        layers = len(ranks[0]["after"])
        differs = [False, False]  # (per rank: its own counts would move some layer's bias otherwise)
        assert layers == 2 and all(len(r["local"]) == layers for r in ranks), [len(r["local"]) for r in ranks]
        for layer in range(layers):
            local = [r["local"][layer] for r in ranks]
            assert not torch.equal(local[0], local[1]), f"ep {ep}, layer {layer}: the ranks counted the same load"
            total = (local[0] + local[1]).double()
            for r, rank in enumerate(ranks):
                before = rank["before"][layer]
                want = before + rate * torch.sign(total.mean() - total).float()
                own = before + rate * torch.sign(local[r].double().mean() - local[r].double()).float()
                got = rank["after"][layer]
                assert torch.equal(got, want), (ep, layer, r, got, want, local)
                differs[r] = differs[r] or not torch.equal(own, want)
        assert all(differs), f"ep {ep}: a rank's own loads give the global bias update in every layer: {differs}"
        print(f"        ep {ep}: loads per rank {[r['local'][0].tolist() for r in ranks]} (layer 0), "
              f"bias / rate {[int(v) for v in (ranks[0]['after'][0] / rate).round().tolist()]}")


def test_time_budget_ranks_stop_together():
    """--time_budget_s 4 on 2 ranks (EP=2) logging every 200 steps: every step the ranks share their
    training clock (an async all-reduce read one step later), so they plan the same steps, use the same LR and
    stop at the same step, with identical dense weights: the plan's end, or within two steps of the budget
    being spent (not at the next log step)."""
    from train.checkpoint import load_checkpoint
    out = os.path.join(_TMP, "budget")
    argv = TINY + ["--data_path", data_file(), "--time_budget_s", "4", "--log_interval", "200", "--batch_size", "2",
                   "--ep_size", "2", "--out_dir", out]
    states = spawn_ranks(dense_state_worker, 2, argv, init_group=False)
    for n, v in states[0].items():
        assert torch.equal(v, states[1][n]), f"{n} differs between rank 0 and rank 1"
    ckpt = load_checkpoint(out)
    step, end, trained = ckpt["step"], ckpt["plan"]["end"], ckpt["train_time_s"]
    assert end < 10**12, ckpt["plan"]  # (planned from the measured speed)
    step_s = trained / step
    assert step == end or 4 <= trained <= 4 + 3 * step_s + 0.05, (step, end, trained, step_s)


def test_resume_across_ep_sizes():
    """A checkpoint written by 2 ranks with ep_size=2 resumes with ep_size=1 (1 process) and ep_size=4
    (4 processes) on the same global batch, giving the same next-step loss (within fp32 reassociation)."""
    src = os.path.join(_TMP, "ep_src")
    common = TINY + ["--data_path", data_file(), "--max_steps", "7", "--save_interval", "100"]
    assert all(r["ok"] for r in launch(2, common + ["--batch_size", "4", "--ep_size", "2", "--out_dir", src,
                                                     "--stop_after", "6"]))
    import shutil
    nxt = {}
    # "auto1": one process without --batch_size derives 8 per rank, keeping the 2 x 4 global batch
    for name, world, ep, bs in (("ep1", 1, 1, 8), ("auto1", 1, 1, None), ("ep4", 4, 4, 2), ("ep2", 2, 2, 4)):
        d = os.path.join(_TMP, f"resume_{name}")
        shutil.copytree(src, d)
        argv = ["--resume", "--out_dir", d, "--ep_size", str(ep), "--no_progress"] + (["--batch_size", str(bs)] if bs else [])
        if world == 1:
            single(argv)
        else:
            assert all(r["ok"] for r in launch(world, argv)), name
        nxt[name] = losses(d)[7]
    base = nxt["ep2"]
    for name, v in nxt.items():
        assert abs(v - base) / base < 1e-4, f"next-step loss {name}={v} vs ep2={base}"


def _one_error_line(r, *needles):
    lines = r["error"].splitlines()
    return (not r["ok"] and r["exit"] == 2 and len(lines) == 1 and lines[0].startswith("error: ")
            and all(n in lines[0] for n in needles))


def test_bad_setups_fail_fast():
    """On every rank one `error:` line and exit code 2: --ep_size that does not divide the world size or
    --num_experts (refused at setup, before any folder is made), flags that differ between ranks."""
    common = TINY + ["--data_path", data_file(), "--max_steps", "2", "--batch_size", "2"]
    res = launch(2, common + ["--ep_size", "4", "--out_dir", os.path.join(_TMP, "bad1")])
    assert all(_one_error_line(r, "must divide the world size 2") for r in res), res
    assert not os.path.exists(os.path.join(_TMP, "bad1")), "a run refused at setup left its folder"
    res = launch(2, common + ["--ep_size", "2", "--num_experts", "3", "--out_dir", os.path.join(_TMP, "bad2")])
    assert all(_one_error_line(r, "--ep_size 2 must divide --num_experts 3") for r in res), res
    assert not os.path.exists(os.path.join(_TMP, "bad2")), "a run refused at setup left its folder"
    res = launch(2, common + ["--out_dir", os.path.join(_TMP, "bad3")],
                 per_rank=lambda r: ["--hidden_size", "64" if r == 0 else "32"])
    assert all(_one_error_line(r, "differs between rank 0 and rank 1", "hidden_size") for r in res), res
    assert not os.path.exists(os.path.join(_TMP, "bad3")), "a run refused at setup left the folder it made"


TESTS = [test_ddp_ep_matches_single_process, test_every_gradient_matches_one_process,
         test_fused_ep_runs_where_a_rank_gets_no_token,
         test_dense_weights_identical_across_ranks, test_resume_across_ep_sizes,
         test_bad_setups_fail_fast, test_time_budget_ranks_stop_together,
         test_router_bias_update_counts_every_ranks_tokens]

if __name__ == "__main__":
    run(TESTS)
