"""Sharded training state: under --ep_size a rank holds only its experts, --fsdp shards the rest (FSDP2), and
the sharded checkpoints (DCP) resume under any world size / ep_size, survive a killed rank, refuse a damaged
shard, feed the tools, and train across two torchrun "nodes" on 127.0.0.1.

    python scripts/test_sharded.py
    TEST_DEVICE=cuda python scripts/test_sharded.py   # the same over NCCL, one GPU per rank (scripts/gpu_check.sh)
"""
import os
import shutil
import signal
import subprocess
import sys

import torch

import testlib
from testlib import ROOT, Skip, run, spawn_ranks  # noqa: F401
from test_ddp_ep_training import TINY, data_file, launch, losses, single

_TMP = testlib.scratch_dir("test_sharded_")
# 8 experts so that ep_size 4 leaves 2 per rank; no aux loss: each rank's aux loss sees only its own routing,
# which would differ from one process's by design (test_ddp_ep_training.py bounds that case)
DEVICE = os.environ.get("TEST_DEVICE", "cpu")
COMMON = TINY + ["--num_experts", "8", "--data_path", data_file(), "--router_aux_loss_coef", "0",
                 "--dtype", "float32", "--save_interval", "1000", "--device", DEVICE]
GLOBAL_BATCH = 8


def needs_ranks(world):
    """Skip where `world` ranks would not each get a GPU of their own (TEST_DEVICE=cuda)."""
    if DEVICE == "cuda" and world > torch.cuda.device_count():
        raise Skip(f"{world} ranks need {world} GPUs, {torch.cuda.device_count()} here")


def layout(world, ep=1, fsdp=False):
    return (["--batch_size", str(GLOBAL_BATCH // world), "--ep_size", str(ep)] + (["--fsdp"] if fsdp else []))


def train_in(out, world, *flags):
    """train/pretrain.py on `world` ranks (one process: in this one); asserts every rank succeeded."""
    needs_ranks(world)
    if world == 1:
        single(list(flags) + ["--out_dir", out])
    else:
        results = launch(world, list(flags) + ["--out_dir", out])
        assert all(r["ok"] for r in results), results


def whole_model(out):
    """The run's latest weights as one process reads them (ckpt.pt, or every shard)."""
    from train.checkpoint import load_checkpoint
    return load_checkpoint(out)["model"]


def assert_one_checkpoint(out):
    """The run folder holds one checkpoint: ckpt.pt, or the link ckpt and the folder it names."""
    held = sorted(n for n in os.listdir(out) if n.startswith("ckpt") or n.startswith(".ckpt"))
    link = os.path.join(out, "ckpt")
    assert held in (["ckpt.pt"], ["ckpt", os.readlink(link) if os.path.islink(link) else None]), (out, held)


def max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def held_worker(rank, world, argv):
    """Train with `argv`, and at the last save count the elements this rank holds: expert weights, their
    grads' and optimizer state's (AdamW: 2 moments), and the same for the dense parameters (local shards)."""
    import train.loop as loop
    from torch.distributed.tensor import DTensor
    from train.parallel import expert_params
    from train.pretrain import parse_args, train
    counts = {}
    original = loop.save

    def count_then_save(run, state, plots=True):
        experts = set(expert_params(run.model))
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
        for part, params in (("experts", [p for p in run.model.parameters() if p in experts]),
                             ("dense", [p for p in run.model.parameters() if p not in experts])):
            moments = [v for p in params for k, v in run.optimizer.state[p].items() if k.startswith("exp_avg")]
            counts[part] = (sum(local(p).numel() for p in params), sum(local(m).numel() for m in moments))
        return original(run, state, plots)
    loop.save = count_then_save
    train(parse_args(argv), log=lambda *_: None)
    return counts


def test_rank_holds_only_its_experts():
    """Elements of weights and AdamW moments per rank after training: experts 1/world of one process's
    (EP's shards, FSDP2 over the ranks holding the same experts: EP 2 on 4 ranks), with --fsdp the dense part
    1/world too (up to FSDP's padding of dim 0 to a multiple of the world size); --fsdp alone too. (The
    build allocating only a rank's experts under EP alone: test_expert_parallel.py's keyed-build test.)"""
    needs_ranks(4)
    argv = COMMON + ["--max_steps", "2", "--out_dir"]
    one = spawn_ranks(held_worker, 1, argv + [os.path.join(_TMP, "held1")] + layout(1), init_group=False)[0]
    for world, ep, fsdp in ((4, 2, True), (2, 1, True)):
        name = f"held{world}_{ep}_{int(fsdp)}"
        per_rank = spawn_ranks(held_worker, world, argv + [os.path.join(_TMP, name)] + layout(world, ep, fsdp),
                               init_group=False)
        for r, counts in enumerate(per_rank):
            for part, share in (("experts", world), ("dense", world if fsdp else 1)):
                for held, whole in zip(counts[part], one[part]):
                    assert held <= whole / share * 1.05, f"{name} rank {r}: {part} {held} of {whole} (1/{share})"
            assert counts["experts"][1] == 2 * counts["experts"][0], f"{name}: AdamW state for other experts"


def test_resume_across_layouts():
    """8 steps straight in one process vs 2 steps each on 1 process -> 2 ranks (ep 2) -> 4 ranks (ep 4, then
    ep 2 + --fsdp) -> 1 process: every step's loss and the final weights agree within fp32 reassociation
    (1e-5 relative loss, 1e-5 absolute weights: per-rank partial GEMMs for the dense grads, DDP's and
    FSDP's reduce order); the layout changes never lose or repeat a step or a batch."""
    straight = os.path.join(_TMP, "straight")
    train_in(straight, 1, *COMMON, "--max_steps", "8", *layout(1))
    for chain, layouts in (("ep", [(1, 1, False), (2, 2, False), (4, 4, False), (1, 1, False)]),
                           ("fsdp", [(1, 1, False), (2, 1, True), (4, 2, True), (1, 1, False)])):
        out = os.path.join(_TMP, f"chain_{chain}")
        for i, (world, ep, fsdp) in enumerate(layouts):
            flags = (COMMON + ["--max_steps", "8"] if i == 0 else ["--resume", "--no_progress"])
            train_in(out, world, *flags, "--stop_after", "2", *layout(world, ep, fsdp))
            sharded_now = os.path.islink(os.path.join(out, "ckpt"))
            assert sharded_now == (ep > 1 or fsdp), f"{chain} step {2 * (i + 1)}: sharded={sharded_now}"
            assert_one_checkpoint(out)
        a, b = losses(out), losses(straight)
        assert sorted(a) == sorted(b) == list(range(1, 9)), (chain, sorted(a))
        worst = max(abs(a[s] - b[s]) / b[s] for s in a)
        print(f"        {chain} chain: max relative loss difference {worst:.1e}, "
              f"weights {max_diff(whole_model(out), whole_model(straight)):.1e}")
        assert worst < 1e-5, (chain, worst)
        assert max_diff(whole_model(out), whole_model(straight)) < 1e-5


def test_resume_same_layout_is_bitwise():
    """4 steps straight vs 2 + resume 2 on the same layout (2 ranks, ep 2; and with --fsdp): the losses and
    the final weights are bitwise equal."""
    for name, flags in (("ep", layout(2, 2)), ("fsdp", layout(2, 2, True))):
        straight, resumed = os.path.join(_TMP, f"same_{name}_a"), os.path.join(_TMP, f"same_{name}_b")
        train_in(straight, 2, *COMMON, "--max_steps", "4", *flags)
        train_in(resumed, 2, *COMMON, "--max_steps", "4", "--stop_after", "2", *flags)
        train_in(resumed, 2, "--resume", "--no_progress", *flags)
        assert losses(straight) == losses(resumed), name
        a, b = whole_model(straight), whole_model(resumed)
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_fsdp_matches_one_process():
    """10 steps with --fsdp on 2 ranks (ep 1 and ep 2) vs one process: losses within 1e-5 relative (FSDP's
    reduce-scatter sums the ranks' grads in another order than one process's GEMM: fp32 reassociation)."""
    one = os.path.join(_TMP, "fsdp_ref")
    train_in(one, 1, *COMMON, "--max_steps", "10", *layout(1))
    for ep in (1, 2):
        out = os.path.join(_TMP, f"fsdp_ep{ep}")
        train_in(out, 2, *COMMON, "--max_steps", "10", *layout(2, ep, True))
        a, b = losses(out), losses(one)
        worst = max(abs(a[s] - b[s]) / b[s] for s in b)
        print(f"        --fsdp ep {ep}: max relative loss difference over 10 steps {worst:.1e}")
        assert worst < 1e-5, (ep, worst)


def resave_worker(rank, world, argv):
    """Resume `argv`'s run on this rank's layout and save it again at once, without a step."""
    import train.loop as loop
    from train.distributed import init_distributed, shutdown
    from train.pretrain import STAGE, parse_args
    args = parse_args(argv)
    ctx = init_distributed(args.ep_size, "cpu", args.fsdp)
    try:
        run, state = loop.setup(STAGE, args, ctx, "cpu", lambda *_: None)
        loop.save(run, state, plots=False)
        run.metrics.close()
    finally:
        shutdown(ctx)


def everything(out):
    """Every saved value of the run's checkpoint as one process reads it (a sharded one's DCP files whole)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from train.checkpoint import read_sharded_state
    from train.run_dir import checkpoint_in, is_sharded
    path = checkpoint_in(out)
    if not is_sharded(path):
        saved = torch.load(path, weights_only=True)
    else:
        whole = os.path.join(_TMP, "whole.pt")
        dcp_to_torch_save(path, whole)
        saved = {**read_sharded_state(path), **torch.load(whole, weights_only=True)}
    return {k: v for k, v in saved.items() if k not in ("sha256", "files", "world_size", "ep_size", "args")}


def assert_identical(a, b, where=""):
    if isinstance(a, dict):
        assert set(a) == set(b), (where, sorted(set(a) ^ set(b), key=str))
        for key in a:
            assert_identical(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}/{i}")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), where
    else:
        assert a == b, (where, a, b)


def test_resharding_keeps_every_bit():
    """Save in one layout, load in another, save again, with no step between (Megatron's resharding check,
    beyond weights): 1 process -> 2 ranks -> 4 ranks -> 2 ranks -> 1 process, EP and EP + --fsdp (the second
    2: --fsdp alone); every tensor of the model and the optimizer, the data position, the RNG state, the plan
    and the step equal to the bit."""
    needs_ranks(4)
    for chain, layouts in (("ep", [(2, 2, False), (4, 4, False), (2, 2, False), (1, 1, False)]),
                           ("fsdp", [(2, 2, True), (4, 2, True), (2, 1, True), (1, 1, False)])):
        out = os.path.join(_TMP, f"resave_{chain}")
        train_in(out, 1, *COMMON, "--max_steps", "8", "--stop_after", "2", *layout(1))
        first = everything(out)
        for world, ep, fsdp in layouts:
            argv = ["--resume", "--out_dir", out, "--no_progress"] + layout(world, ep, fsdp)
            if world == 1:
                resave_worker(0, 1, argv)
            else:
                spawn_ranks(resave_worker, world, argv, init_group=False)
            assert_identical(first, everything(out), f"{chain} at {world} ranks, ep {ep}, fsdp {fsdp}")


def _sharded_run(name, steps=2):
    out = os.path.join(_TMP, name)
    if not os.path.exists(out):
        train_in(out, 2, *COMMON, "--max_steps", "4", "--stop_after", str(steps), *layout(2, 2))
    return out


def _snapshot(out):
    target = os.path.realpath(os.path.join(out, "ckpt"))
    return target, {n: open(os.path.join(target, n), "rb").read() for n in sorted(os.listdir(target))}


def test_damaged_shard_is_one_error_line():
    """A flipped byte, a truncated shard, a missing shard, a damaged state.pt or DCP .metadata: resuming (2
    ranks) and reading the weights (export) each end in one `error:` line naming the file; nothing in the run
    folder changes."""
    src = _sharded_run("damage_src")
    for damage in ("flip", "truncate", "missing", "state", "metadata"):
        out = os.path.join(_TMP, f"damaged_{damage}")
        shutil.copytree(src, out, symlinks=True)
        target = os.path.realpath(os.path.join(out, "ckpt"))
        victim = os.path.join(target, {"state": "state.pt", "metadata": ".metadata"}.get(damage, "__1_0.distcp"))
        data = open(victim, "rb").read()
        if damage == "missing":
            os.remove(victim)
        else:
            with open(victim, "wb") as f:
                f.write(data[:len(data) // 2] if damage == "truncate" else
                        data[:100] + bytes([data[100] ^ 1]) + data[101:])
        before = _snapshot(out)
        results = launch(2, ["--resume", "--out_dir", out, "--no_progress"] + layout(2, 2))
        for r in results:  # (a damaged state.pt is found while the flags are read: argparse's usage line first)
            lines = [line for line in r.get("error", "").splitlines() if not line.startswith("usage:")]
            assert not r["ok"] and r["exit"] == 2 and len(lines) == 1, (damage, r)
            assert lines[0].startswith("error: ") and os.path.basename(victim) in lines[0], (damage, lines)
        res = testlib.run_script("scripts/export_hf.py", "--ckpt", out, "--out", os.path.join(out, "hf"))
        err = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(err) == 1 and os.path.basename(victim) in err[0], (damage, res.stderr)
        assert _snapshot(out) == before, f"{damage}: the run folder changed"


def test_copied_run_folders_resume():
    """A sharded run folder copied keeping its link (cp -r) or following it (cp -rL: `ckpt` a real folder)
    resumes on 2 ranks and in one process, each leaving one checkpoint behind."""
    src = _sharded_run("copy_src")
    for follow in (False, True):
        for world in (2, 1):
            out = os.path.join(_TMP, f"copied_{int(follow)}_{world}")
            shutil.copytree(src, out, symlinks=not follow)
            train_in(out, world, "--resume", "--no_progress", "--stop_after", "1", *layout(world, world))
            assert_one_checkpoint(out)
            assert max(losses(out)) == 3, (follow, world)


def kill_worker(rank, world, argv, victim, where):
    """Train with `argv`; rank `victim` dies by SIGKILL `where`: at the second checkpoint "writing" (its
    shards written, before they are hashed and the others finish) or "publishing" (rank 0 with state.pt
    written, before the link moves); or "stepping", in step 3 (its gradients reduced, before clipping and
    the optimizer step)."""
    import torch.distributed.checkpoint as dcp
    import train.checkpoint as ckpt
    import train.loop as loop
    from train.pretrain import parse_args, train
    calls = [0]
    module, name = {"writing": (dcp, "save"), "publishing": (ckpt, "publish_sharded"),
                    "stepping": (loop, "clip_grad_norm_sharded")}[where]
    original = getattr(module, name)

    def maybe_die_in(*args, **kwargs):
        out = original(*args, **kwargs) if where == "writing" else None
        calls[0] += 1
        if rank == victim and calls[0] == (3 if where == "stepping" else 2):
            open(argv[argv.index("--out_dir") + 1] + ".killed", "w").close()  # (the test's proof it died here)
            os.kill(os.getpid(), signal.SIGKILL)
        return out if where == "writing" else original(*args, **kwargs)
    setattr(module, name, maybe_die_in)
    train(parse_args(argv), log=lambda *_: None)


def test_kill_keeps_the_previous_checkpoint_and_the_run_continues_bitwise():
    """kill -9 of one rank in the middle of a sharded save (rank 1 while DCP writes; rank 0 just before the
    publish) or of a step (rank 1 in step 3): the run dies of that kill (the killed rank's exit code is -9 and
    it reached the spot; another failure is not taken for it), the step-2 checkpoint stays the run's, and the
    relaunched run resumes from it to the end: its losses and weights equal the uninterrupted run's."""
    needs_ranks(2)
    straight = os.path.join(_TMP, "unkilled")
    common = COMMON + ["--max_steps", "6", "--save_interval", "2", "--no_progress"] + layout(2, 2)
    train_in(straight, 2, *common)
    for victim, where in ((1, "writing"), (0, "publishing"), (1, "stepping")):
        out = os.path.join(_TMP, f"killed_{where}")
        codes = testlib.rank_exit_codes(kill_worker, 2, common + ["--out_dir", out], victim, where)
        print(f"        killed rank {victim} {where}: exit codes by rank {codes}")
        assert codes[victim] == -signal.SIGKILL and os.path.exists(out + ".killed"), (where, victim, codes)
        assert codes[1 - victim] != 0, f"{where}: rank {1 - victim} ended normally without its peer: {codes}"
        from train.checkpoint import load_checkpoint
        assert load_checkpoint(out, weights=False)["step"] == 2, where
        train_in(out, 2, "--resume", "--no_progress", *layout(2, 2))
        assert max(losses(out)) == 6 and load_checkpoint(out)["step"] == 6, where
        assert_one_checkpoint(out)
        assert losses(out) == losses(straight), where
        a, b = whole_model(out), whole_model(straight)
        assert all(torch.equal(a[k], b[k]) for k in a), where


def disk_full_worker(rank, world, argv, failing_ranks):
    """train/pretrain.py's command line on this rank (run_cli, as _train_rank) with the disk full for the ranks
    `failing_ranks` at the second checkpoint: there each DCP file write raises OSError ENOSPC. Returns the exit
    code and what the rank wrote to stderr (an uncaught exception: exit 1 and its traceback, as a process)."""
    import contextlib
    import errno
    import io
    import traceback

    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.filesystem as dcp_files
    from train.loop import run_cli
    from train.pretrain import STAGE, parse_args
    saves, write_item, save = [0], dcp_files._write_item, dcp.save

    def full_disk_write(*args, **kwargs):
        if saves[0] == 2 and rank in failing_ranks:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_item(*args, **kwargs)

    def counted_save(*args, **kwargs):
        saves[0] += 1
        return save(*args, **kwargs)
    dcp_files._write_item, dcp.save = full_disk_write, counted_save
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            run_cli(STAGE, parse_args(argv), log=lambda *_: None)
        return {"exit": 0, "stderr": err.getvalue()}
    except SystemExit as e:
        return {"exit": e.code, "stderr": err.getvalue()}
    except BaseException:  # (DCP's CheckpointException is one)
        return {"exit": 1, "stderr": err.getvalue() + traceback.format_exc()}


def test_disk_full_at_a_sharded_save_is_one_error_line():
    """A sharded save (2 ranks, --ep_size 2) whose DCP writes fail for a full disk (ENOSPC at the second
    checkpoint, on rank 1 alone or on both): exit 2 on every rank, one `error:` line in all (rank 0's, naming
    the run folder and the cause; rank 1 a note), no traceback; the step-2 checkpoint stays the run's and
    loads, and the failed save leaves no temp folder."""
    needs_ranks(2)
    from train.checkpoint import load_checkpoint
    common = COMMON + ["--max_steps", "4", "--save_interval", "2", "--no_progress"] + layout(2, 2)
    for failing in ((1,), (0, 1)):
        out = os.path.join(_TMP, f"disk_full_{len(failing)}")
        results = spawn_ranks(disk_full_worker, 2, common + ["--out_dir", out], failing, init_group=False)
        stderr = "".join(r["stderr"] for r in results)
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert [r["exit"] for r in results] == [2, 2] and "Traceback" not in stderr, (failing, results)
        assert len(errors) == 1 and out in errors[0] and "No space left on device" in errors[0], (failing, errors)
        assert "note: rank 1 stops" in results[1]["stderr"], (failing, results[1])
        assert load_checkpoint(out)["step"] == 2, failing
        assert_one_checkpoint(out)


def test_tools_read_a_sharded_run():
    """generate.py, export_gguf.py and --init_from take a sharded run's folder, export_hf.py its checkpoint
    folder (`ckpt`, the tokenizer found beside it): their weights are the ranks' (export checks its logits
    against ours)."""
    out = _sharded_run("tools_src")
    gen = testlib.run_script("scripts/generate.py", "--ckpt", out, "--prompt", "The", "--max_new_tokens", "8",
                             "--temperature", "0")
    assert gen.returncode == 0 and gen.stdout.strip(), gen.stderr
    export = testlib.run_script("scripts/export_hf.py", "--ckpt", os.path.join(out, "ckpt"), "--out",
                                os.path.join(_TMP, "tools_hf"))
    assert export.returncode == 0, export.stderr
    export = testlib.run_script("scripts/export_gguf.py", "--ckpt", out, "--out", os.path.join(_TMP, "tools.gguf"))
    assert export.returncode == 0 and "exported qwen3moe" in export.stdout, export.stderr
    init = os.path.join(_TMP, "tools_init")
    train_in(init, 1, *COMMON, "--max_steps", "1", "--init_from", out, *layout(1))
    assert losses(init)[1] < losses(out)[1], "--init_from did not start from the trained weights"


def test_chat_eval_sft_and_torchtitan_export_read_a_sharded_run():
    """README: sharded checkpoints "feed every tool". chat.py, eval_sft.py and export_torchtitan.py given a
    sharded run (2 ranks, --ep_size 2: `ckpt` links to DCP shards; the run test_tools_read_a_sharded_run reads)
    give what they give on the same checkpoint as one ckpt.pt (the run resumed in one process and saved again
    without a step: every bit kept, test_resharding_keeps_every_bit): chat's answer (sampled, seeded) and
    eval_sft's greedy report the same non-empty text, and the torchtitan folders' HF weights are equal tensor by
    tensor (the check that sees a small error: experts read in another order leave this tiny model's text as it
    was)."""
    from safetensors.torch import load_file
    from train.run_dir import checkpoint_in
    out, whole = _sharded_run("tools_src"), os.path.join(_TMP, "tools_whole")
    if not os.path.exists(whole):
        shutil.copytree(out, whole, symlinks=True)
        resave_worker(0, 1, ["--resume", "--out_dir", whole, "--no_progress"] + layout(1))
    assert os.path.islink(os.path.join(out, "ckpt")) and os.path.basename(checkpoint_in(whole)) == "ckpt.pt"
    got = {}
    for name, run_dir in (("sharded", out), ("ckpt.pt", whole)):
        chat = testlib.run_script("scripts/chat.py", "--ckpt", run_dir, "--prompt", "What does `len` do?",
                                  "--temperature", "1", "--top_k", "0", "--top_p", "1", "--seed", "0",
                                  "--max_new_tokens", "16", "--device", "cpu")
        scores = testlib.run_script("scripts/eval_sft.py", "--base", run_dir, "--sft", run_dir, "--n", "2",
                                    "--max_new_tokens", "12", "--examples", "2")
        tt = os.path.join(_TMP, f"tools_tt_{name}")
        export = testlib.run_script("scripts/export_torchtitan.py", "--ckpt", run_dir, "--out", tt, "--ep", "2",
                                    "--fsdp", "2")
        for tool, r in (("chat", chat), ("eval_sft", scores), ("export_torchtitan", export)):
            assert r.returncode == 0, (name, tool, r.stdout[-1000:], r.stderr[-2000:])
        assert chat.stdout.strip() and scores.stdout.startswith("2 held-out questions"), (name, chat.stdout, scores.stdout)
        assert os.path.exists(os.path.join(tt, "minimind_tt.py")) and os.path.exists(os.path.join(tt, "COMMAND.txt"))
        got[name] = (chat.stdout, scores.stdout, load_file(os.path.join(tt, "hf", "model.safetensors")))
    (chat_a, scores_a, hf_a), (chat_b, scores_b, hf_b) = got["sharded"], got["ckpt.pt"]
    print(f"        chat's answer from either: {chat_a.strip()[:80]!r}")
    assert chat_a == chat_b, (chat_a, chat_b)
    assert scores_a == scores_b, (scores_a, scores_b)
    assert set(hf_a) == set(hf_b) and all(torch.equal(hf_a[k], hf_b[k]) for k in hf_a), \
        [k for k in hf_a if k not in hf_b or not torch.equal(hf_a[k], hf_b[k])]


def test_sigterm_to_torchrun_saves_and_the_run_resumes_bitwise():
    """SIGTERM to torchrun (2 processes, --ep_size 2) once training has started (a train_loss in metrics.jsonl):
    torchrun forwards it to the ranks, each says it finishes the step and saves (train/loop.py: StopSignal); they
    stop together at a step before the last, leave the sharded checkpoint of that step (its last train_loss) and
    rank 0 prints the command that continues; torchrun itself ends with its SignalException (exit 1), without
    having to kill a rank and with no rank's traceback. `--resume` then trains to the last step: every loss and
    the final weights bitwise those of the run left uninterrupted."""
    needs_ranks(2)
    steps = 12
    common = COMMON + ["--max_steps", str(steps), "--no_progress"] + layout(2, 2)
    out, log_path = os.path.join(_TMP, "sigterm"), os.path.join(_TMP, "sigterm.log")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                 "--master_addr", "127.0.0.1", "--master_port", str(testlib.free_port()),
                                 os.path.join(ROOT, "train", "pretrain.py"), *common, "--out_dir", out],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            testlib.wait_for_training(proc, out, log=lambda: open(log_path).read()[-3000:])
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = open(log_path).read()
    from train.checkpoint import load_checkpoint
    stopped = load_checkpoint(out, weights=False)["step"]
    print(f"        SIGTERM: stopped at step {stopped} of {steps}")
    assert 1 <= stopped < steps and max(losses(out)) == stopped, (stopped, sorted(losses(out)), text[-3000:])
    assert text.count("SIGTERM: finishing this step, then saving a checkpoint") == 2, text[-3000:]
    assert (f"stopped at step {stopped} (SIGTERM); continue with: " in text
            and f"train/pretrain.py --resume --out_dir {out}" in text), text[-3000:]
    assert code == 1 and text.count("Traceback") == 1 and "SignalException" in text.split("Traceback")[1], \
        (code, text[-3000:])
    assert "forcefully exiting via SIGKILL" not in text, text[-3000:]
    assert os.path.islink(os.path.join(out, "ckpt"))
    assert_one_checkpoint(out)
    train_in(out, 2, "--resume", "--no_progress", *layout(2, 2))
    straight = os.path.join(_TMP, "sigterm_straight")
    train_in(straight, 2, *common)
    assert sorted(losses(out)) == list(range(1, steps + 1)) and losses(out) == losses(straight), \
        (losses(out), losses(straight))
    a, b = whole_model(out), whole_model(straight)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _torchrun_two_nodes(argv, port):
    """train/pretrain.py as 2 torchrun launches of one process each (--nnodes 2 --node_rank 0 / 1) meeting on
    127.0.0.1; returns their completed processes."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    launches = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank",
                                  str(node), "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port",
                                  str(port), os.path.join(ROOT, "train", "pretrain.py"), *argv],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for node in (0, 1)]
    outs = [p.communicate(timeout=300)[0] for p in launches]
    return [(p.returncode, out) for p, out in zip(launches, outs)]


def test_two_nodes():
    """Two torchrun "nodes" of one process each on localhost: DDP + EP 2 over the 2 ranks (every all-to-all and
    reduction crosses the nodes), to the same losses as one process (1e-5 relative). (Resuming under another layout:
    test_resume_across_layouts.)"""
    if DEVICE == "cuda":
        raise Skip("two launches on one machine would share GPUs 0 and 1")
    out, ref = os.path.join(_TMP, "two_nodes"), os.path.join(_TMP, "two_nodes_ref")
    train_in(ref, 1, *COMMON, "--max_steps", "4", *layout(1))
    flags = COMMON + ["--max_steps", "4", *layout(2, 2), "--out_dir", out, "--no_progress"]
    for code, log in _torchrun_two_nodes(flags, testlib.free_port()):
        assert code == 0, log[-3000:]
    a, b = losses(out), losses(ref)
    assert sorted(a) == [1, 2, 3, 4] and max(abs(a[s] - b[s]) / b[s] for s in b) < 1e-5, (a, b)


TESTS = [test_rank_holds_only_its_experts, test_resume_across_layouts, test_resume_same_layout_is_bitwise,
         test_resharding_keeps_every_bit, test_fsdp_matches_one_process, test_damaged_shard_is_one_error_line,
         test_copied_run_folders_resume, test_kill_keeps_the_previous_checkpoint_and_the_run_continues_bitwise,
         test_disk_full_at_a_sharded_save_is_one_error_line,
         test_tools_read_a_sharded_run, test_chat_eval_sft_and_torchtitan_export_read_a_sharded_run,
         test_sigterm_to_torchrun_saves_and_the_run_resumes_bitwise, test_two_nodes]

if __name__ == "__main__":
    run(TESTS)
