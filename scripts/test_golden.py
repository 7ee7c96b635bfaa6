"""Golden loss curves: a tiny pretraining run must log the training/router/validation losses checked into
scripts/golden/tiny_pretrain.json, step for step, so a refactor cannot silently change training (the
aux-loss coefficient, the LR schedule, the loss normalisation, the data order, the init...); the same run
on 2 local processes with --ep_size 2 --fsdp (the global batch kept) those of tiny_pretrain_ep2_fsdp.json,
so the distributed path (the experts' DTensor shards, FSDP2's reductions, the all-to-all) cannot either.

    python scripts/test_golden.py            # compare
    python scripts/test_golden.py --update   # rewrite the golden files after an *intended* change

Each file records the machine that wrote it (`machine`: CPU model, ISA level, torch, threads per process,
pinned by --threads 1); on that kind of machine its curve must come back to the bit (the runs are
deterministic). Elsewhere the tolerance is relative 2e-4 per logged value: other CPUs' GEMM kernels (MKL /
oneDNN pick code by ISA) and other torch versions round differently. Measured on this
config (AMD EPYC, fp32): --moe_impl fused instead of sorted (a rounding-only change of the same kind)
moves the curve by at most 1.8e-7 relative; doubling the aux-loss coefficient moves the router loss by
107% (the training loss by 7e-4); a 10% lower peak LR moves lr by 10% and the training loss by 3.3e-2;
one more warmup step moves the training loss by 3.7e-2.
"""
import json
import os
import random
import sys

import testlib
from testlib import ROOT, run  # noqa: F401

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "tiny_pretrain.json")
GOLDEN_EP = os.path.join(os.path.dirname(GOLDEN), "tiny_pretrain_ep2_fsdp.json")
RTOL = 2e-4
FLAGS = ["--hidden_size", "32", "--num_hidden_layers", "2", "--num_attention_heads", "2", "--num_key_value_heads", "1",
         "--num_experts", "4", "--num_experts_per_tok", "2", "--moe_intermediate_size", "32", "--seq_len", "32",
         "--batch_size", "4", "--vocab_size", "512", "--eval_tokens", "1024", "--max_steps", "30", "--warmup_steps", "5",
         "--learning_rate", "1e-2", "--log_interval", "3", "--eval_interval", "10", "--save_interval", "30",
         "--seed", "7", "--device", "cpu", "--dtype", "float32", "--threads", "1", "--no_progress", "--sample_tokens", "0"]
KEYS = ("train_loss", "aux_loss", "val_loss", "lr")
EP_FLAGS = ["--batch_size", "2", "--ep_size", "2", "--fsdp"]  # (2 ranks: the global batch of 4)


def synthetic_corpus(path, n_docs=300):
    """Deterministic text from a seeded random grammar: identical on every machine and Python version."""
    rng = random.Random(1234)
    nouns = "expert router token layer model batch loss weight gradient step shard rank".split()
    verbs = "routes sends scales sums holds moves checks splits joins returns".split()
    adjs = "small sparse dense quick stable exact local global".split()
    with open(path, "w") as f:
        for _ in range(n_docs):
            sentences = [f"The {rng.choice(adjs)} {rng.choice(nouns)} {rng.choice(verbs)} the "
                         f"{rng.choice(adjs)} {rng.choice(nouns)}." for _ in range(rng.randint(2, 6))]
            f.write(" ".join(sentences) + "\n\n")


def golden_run(extra=()):
    """The logged curve of the tiny run: [{step, train_loss, aux_loss, lr} or {step, val_loss}]."""
    tmp = testlib.scratch_dir("test_golden_")
    data = os.path.join(tmp, "corpus.txt")
    synthetic_corpus(data)
    return _curve(0, 1, FLAGS + ["--data_path", data, "--out_dir", os.path.join(tmp, "run"), *extra])


def golden_run_ep():
    """The tiny run's curve on 2 gloo ranks, --ep_size 2 --fsdp (rank 0 logs)."""
    tmp = testlib.scratch_dir("test_golden_ep_")
    data = os.path.join(tmp, "corpus.txt")
    synthetic_corpus(data)
    argv = FLAGS + EP_FLAGS + ["--data_path", data, "--out_dir", os.path.join(tmp, "run")]
    return testlib.spawn_ranks(_curve, 2, argv, init_group=False)[0]


def _curve(rank, world, argv):
    from train.pretrain import parse_args, train
    s = train(parse_args(argv), log=lambda *_: None)
    return [{k: r[k] for k in ("step",) + KEYS if k in r} for r in s["records"]]


def machine():
    """What decides a run's rounding here: the CPU model, the ISA level torch's kernels use, torch, and the
    threads per process (FLAGS pin them)."""
    import torch
    with open("/proc/cpuinfo") as f:
        info = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in f if ":" in line)}
    return {"cpu": " ".join(info.get(k, "") for k in ("model name", "cpu family", "model")),
            "capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "threads": int(FLAGS[FLAGS.index("--threads") + 1])}


def compare(got, want):
    """Max relative difference over every logged value; raises AssertionError if the records differ in their
    steps or fields."""
    shape = lambda records: [(r["step"], sorted(r)) for r in records]  # noqa: E731
    assert shape(got) == shape(want), f"the logged records differ in steps or fields: {shape(got)} vs {shape(want)}"
    worst = 0.0
    for g, w in zip(got, want):
        for k in KEYS:
            if k in w:
                worst = max(worst, abs(g[k] - w[k]) / max(abs(w[k]), 1e-12))
    return worst


def check_curve(path, got):
    """got's curve against the golden file at path: to the bit where the file's machine is this one, else
    within RTOL."""
    golden = json.load(open(path))
    worst = compare(got, golden["records"])
    same_machine = golden["machine"] == machine()
    print(f"        max relative difference to the golden curve: {worst:.2e} "
          f"({'this kind of machine wrote it: bitwise' if same_machine else f'another machine: tolerance {RTOL}'})")
    if same_machine:
        assert got == golden["records"], f"the curve moved by {worst:.2e}; if intended, run --update"
    assert worst <= RTOL, f"loss curve moved by {worst:.2e} relative (> {RTOL}); if intended, run --update"


def test_loss_curve_matches_golden():
    check_curve(GOLDEN, golden_run())


def test_ep2_fsdp_loss_curve_matches_golden():
    """The 2-rank --ep_size 2 --fsdp run's curve."""
    check_curve(GOLDEN_EP, golden_run_ep())


TESTS = [test_loss_curve_matches_golden, test_ep2_fsdp_loss_curve_matches_golden]

if __name__ == "__main__":
    if "--update" in sys.argv:
        for path, records, flags in ((GOLDEN, golden_run(), FLAGS), (GOLDEN_EP, golden_run_ep(), FLAGS + EP_FLAGS)):
            with open(path, "w") as f:
                json.dump({"flags": flags, "machine": machine(), "records": records}, f, indent=1)
            print(f"wrote {path} ({len(records)} records)")
    else:
        run(TESTS)
