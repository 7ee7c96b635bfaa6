"""End to end: a tiny pretraining run learns real text, its checkpoint reloads and samples, a resumed
run equals a continuous one bit for bit, and bad input fails fast with a clear message.

    python scripts/test_pretrain.py
"""
import json
import os
import subprocess
import sys
import tempfile

import torch

from testlib import ROOT, SHARED, Skip, run  # noqa: F401
from train.checkpoint import load_checkpoint, model_from_checkpoint
from train.pretrain import parse_args
from train.trainer import train

TINY = ["--hidden_size", "64", "--num_layers", "2", "--num_heads", "4", "--num_kv_heads", "2",
        "--num_experts", "4", "--top_k", "2", "--moe_intermediate_size", "64", "--seq_len", "64",
        "--batch_size", "8", "--vocab_size", "1024", "--eval_tokens", "2048", "--warmup_steps", "5",
        "--log_interval", "5", "--no_progress", "--sample_tokens", "0"]
_TMP = tempfile.mkdtemp(prefix="test_pretrain_")


def text_file():
    """Real text nobody here wrote (tinyshakespeare) when present, else a slice of the embedded corpus."""
    path = os.path.join(SHARED, "data", "tinyshakespeare.txt")
    if os.path.exists(path):
        return path
    from data.corpus import default_corpus
    return default_corpus()["train"]


def quiet(*_):
    pass


def test_tiny_run_learns_and_checkpoint_reloads():
    out_dir = os.path.join(_TMP, "run")
    args = parse_args(TINY + ["--data_path", text_file(), "--out_dir", out_dir, "--max_steps", "150",
                              "--eval_interval", "50", "--learning_rate", "1e-2"])
    s = train(args, log=quiet)
    assert s["final_val_loss"] < 0.85 * s["first_val_loss"], f"{s['first_val_loss']:.3f} -> {s['final_val_loss']:.3f}"
    assert s["final_val_loss"] < s["unigram_entropy"], f"{s['final_val_loss']:.3f} vs unigram {s['unigram_entropy']:.3f}"
    for name in ("ckpt.pt", "config.json", "loss.png", "metrics.jsonl", "tokenizer/tokenizer.json"):
        assert os.path.exists(os.path.join(out_dir, name)), f"{name} missing"
    ckpt = load_checkpoint(out_dir)
    assert ckpt["step"] == 150 and all(v.dtype == torch.float32 for v in ckpt["model"].values() if v.is_floating_point())
    model = model_from_checkpoint(ckpt).eval()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.join(out_dir, "tokenizer"))
    ids = torch.tensor([tok("the", add_special_tokens=False)["input_ids"]])
    assert model.generate(ids, 8, temperature=0).shape[1] == ids.shape[1] + 8
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "generate.py"), "--ckpt", out_dir,
                        "--prompt", "the", "--max_new_tokens", "12"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr[-2000:]


def test_dense_model_trains_and_resume_keeps_a_damaged_log():
    """--use_moe 0 trains (no router fields anywhere), and a torn last metrics line (a kill mid-write)
    is skipped with a warning naming the file and line instead of blocking --resume."""
    out_dir = os.path.join(_TMP, "dense")
    r = _cli(*TINY, "--data_path", text_file(), "--use_moe", "0", "--max_steps", "4", "--log_interval", "2",
             "--out_dir", out_dir)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    assert [x["step"] for x in rows if "train_loss" in x] == [2, 4] and not any("expert_load" in x for x in rows)
    with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
        f.write('{"step": 5, "train_lo')
    r = _cli("--resume", "--out_dir", out_dir, "--max_steps", "6")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "metrics.jsonl:" in r.stderr and "skipping a damaged metrics record" in r.stderr, r.stderr[-2000:]
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    assert [x["step"] for x in rows if "train_loss" in x] == [2, 4, 6]


def test_resume_equals_continuous_run():
    data = text_file()
    common = TINY + ["--data_path", data, "--max_steps", "12", "--eval_interval", "6", "--save_interval", "4",
                     "--grad_accum", "2"]
    a_dir, b_dir = os.path.join(_TMP, "cont"), os.path.join(_TMP, "resumed")
    train(parse_args(common + ["--out_dir", a_dir]), log=quiet)
    train(parse_args(common + ["--out_dir", b_dir, "--stop_after", "3"]), log=quiet)  # mid log interval
    assert load_checkpoint(b_dir)["step"] == 3
    train(parse_args(["--resume", "--out_dir", b_dir, "--no_progress"]), log=quiet)
    a, b = load_checkpoint(a_dir), load_checkpoint(b_dir)
    assert a["step"] == b["step"] == 12
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"{k} differs after resume"
    la = [json.loads(l) for l in open(os.path.join(a_dir, "metrics.jsonl"))]
    lb = [json.loads(l) for l in open(os.path.join(b_dir, "metrics.jsonl"))]
    # everything but the timing, the expert-load telemetry of the interval the resume cuts included
    key = lambda rs: [{k: v for k, v in r.items() if k != "tok_per_s"} for r in rs]  # noqa: E731
    assert key(la) == key(lb), "logged records differ between the continuous and the resumed run"


def _cli(*argv):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train", "pretrain.py"), *argv],
                          capture_output=True, text=True, timeout=300, cwd=_TMP)


def test_bad_inputs_fail_fast_with_clear_messages():
    bad = os.path.join(_TMP, "bad.jsonl")
    with open(bad, "w") as f:
        f.write('{"text": "fine"}\n{"text": "fine too"}\n{"text": oops}\n')
    empty = os.path.join(_TMP, "empty.txt")
    open(empty, "w").close()
    cases = [(["--data_path", os.path.join(_TMP, "nope.jsonl")], "nope.jsonl: data file not found"),
             (["--data_path", empty], "empty.txt: contains no text"),
             (["--data_path", bad], "bad.jsonl:3: malformed JSON"),
             (["--num_experts", "4", "--top_k", "5"], "num_experts_per_tok"),
             (["--num_heads", "3"], "num_attention_heads"),
             (["--max_steps", "0"], "--max_steps"),
             (["--resume", os.path.join(_TMP, "none.pt")], "checkpoint not found"),
             (["--device", "tpu"], "--device must be"), (["--learning_rate", "inf"], "--learning_rate"),
             (["--stop_after", "-3"], "--stop_after"), (["--tokenizer", os.path.join(_TMP, "no_tok")], "no tokenizer.json")]
    for argv, msg in cases:
        r = _cli(*argv, "--out_dir", os.path.join(_TMP, "bad_run"), "--no_progress")
        assert r.returncode != 0, f"{argv}: exit 0"
        assert msg in r.stderr, f"{argv}: stderr does not say {msg!r}:\n{r.stderr[-1500:]}"
        assert "Traceback" not in r.stderr, f"{argv}: a traceback instead of a message:\n{r.stderr[-1500:]}"


def test_resume_refuses_a_changed_data_order():
    run_dir = os.path.join(_TMP, "order")
    train(parse_args(TINY + ["--data_path", text_file(), "--max_steps", "2", "--out_dir", run_dir]), log=quiet)
    r = _cli("--resume", run_dir, "--seq_len", "32", "--no_progress")
    assert r.returncode != 0 and "--seq_len cannot change on resume" in r.stderr, r.stderr[-1500:]


def test_corrupt_checkpoint_is_refused():
    path = os.path.join(_TMP, "corrupt.pt")
    with open(path, "wb") as f:
        f.write(b"not a checkpoint")
    try:
        load_checkpoint(path)
    except ValueError as e:
        assert "corrupt.pt" in str(e)
    else:
        raise AssertionError("corrupt checkpoint accepted")


def test_fused_impl_trains_like_sorted_and_switches_on_resume():
    """--moe_impl fused gives the sorted run's loss curve (within fp32 rounding) and its checkpoint
    resumes under --moe_impl sorted (the implementation is not part of the architecture)."""
    common = TINY + ["--data_path", text_file(), "--max_steps", "20", "--eval_interval", "10", "--save_interval", "10"]
    runs = {}
    for impl in ("sorted", "fused"):
        out_dir = os.path.join(_TMP, f"impl_{impl}")
        train(parse_args(common + ["--out_dir", out_dir, "--moe_impl", impl, "--stop_after", "10"]), log=quiet)
        s = train(parse_args(common + ["--out_dir", out_dir, "--moe_impl", "sorted" if impl == "fused" else "fused",
                                       "--resume", os.path.join(out_dir, "ckpt.pt")]), log=quiet)
        runs[impl] = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
        assert s["final_val_loss"] < s["first_val_loss"]
    a = [r["train_loss"] for r in runs["sorted"] if "train_loss" in r]
    b = [r["train_loss"] for r in runs["fused"] if "train_loss" in r]
    assert len(a) == len(b) > 0
    worst = max(abs(x - y) / x for x, y in zip(a, b))
    assert worst < 1e-4, f"sorted vs fused loss curves differ by {worst:.1e} relative"


TESTS = [test_tiny_run_learns_and_checkpoint_reloads, test_fused_impl_trains_like_sorted_and_switches_on_resume,
         test_dense_model_trains_and_resume_keeps_a_damaged_log,
         test_resume_equals_continuous_run, test_bad_inputs_fail_fast_with_clear_messages, test_resume_refuses_a_changed_data_order,
         test_corrupt_checkpoint_is_refused]

if __name__ == "__main__":
    run(TESTS)
