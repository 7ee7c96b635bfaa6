"""Supervised fine-tuning: the assistant loss mask token by token, the token-mean loss under accumulation
and DDP, packing, bad conversation lines, the SFT stage end to end (resume, chat, export).

    python scripts/test_sft.py
"""
import contextlib
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import torch

import testlib
from testlib import ROOT, run, run_script, spawn_ranks, tiny_run
from data.chat import (Conversations, PackedBatches, check_conversation, load_conversations, pack,
                       tokenize_conversation, window_tensors)
from data.sources import DataError
from data.tokenizer import save_tokenizer, train_tokenizer
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from data.dataset import IGNORE_INDEX

_TMP = testlib.scratch_dir("test_sft_")
SYSTEM = {"role": "system", "content": "Be brief."}
CONVERSATIONS = [
    [{"role": "user", "content": "What does `len` do?"}, {"role": "assistant", "content": "Return the number of items."}],
    [SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "And `abs`?"}, {"role": "assistant", "content": "\nReturn the absolute value."}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}, {"role": "user", "content": "z z"},
     {"role": "assistant", "content": " w"}],
]


def tokenizer():
    path = os.path.join(_TMP, "tok")
    if not os.path.exists(path):
        texts = ["Return the number of items in a container. Hello! absolute value of x."] * 20
        save_tokenizer(train_tokenizer(texts, vocab_size=300), path)
    from data.tokenizer import load_tokenizer
    return load_tokenizer(path)


def test_mask_is_exactly_assistant_content_and_end_of_turn():
    """Single- and multi-turn, with a system turn: the masked tokens decode to each assistant content plus
    <|im_end|>, in order; the tokens just before (the "assistant\\n" header) and after ("\\n") are not
    masked; the training tokens equal what chat renders for the prompt up to each answer."""
    tok = tokenizer()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for messages in CONVERSATIONS:
        ids, mask = tokenize_conversation(tok, messages)
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        runs, i = [], 0
        while i < len(ids):
            if mask[i]:
                j = i
                while j < len(ids) and mask[j]:
                    j += 1
                runs.append((i, j))
                i = j
            else:
                i += 1
        assert len(runs) == len(answers), (runs, answers)
        for (a, b), answer in zip(runs, answers):
            assert tok.decode(ids[a:b].tolist()) == answer + "<|im_end|>", (tok.decode(ids[a:b].tolist()), answer)
            assert ids[b - 1] == im_end and tok.decode([int(ids[a - 1])]) == "\n" and tok.decode([int(ids[b])]) == "\n"
            assert tok.decode(ids[:a].tolist()).endswith("<|im_start|>assistant\n")
        for k, (a, _) in enumerate(runs):  # chat's prompt for answer k is exactly the tokens before it
            upto = [m for m in messages][:[i for i, m in enumerate(messages) if m["role"] == "assistant"][k]]
            prompt, _ = tokenize_conversation(tok, upto, add_generation_prompt=True)
            assert prompt.tolist() == ids[:a].tolist()


def _runs(mask):
    """[(start, end)] of the runs of True in a bool array."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(np.int8), [0]))))
    return list(zip(edges[::2], edges[1::2]))


def test_answers_starting_with_whitespace_keep_their_mask():
    """Answers (and questions) starting with spaces, tabs or newlines, on the default tokenizer and on one trained
    on code: the masked tokens decode to exactly each answer + <|im_end|>, and chat's prompt is a prefix of the
    training ids. (Rendering the conversation whole and tokenizing it merged the header's "\\n" into the answer's
    leading whitespace on the default tokenizer: checked below.)"""
    import glob
    from data.prepare import prepare_data
    from model.config import MiniMindConfig
    default = prepare_data(vocab_size=MiniMindConfig.vocab_size, log=lambda *_: None)["tokenizer"]
    code = [open(f).read() for f in sorted(glob.glob(os.path.join(os.path.dirname(json.__file__), "*.py")))]
    code_tok = train_tokenizer(code * 3, vocab_size=1024)
    code_tok.chat_template = default.chat_template
    answers = ["    indented code", "\tdef f():\n\t\treturn 1", "\n\nleading newlines", "\n    x = 1", "  two", " one",
               "\r\nCRLF first", "plain"]
    merged = 0
    for name, tok in (("default", default), ("code", code_tok)):
        for a in answers:
            messages = [{"role": "user", "content": "  q"}, {"role": "assistant", "content": a},
                        {"role": "user", "content": "\n\tmore"}, {"role": "assistant", "content": a + " again"}]
            ids, mask = tokenize_conversation(tok, messages)
            runs = _runs(mask)
            got = [tok.decode(ids[s:e].tolist()) for s, e in runs]
            assert got == [a + "<|im_end|>", a + " again<|im_end|>"], (name, a, got)
            for (s, _), upto in zip(runs, (messages[:1], messages[:3])):
                prompt, _ = tokenize_conversation(tok, upto, add_generation_prompt=True)
                assert prompt.tolist() == ids[:s].tolist(), (name, a)
            if name == "default":
                whole = tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
                merged += tok.decode([t for t, m in zip(whole["input_ids"], whole["assistant_masks"]) if m]) != \
                    "".join(got)
    assert merged >= 3, f"whole-string tokenization merged only {merged} cases: the test lost its teeth"


def test_labels_shift_and_masked_labels_do_not_matter():
    """Packed labels: position t predicts token t + 1 only where t + 1 is an assistant token; changing any
    token at a masked position of the targets leaves the loss bitwise unchanged."""
    tok = tokenizer()
    conv = _conversations(tok, CONVERSATIONS)
    x, y, seg = window_tensors(conv, [[0, 1, 2]], 256, 0)
    ids = np.concatenate([conv[i][0] for i in range(3)])
    mask = np.concatenate([conv[i][1] for i in range(3)])
    for t in range(len(ids) - 1):
        last_of_conv = t + 1 in np.cumsum([len(conv[i][0]) for i in range(3)])
        want = ids[t + 1] if mask[t + 1] and not last_of_conv else IGNORE_INDEX
        assert y[0, t] == want, (t, int(y[0, t]), want)
    assert (y[0, len(ids) - 1:] == IGNORE_INDEX).all() and (seg[0, len(ids):] == -1).all()
    for cpu_engines in (False, True):  # the plain model and the trainer's (chunked LM loss: train/engines.py)
        model = _model(vocab=len(tok), cpu_engines=cpu_engines)
        loss = model(x, labels=y, segment_ids=seg).ce_loss
        y_full = torch.cat([x[:, 1:], x[:, -1:]], dim=1)
        changed = torch.where(y == IGNORE_INDEX, (y_full * 7 + 3) % len(tok), y_full)  # other targets where masked
        again = model(x, labels=torch.where(y == IGNORE_INDEX, IGNORE_INDEX, changed), segment_ids=seg).ce_loss
        assert torch.equal(loss, again), cpu_engines


def _conversations(tok, convs):
    parts = [tokenize_conversation(tok, m) for m in convs]
    lengths = [len(p[0]) for p in parts]
    return Conversations(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                         np.concatenate(([0], np.cumsum(lengths))).astype(np.int64))


def _model(vocab=300, use_moe=False, cpu_engines=False):
    """A tiny dense (or MoE) model; cpu_engines=True: built with the engines the trainer builds it with on
    CPU fp32 (train.engines.engines_for: the chunked LM loss, OneDNNLinear); the same weights either way."""
    config = MiniMindConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, use_moe=use_moe, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32)
    torch.manual_seed(0)
    if cpu_engines:
        from train.engines import engines_for
        return MiniMindForCausalLM(config, engines_for(config, "cpu", torch.float32))
    return MiniMindForCausalLM(config)


def _batch(n_supervised, seed, S=128):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 300, (1, S), generator=g)
    y = torch.full((1, S), IGNORE_INDEX)
    pos = torch.randperm(S, generator=g)[:n_supervised]
    y[0, pos] = torch.randint(0, 300, (n_supervised,), generator=g)
    return x, y


def _grads_after(model, micro_batches, n_global, world=1, grad_accum=None):
    """Gradients after train/loop.py's forward_backward on each micro-batch (a minimal Run)."""
    from train.loop import forward_backward
    fake = SimpleNamespace(args=SimpleNamespace(grad_accum=grad_accum or len(micro_batches)),
                           ctx=SimpleNamespace(world_size=world), device="cpu", autocast=contextlib.nullcontext,
                           train_model=model)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for x, y in micro_batches:
        forward_backward(fake, scaler, n_global, x, y)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(a, b, rel=2e-6):
    for k in a:
        scale = b[k].abs().max().clamp(min=1e-12)
        assert (a[k] - b[k]).abs().max() <= rel * scale, (k, float((a[k] - b[k]).abs().max() / scale))


def test_accumulation_is_a_token_mean():
    """Micro-batches with 11 and 101 supervised tokens, accumulated, give the gradient of one batch holding
    both (a mean over the 112 tokens, not a mean of the two means), 2e-6 of each gradient's largest entry
    (fp32 reassociation: two partial sums added where one batch sums at once; 1.1e-6 measured on q_norm's
    weight, whose gradient sums over every position and head); the plain model and the trainer's (built
    with its CPU engines)."""
    a, b = _batch(11, 0), _batch(101, 1)
    both = (torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]]))
    for cpu_engines in (False, True):
        _close(_grads_after(_model(cpu_engines=cpu_engines), [a, b], 112),
               _grads_after(_model(cpu_engines=cpu_engines), [both], 112))


def _ddp_rank(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP
    x, y = _batch(11, 0) if rank == 0 else _batch(101, 1)
    return _grads_after(DDP(_model(cpu_engines=True)), [(x, y)], 112, world=world)


def test_two_rank_ddp_is_the_same_token_mean():
    """The same two micro-batches on two DDP ranks (gloo) give the one-batch gradient, 2e-6 relative as
    above (the trainer's model: built with its CPU engines)."""
    a, b = _batch(11, 0), _batch(101, 1)
    want = _grads_after(_model(cpu_engines=True), [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]]))], 112)
    got = spawn_ranks(_ddp_rank, 2)
    for g in got:
        _close({k.removeprefix("module."): v for k, v in g.items()}, want)


def test_packing_keeps_conversations_apart_and_resumes():
    """A packed window gives every conversation the logits it has alone (the plain model and the one built
    with the trainer's CPU engines); PackedBatches resumes exactly."""
    tok = tokenizer()
    conv = _conversations(tok, CONVERSATIONS * 5)
    windows = pack(np.diff(conv.offsets), range(len(conv)), 160)
    assert all(sum(len(conv[i][0]) for i in w) <= 160 for w in windows) and sum(map(len, windows)) == len(conv)
    assert len(windows[0]) >= 2, "the test needs a window holding several conversations"
    x, y, seg = window_tensors(conv, windows[:1], 160, 0)
    for cpu_engines in (False, True):
        model = _model(len(tok), cpu_engines=cpu_engines).eval()
        out = model(x, segment_ids=seg).logits[0]
        pos = 0
        for i in windows[0]:
            ids = torch.from_numpy(conv[i][0])
            alone = model(ids[None]).logits[0]
            assert torch.allclose(out[pos:pos + len(ids)], alone, atol=1e-5), (cpu_engines, i)
            pos += len(ids)
    a = PackedBatches(conv, 160, 3, 0, seed=1)
    seq = [a.next() for _ in range(12)]
    b = PackedBatches(conv, 160, 3, 0, seed=1)
    for _ in range(5):
        b.next()
    c = PackedBatches(conv, 160, 3, 0, seed=1)
    c.load_state_dict(b.state_dict())
    for i in range(5, 12):
        assert all(torch.equal(u, v) for u, v in zip(c.next(), seq[i])), f"batch {i} differs after resume"


def test_bad_conversations_name_file_and_line():
    cases = {
        '{"text": "not a conversation"}': '"conversations" or "messages"',
        '{"conversations": [{"role": "user"}]}': 'needs a "role"',
        '{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}': "message 2 is a user turn",
        '{"conversations": [{"role": "user", "content": "a"}, {"role": "assistant", "content": " "}]}': "empty assistant",
        '{"conversations": [{"role": "user", "content": "a"}]}': "must end with an assistant turn",
        '{"conversations": [{"role": "assistant", "content": "a"}]}': "message 1 is a assistant turn",
        '{"conversations": [{"role": "user", "content": "a"}, {"role": "system", "content": "s"}]}': "system turn",
        '{"conversations": [{"role": "user", "content": "a"}': "malformed JSON",
        '{"conversations": [], "messages": []}': 'both "conversations" and "messages"',
    }
    good = json.dumps({"conversations": CONVERSATIONS[0]})
    for line, msg in cases.items():
        path = os.path.join(_TMP, "bad.jsonl")
        open(path, "w").write(good + "\n\n" + line + "\n")
        try:
            load_conversations(path, tokenizer(), 128, os.path.join(_TMP, "cache"))
        except DataError as e:
            assert "bad.jsonl:3" in str(e) and msg in str(e), (line, str(e))
        else:
            raise AssertionError(f"accepted: {line}")
    assert check_conversation({"messages": [SYSTEM] + CONVERSATIONS[0]}, "x")[0] == SYSTEM
    # CRLF line ends and raw U+2028 / U+0085 inside a string (json.dumps(ensure_ascii=False)): one valid line each
    odd = [{"role": "user", "content": "a\u2028b"}, {"role": "assistant", "content": "c\u0085d\u2029e\x0cf"}]
    path = os.path.join(_TMP, "crlf.jsonl")
    with open(path, "w", newline="\r\n") as f:
        f.write(json.dumps({"messages": odd}, ensure_ascii=False) + "\n" + good + "\n")
    conv = load_conversations(path, tokenizer(), 128, os.path.join(_TMP, "cache"))
    assert len(conv) == 2 and tokenizer().decode(conv[0][0][conv[0][1]].tolist()) == odd[1]["content"] + "<|im_end|>"


def test_long_conversations_are_cut_to_the_window():
    path = os.path.join(_TMP, "long.jsonl")
    long = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! " * 80}]
    with open(path, "w") as f:
        for conv in (CONVERSATIONS[0], long):
            f.write(json.dumps({"conversations": conv}) + "\n")
    notes = []
    conv = load_conversations(path, tokenizer(), 64, os.path.join(_TMP, "cache"), log=notes.append)
    assert (conv.truncated, len(conv), max(np.diff(conv.offsets))) == (1, 2, 64), (conv.truncated, np.diff(conv.offsets))
    assert len(notes) == 1 and "1 cut to it" in notes[0] and "long.jsonl" in notes[0], notes


def test_held_out_split_keeps_copies_in_training_and_says_what_it_cut():
    """--data_path without --val_path: a held-out conversation that also appears in training stays in training
    (so the held-out loss is on unseen text), and the note on cut conversations prints (it was lost when the
    split rebuilt the set)."""
    from train.sft import held_out_split
    path = os.path.join(_TMP, "split.jsonl")
    convs = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"answer {i}"}] for i in range(40)]
    convs[19] = convs[3]  # a copy at a held-out position (every 20th: 19, 39)
    convs[39] = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! " * 80}]
    with open(path, "w") as f:
        f.writelines(json.dumps({"conversations": c}) + "\n" for c in convs)
    notes = []
    train, val = held_out_split(load_conversations(path, tokenizer(), 64, os.path.join(_TMP, "cache"),
                                                   log=notes.append), path, notes.append)
    assert (len(train), len(val)) == (39, 1), (len(train), len(val))
    assert any("1 cut to it" in n for n in notes) and any("kept in training only" in n for n in notes), notes
    train_ids = {train[i][0].tobytes() for i in range(len(train))}
    assert all(val[i][0].tobytes() not in train_ids for i in range(len(val)))


def cli(*argv, script="train/sft.py"):
    """The script run to its end in this process (testlib.run_script): exit code, stdout, stderr."""
    return run_script(script, *argv, cwd=_TMP)


def pretrained():
    return tiny_run()


def test_sft_stage_trains_resumes_bitwise_and_chats():
    """train/sft.py from a pretrained run on the embedded set: the held-out loss drops; stopped after 4 steps
    and resumed, it ends bitwise equal to the uninterrupted run; chat.py answers a one-shot prompt and keeps
    the history over scripted stdin."""
    pre = pretrained()
    common = ["--init_from", pre, "--max_steps", "8", "--seq_len", "128", "--eval_interval", "8", "--sample_tokens", "0",
              "--learning_rate", "3e-3", "--warmup_steps", "2", "--batch_size", "4", "--no_progress"]
    full, part = os.path.join(_TMP, "sft_full"), os.path.join(_TMP, "sft_part")
    r = cli(*common, "--out_dir", full)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "embedded stdlib Q&A set" in r.stdout, r.stdout
    final, first = map(float, re.search(r"final val loss ([\d.]+) .*vs step-0 ([\d.]+)", r.stdout).groups())
    assert final < first - 0.05, f"the held-out loss did not drop: {first} -> {final}"
    assert cli(*common, "--out_dir", part, "--stop_after", "4").returncode == 0
    r = cli(*common[:2], "--resume", "--out_dir", part)
    assert r.returncode == 0, r.stderr[-3000:]
    from train.checkpoint import load_checkpoint
    a, b = load_checkpoint(full)["model"], load_checkpoint(part)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed SFT run differs from the uninterrupted one"
    r = cli("--ckpt", full, "--prompt", "What does os.path.join do?", "--max_new_tokens", "8", script="scripts/chat.py")
    assert r.returncode == 0 and r.stdout.strip(), r.stderr[-2000:]
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from chat import Chat
    from data.tokenizer import load_tokenizer
    from train.checkpoint import model_from_checkpoint
    model, tok = model_from_checkpoint(load_checkpoint(full)).eval(), load_tokenizer(os.path.join(full, "tokenizer"))
    args = SimpleNamespace(system=None, max_new_tokens=5, temperature=0.0, top_k=0, top_p=1.0, seed=0)
    chat = Chat(model, tok, args, "cpu", out=open(os.devnull, "w"))
    with torch.no_grad(), contextlib.redirect_stdout(open(os.devnull, "w")):
        first = chat.ask("What does `len` do?")
        chat.ask("And `abs`?")
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "user", "assistant"]
    assert chat.messages[1]["content"] == first.strip() and chat.messages[2]["content"] == "And `abs`?"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "chat.py"), "--ckpt", full, "--max_new_tokens", "4"],
                       input="hello\n/reset\nagain\n/quit\nnever asked\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and len([l for l in r.stdout.splitlines() if l.strip()]) >= 1, r.stderr[-2000:]


def test_user_tools_end_bad_input_in_one_line():
    """generate.py / chat.py: a --prompt that is not UTF-8, a prompt longer than the context, export_hf.py --out a
    regular file: one "error:" line, exit 2; chat.py reading bytes that are not UTF-8 under a strict UTF-8 stdin
    answers (U+FFFD); Ctrl-C while generate.py streams keeps what it printed and exits 130, no traceback."""
    import signal
    import time
    pre = pretrained()
    tools = {name: [sys.executable, os.path.join(ROOT, "scripts", name)] for name in ("generate.py", "chat.py")}
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    for name in ("generate.py", "chat.py"):
        # in this process, the prompt's bytes as Python's start-up decodes a command line (surrogateescape)
        for prompt, needle in ((b"caf\xe9 \xff", "--prompt: not valid UTF-8"), (b"the " * 3000, "context")):
            r = cli("--ckpt", pre, "--prompt", os.fsdecode(prompt), script=f"scripts/{name}")
            err = r.stderr.strip().splitlines()
            assert r.returncode == 2 and needle in err[-1] and not any("Traceback" in e for e in err), \
                (name, prompt[:20], r.returncode, err[-5:])
    r = subprocess.run(tools["chat.py"] + ["--ckpt", pre, "--max_new_tokens", "3"], input=b"\xff\xfe bytes\n/quit\n",
                       capture_output=True, timeout=300, env=env)
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr[-2000:]
    for seed in range(8):  # a sample of the tiny model may reach its stop token before the interrupt: another seed
        proc = subprocess.Popen(tools["generate.py"] + ["--ckpt", pre, "--prompt", "the", "--max_new_tokens", "100000",
                                                        "--no_cache", "--seed", str(seed)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                # a shell's background job starts with SIGINT ignored, and Python then keeps it so
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        first = proc.stdout.read(3)  # the streamed prompt: generation is under way
        time.sleep(1.0)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        if proc.returncode != 0:  # 0: the sample ended on its own, before or just as the signal was sent
            break
    assert proc.returncode == 130 and b"Traceback" not in err and (first + out).startswith(b"the"), (proc.returncode, err)
    afile = os.path.join(_TMP, "not_a_folder")
    open(afile, "w").write("x")
    r = cli("--ckpt", pre, "--out", afile, script="scripts/export_hf.py")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: ") and "Traceback" not in r.stderr


def test_exported_sft_model_chats_through_the_hf_pipeline():
    """export_hf.py on an SFT checkpoint: the folder's tokenizer has the chat template, generation_config
    stops at <|im_end|>, and transformers.pipeline answers a list of messages (a model made to end its turn
    at once must stop there, not run to max_new_tokens)."""
    from transformers import pipeline
    pre = pretrained()
    out = os.path.join(_TMP, "sft_export_src")
    r = cli("--init_from", pre, "--max_steps", "2", "--seq_len", "128", "--sample_tokens", "0", "--out_dir", out,
            "--batch_size", "4", "--no_progress")
    assert r.returncode == 0, r.stderr[-3000:]
    hf = os.path.join(_TMP, "sft_hf")
    r = cli("--ckpt", out, "--out", hf, script="scripts/export_hf.py")
    assert r.returncode == 0 and "parity" in r.stdout, r.stderr[-3000:]
    gen = json.load(open(os.path.join(hf, "generation_config.json")))
    pipe = pipeline("text-generation", model=hf)
    im_end = pipe.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in gen["eos_token_id"] and "{% generation %}" in pipe.tokenizer.chat_template
    messages = [{"role": "user", "content": "What does `len` do?"}]
    reply = pipe(messages, max_new_tokens=6, do_sample=False)[0]["generated_text"]
    assert reply[:-1] == messages and reply[-1]["role"] == "assistant", reply
    ids = pipe.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
    with torch.no_grad():  # a head whose only non-zero logit is <|im_end|>'s at the prompt's end: stop at once
        h = pipe.model.model(ids).last_hidden_state[0, -1]
        head = torch.zeros_like(pipe.model.lm_head.weight)
        head[im_end] = 10 * h / h.square().sum()
        pipe.model.lm_head.weight = torch.nn.Parameter(head)  # (untied from the embedding)
        out = pipe.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 1 and out[0, -1] == im_end, out


TESTS = [test_mask_is_exactly_assistant_content_and_end_of_turn, test_answers_starting_with_whitespace_keep_their_mask,
         test_labels_shift_and_masked_labels_do_not_matter,
         test_accumulation_is_a_token_mean, test_two_rank_ddp_is_the_same_token_mean,
         test_packing_keeps_conversations_apart_and_resumes, test_bad_conversations_name_file_and_line,
         test_long_conversations_are_cut_to_the_window, test_held_out_split_keeps_copies_in_training_and_says_what_it_cut,
         test_sft_stage_trains_resumes_bitwise_and_chats,
         test_user_tools_end_bad_input_in_one_line, test_exported_sft_model_chats_through_the_hf_pipeline]

if __name__ == "__main__":
    run(TESTS)
