"""Golden loss curve: a tiny pretraining run must log the training/router/validation losses checked into
scripts/golden/tiny_pretrain.json, step for step, so a refactor cannot silently change training (the
aux-loss coefficient, the LR schedule, the loss normalisation, the data order, the init...).

    python scripts/test_golden.py            # compare
    python scripts/test_golden.py --update   # rewrite the golden file after an *intended* change

Tolerance: relative 2e-4 per logged value. Two runs on one machine are bitwise equal; the slack is for
other CPUs, whose GEMM kernels (MKL / oneDNN pick code by ISA) round differently. Measured on this
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
RTOL = 2e-4
FLAGS = ["--hidden_size", "32", "--num_hidden_layers", "2", "--num_attention_heads", "2", "--num_key_value_heads", "1",
         "--num_experts", "4", "--num_experts_per_tok", "2", "--moe_intermediate_size", "32", "--seq_len", "32",
         "--batch_size", "4", "--vocab_size", "512", "--eval_tokens", "1024", "--max_steps", "30", "--warmup_steps", "5",
         "--learning_rate", "1e-2", "--log_interval", "3", "--eval_interval", "10", "--save_interval", "30",
         "--seed", "7", "--device", "cpu", "--dtype", "float32", "--no_progress", "--sample_tokens", "0"]
KEYS = ("train_loss", "aux_loss", "val_loss", "lr")


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
    from train.pretrain import parse_args, train
    tmp = testlib.scratch_dir("test_golden_")
    data = os.path.join(tmp, "corpus.txt")
    synthetic_corpus(data)
    s = train(parse_args(FLAGS + ["--data_path", data, "--out_dir", os.path.join(tmp, "run"), *extra]),
              log=lambda *_: None)
    return [{k: r[k] for k in ("step",) + KEYS if k in r} for r in s["records"]]


def compare(got, want):
    """Max relative difference over every logged value; raises AssertionError if the records differ in shape."""
    assert [sorted(r) for r in got] == [sorted(r) for r in want], "the logged records differ in steps or fields"
    worst = 0.0
    for g, w in zip(got, want):
        for k in KEYS:
            if k in w:
                worst = max(worst, abs(g[k] - w[k]) / max(abs(w[k]), 1e-12))
    return worst


def test_loss_curve_matches_golden():
    want = json.load(open(GOLDEN))["records"]
    got = golden_run()
    worst = compare(got, want)
    print(f"        max relative difference to the golden curve: {worst:.2e} (tolerance {RTOL})")
    assert worst <= RTOL, f"loss curve moved by {worst:.2e} relative (> {RTOL}); if intended, run --update"


TESTS = [test_loss_curve_matches_golden]

if __name__ == "__main__":
    if "--update" in sys.argv:
        records = golden_run()
        with open(GOLDEN, "w") as f:
            json.dump({"flags": FLAGS, "records": records}, f, indent=1)
        print(f"wrote {GOLDEN} ({len(records)} records)")
    else:
        run(TESTS)
