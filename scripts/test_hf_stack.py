"""Our exports in the HF stack: `transformers serve` (OpenAI API) and `transformers chat`, DPO with TRL, LoRA with
PEFT merged and re-imported, and the lm-eval tasks of scripts/hf/tasks. Each test skips, saying what to install,
where the optional packages (scripts/hf/requirements.txt) are missing.

    python scripts/test_hf_stack.py

The model is tiny (2 layers x 64, 4 experts top-2) and fine-tuned here with train/sft.py until it answers three
questions word for word and ends its turn, so served, chatted and greedy answers can be compared as text.
"""
import glob
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time

import torch

import testlib
from testlib import ROOT, Skip, free_port, run, run_script

sys.path.insert(0, os.path.join(ROOT, "scripts", "hf"))
_TMP = testlib.scratch_dir("test_hf_stack_")
BIN = os.path.dirname(sys.executable)
QA = [("What does `len` do?", "Return the number of items in a container."),
      ("What does `abs` do?", "Return the absolute value of the argument."),
      ("What does `sorted` do?", "Return a new list of the items of the iterable in ascending order.")]
HF_OFFLINE = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
_made = {}


def need(*modules):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise Skip(f"{', '.join(missing)} not installed: pip install -r scripts/hf/requirements.txt")


def cli(script, *argv):
    """stdout of the script run to its end in this process (testlib.run_script), which must exit 0."""
    r = run_script(script, *argv, cwd=ROOT)
    assert r.returncode == 0, (script, r.stdout[-2000:], r.stderr[-3000:])
    return r.stdout


def sft_export():
    """(exported HF folder, our SFT run dir) of a tiny MoE that answers QA word for word (cached per process)."""
    if _made:
        return _made["hf"], _made["run"]
    from data.sft_corpus import default_sft_set
    from data.tokenizer import save_tokenizer, train_tokenizer
    from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
    from train.checkpoint import save_checkpoint
    texts = [t for qa in QA for t in qa]
    with open(default_sft_set()["val"], encoding="utf-8") as f:  # (also builds the embedded set the scripts read)
        texts += [m["content"] for line in f for m in json.loads(line)["conversations"]]
    cfg = MiniMindConfig(vocab_size=400, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, use_moe=True, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=48, max_position_embeddings=512)
    torch.manual_seed(0)
    init = os.path.join(_TMP, "init")
    save_checkpoint(os.path.join(init, "ckpt.pt"), MiniMindForCausalLM(cfg), extra={"step": 0, "args": {}})
    save_tokenizer(train_tokenizer(texts, vocab_size=400), os.path.join(init, "tokenizer"))
    data = os.path.join(_TMP, "qa.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        for i in range(60):
            q, a = QA[i % len(QA)]
            f.write(json.dumps({"conversations": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n")
    run_dir, hf = os.path.join(_TMP, "sft"), os.path.join(_TMP, "sft_hf")
    cli("train/sft.py", "--init_from", init, "--data_path", data, "--val_path", data, "--max_steps", "60", "--seq_len", "64",
        "--batch_size", "4", "--learning_rate", "1e-2", "--warmup_steps", "5", "--eval_interval", "60", "--eval_tokens", "256",
        "--sample_tokens", "0", "--threads", "2", "--no_progress", "--out_dir", run_dir)
    cli("scripts/export_hf.py", "--ckpt", run_dir, "--out", hf)
    _made.update(hf=hf, run=run_dir)
    return hf, run_dir


def greedy_chat_py(run_dir, question):
    return cli("scripts/chat.py", "--ckpt", run_dir, "--prompt", question, "--temperature", "0",
               "--max_new_tokens", "40").strip()


def test_serve_answers_like_chat_py_and_stops_at_end_of_turn():
    """`transformers serve EXPORT` on a free local port; the openai client's answers (plain and streamed, greedy)
    equal scripts/chat.py's greedy answers and end with finish_reason "stop" (at <|im_end|>, not the token limit);
    `transformers chat` against the same server answers too; the server is gone afterwards."""
    need("openai", "fastapi", "uvicorn")
    import openai
    hf, run_dir = sft_export()
    expected = {q: greedy_chat_py(run_dir, q) for q, _ in QA}
    assert all(expected[q] == a for q, a in QA), expected  # (the model learned its answers)
    port = free_port()
    log = open(os.path.join(_TMP, "serve.log"), "w")
    server = subprocess.Popen([os.path.join(BIN, "transformers"), "serve", hf, "--host", "127.0.0.1", "--port", str(port),
                               "--device", "cpu"], stdout=log, stderr=subprocess.STDOUT, env=HF_OFFLINE,
                              start_new_session=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60, max_retries=0)
        deadline = time.time() + 120
        while True:
            assert server.poll() is None, open(log.name).read()[-3000:]
            try:
                assert [m.id for m in client.models.list().data] == [hf]
                break
            except openai.APIConnectionError:
                assert time.time() < deadline, "server not up after 120 s: " + open(log.name).read()[-3000:]
                time.sleep(0.5)
        for question, _ in QA:
            messages = [{"role": "user", "content": question}]
            r = client.chat.completions.create(model=hf, messages=messages, temperature=0, max_tokens=40)
            assert (r.choices[0].message.content.strip(), r.choices[0].finish_reason) == (expected[question], "stop"), r
            chunks = list(client.chat.completions.create(model=hf, messages=messages, temperature=0, max_tokens=40,
                                                         stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert (text.strip(), reasons) == (expected[question], ["stop"]), (text, reasons)
        question = QA[1][0]
        chat = subprocess.run([os.path.join(BIN, "transformers"), "chat", hf, f"http://127.0.0.1:{port}", "do_sample=False"],
                              input=f"{question}\n!exit\n", capture_output=True, text=True, timeout=120)  # (offline mode blocks localhost)
        assert chat.returncode == 0 and expected[question] in chat.stdout, (chat.stdout[-2000:], chat.stderr[-2000:])
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
    assert server.poll() is not None


def test_dpo_moves_the_model_toward_chosen_answers():
    """scripts/hf/dpo.py: TRL's DPOTrainer on the embedded preference pairs gives most pairs it trained on a positive
    reward margin (the held-out figures are the README's, on the main job's model), writes a folder
    transformers loads with the figures in dpo_results.json, and refuses to overwrite a folder."""
    need("trl")
    import dpo
    from common import load_export, qa_pairs
    hf, _ = sft_export()
    train = dpo.preference_dataset(qa_pairs("train", 16))
    before = dpo.pair_logprobs(*load_export(hf), train)
    out = os.path.join(_TMP, "dpo")
    results = dpo.dpo(hf, out, steps=16, batch_size=8, lr=1e-3, max_train=16, max_eval=16, log=lambda *_: None)
    reward_accuracy = dpo.accuracies(before, dpo.pair_logprobs(*load_export(out), train))["reward_accuracy"]
    assert reward_accuracy >= 0.75, reward_accuracy
    saved = json.load(open(os.path.join(out, "dpo_results.json")))
    assert saved["held_out_pairs"] == 16 and 0 <= saved["preference_accuracy_after"] <= 1, saved
    assert saved == json.loads(json.dumps(results))
    r = run_script("scripts/hf/dpo.py", "--model", hf, "--out", out)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: ") and "Traceback" not in r.stderr


def test_sharded_run_folder_is_refused_as_a_training_run():
    """scripts/hf/lora.py and dpo.py with --model a sharded training run (its checkpoint the link ckpt ->
    ckpt.step<N>/ of DCP shards and state.pt, no ckpt.pt), or that checkpoint's folder: exit 2, one `error:`
    line saying it is a training run to export first, no traceback, nothing written. The folder has the layout
    train/run_dir.py: checkpoint_in finds (empty files: the check reads no weights) and a run's config.json."""
    need("peft", "trl")
    from model.model_minimind import MiniMindConfig
    run_dir = os.path.join(_TMP, "sharded_run")
    os.makedirs(os.path.join(run_dir, "ckpt.step2"))
    for name in ("state.pt", ".metadata", "__0_0.distcp", "__1_0.distcp"):
        open(os.path.join(run_dir, "ckpt.step2", name), "wb").close()
    os.symlink("ckpt.step2", os.path.join(run_dir, "ckpt"))
    with open(os.path.join(run_dir, "config.json"), "w", encoding="utf-8") as f:
        f.write(MiniMindConfig(hidden_size=64, num_hidden_layers=2, use_moe=True).to_json_string())
    for script in ("scripts/hf/lora.py", "scripts/hf/dpo.py"):
        for model in (run_dir, os.path.join(run_dir, "ckpt")):
            out = os.path.join(_TMP, "from_sharded_run")
            r = run_script(script, "--model", model, "--out", out)
            errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
            assert r.returncode == 2 and "Traceback" not in r.stderr and len(errors) == 1, (script, r.stderr[-3000:])
            assert "a training run, not an export" in errors[0] and "export_hf.py" in errors[0], errors
            assert not os.path.exists(out), f"{script} wrote {out}"


def test_lora_merged_reimported_and_continued():
    """scripts/hf/lora.py: PEFT LoRA on attention and the experts' fused weights, merged; the merged folder reloads
    with the merged model's logits, both LoRA targets changed, scripts/import_hf.py reads it back with logits
    equal to transformers' within the export tolerance, and train/sft.py --init_from continues from it."""
    need("peft", "trl")
    import lora
    from transformers import AutoModelForCausalLM
    from train.checkpoint import load_checkpoint, model_from_checkpoint
    hf, _ = sft_export()
    out = os.path.join(_TMP, "lora")
    merged, _ = lora.lora(hf, out, steps=4, batch_size=4, lr=1e-2, max_train=32, log=lambda *_: None)
    base = AutoModelForCausalLM.from_pretrained(hf).eval()
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    b, m = base.state_dict(), merged.state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.gate_up_proj",
                 "model.layers.1.mlp.experts.down_proj"):
        assert not torch.equal(b[name], m[name]), f"LoRA left {name} unchanged"
    imported = os.path.join(_TMP, "lora_imported")
    cli("scripts/import_hf.py", "--hf", out, "--out", imported)
    ours = model_from_checkpoint(load_checkpoint(imported)).eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = merged(ids).logits
        assert (reloaded(ids).logits - want).abs().max().item() <= 1e-5
        diff = (ours(ids).logits - want).abs().max().item()
    assert diff <= 1e-4, diff
    cli("train/sft.py", "--init_from", imported, "--data_path", os.path.join(_TMP, "qa.jsonl"), "--val_path",
        os.path.join(_TMP, "qa.jsonl"), "--max_steps", "2", "--seq_len", "64", "--batch_size", "4", "--sample_tokens", "0",
        "--eval_tokens", "256", "--threads", "2", "--no_progress", "--out_dir", os.path.join(_TMP, "lora_continued"))


def test_lm_eval_tasks_score_an_export():
    """`lm_eval --model hf` with the repo's tasks (--include_path scripts/hf/tasks), offline: stdlib_qa's accuracy is
    a share, and stdlib_doc_bpb's bits per byte equals the model's own summed NLL / bytes / ln 2 on the same texts
    (the task measures what it says)."""
    need("lm_eval")
    from common import qa_pairs
    from transformers import AutoModelForCausalLM, AutoTokenizer
    hf, _ = sft_export()
    out, n = os.path.join(_TMP, "lm_eval"), 12
    subprocess.run([os.path.join(BIN, "lm_eval"), "--model", "hf", "--model_args", f"pretrained={hf}", "--include_path",
                    "scripts/hf/tasks", "--tasks", "stdlib_qa,stdlib_doc_bpb", "--limit", str(n), "--output_path", out],
                   capture_output=True, text=True, cwd=ROOT, timeout=600, env=HF_OFFLINE, check=True)
    results = json.load(open(glob.glob(os.path.join(out, "**", "results_*.json"), recursive=True)[0]))["results"]
    assert 0 <= results["stdlib_qa"]["acc,none"] <= 1 and 0 <= results["stdlib_qa"]["acc_norm,none"] <= 1, results
    model, tok = AutoModelForCausalLM.from_pretrained(hf).eval(), AutoTokenizer.from_pretrained(hf)
    nll = n_bytes = 0
    with torch.no_grad():
        for _, text in qa_pairs("val", n):
            ids = torch.tensor([[tok.eos_token_id] + tok(text, add_special_tokens=False)["input_ids"]])
            nll -= model(ids).logits[0, :-1].log_softmax(-1).gather(1, ids[0, 1:, None]).sum().item()
            n_bytes += len(text.encode("utf-8"))
    bpb = results["stdlib_doc_bpb"]["bits_per_byte,none"]
    assert math.isclose(bpb, nll / n_bytes / math.log(2), rel_tol=1e-4), (bpb, nll / n_bytes / math.log(2))


TESTS = [test_serve_answers_like_chat_py_and_stops_at_end_of_turn, test_dpo_moves_the_model_toward_chosen_answers,
         test_sharded_run_folder_is_refused_as_a_training_run, test_lora_merged_reimported_and_continued,
         test_lm_eval_tasks_score_an_export]

if __name__ == "__main__":
    run(TESTS)
