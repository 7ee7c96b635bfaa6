"""The torchtitan handoff (scripts/export_torchtitan.py) against torchtitan 0.3.0 itself, run in its own venv:
its model loaded from the generated folder computes our logits, torchtitan's HF save comes back through
import_hf.py unchanged, and the folder's command passes torchtitan's config parser with its mesh built on the
fake backend. The tests that need torchtitan skip where it is not installed, naming what is missing; the
export-side checks (the refusals, what the generated flavor module's source holds) run without it.

    python scripts/test_torchtitan.py
    TORCHTITAN_PYTHON=/path/to/venv/bin/python python scripts/test_torchtitan.py

torchtitan's venv: `.venv-torchtitan` in the repository (what `.ci/run` makes: `pip install -r
scripts/torchtitan-requirements.txt`), or the interpreter TORCHTITAN_PYTHON names.
"""
import json
import os
import shutil
import subprocess
import sys

import torch

import testlib
from testlib import run

_TMP = testlib.scratch_dir("test_torchtitan_")
TOKENS = (2, 48)  # sequences x tokens of the parity check

# Runs in torchtitan's venv: the generated flavor built and loaded from hf/ through torchtitan's own adapter;
# logits with its stock experts (bf16 grouped GEMMs) and with the experts' same math in fp32 (a loop, as
# torchtitan's GroupedExperts casts to bf16); then its HF save of the loaded weights.
CHILD = r'''
import json, os, sys
import torch, torch.nn.functional as F
from safetensors.torch import load_file, save_file
folder, out = sys.argv[1], sys.argv[2]
sys.path.insert(0, folder)
import minimind_tt
spec = minimind_tt.minimind_model_spec("flex")
model = spec.model.build()
model.init_states(buffer_device=torch.device("cpu"))
model.eval()
adapter = spec.state_dict_adapter(spec.model, minimind_tt.HF)
missing, unexpected = model.load_state_dict(adapter.from_hf(load_file(os.path.join(minimind_tt.HF, "model.safetensors"))), strict=False)
tokens = torch.load(os.path.join(out, "tokens.pt"))
positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand(tokens.shape[0], -1).contiguous()
masks = model.get_attention_masks(positions)
logits = {}
with torch.no_grad():
    logits["stock"] = model(tokens, positions=positions, attention_masks=masks).float()
    from torchtitan.models.common.moe import GroupedExperts
    def fp32_experts(self, x, counts):
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            xe = x[start:start + n]; start += n
            outs.append((F.silu(xe @ self.w1_EFD[e].T) * (xe @ self.w3_EFD[e].T)) @ self.w2_EDF[e].T)
        return torch.cat(outs, 0)
    GroupedExperts.forward = fp32_experts
    logits["fp32"] = model(tokens, positions=positions, attention_masks=masks).float()
torch.save(logits, os.path.join(out, "logits.pt"))
hf = adapter.to_hf({k: v.detach() for k, v in model.state_dict().items()})
save_file({k: v.contiguous() for k, v in hf.items()}, os.path.join(out, "model.safetensors"))
json.dump({"missing": list(missing), "unexpected": list(unexpected)}, open(os.path.join(out, "load.json"), "w"))
'''

# Runs in torchtitan's venv: the folder's torchrun arguments through torchtitan's ConfigManager, then the
# trainer's process group and mesh on the fake backend for EP=4 x FSDP=8 (no GPU needed).
PARSE = r'''
import os, sys
folder, args = sys.argv[1], sys.argv[2:]
sys.path.insert(0, folder)
os.environ.update(NGPU="8", RANK="0", WORLD_SIZE="8")
from torchtitan.config import ConfigManager
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.parallel_dims import ParallelDims
config = ConfigManager().parse_args(args + ["--comm.mode", "fake_backend"])
world = dist_utils.init_distributed(config.comm)
dims = ParallelDims.from_config(config.parallelism, world)
mesh = dims.build_mesh()
print("mesh", world, dims.dp_shard, dims.ep, "ep mesh", tuple(dims.get_mesh("ep").shape))
'''


# Runs in torchtitan's venv: minimind_sft's loader over our chat format (a system turn, several exchanges)
SFT = r'''
import os, sys
folder = sys.argv[1]
sys.path.insert(0, folder)
import minimind_tt
from datasets import load_dataset
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.hf_datasets.text_datasets import ChatDataset
loader = minimind_tt.minimind_sft().dataloader
dataset = ChatDataset(load_dataset(loader.dataset_path, **loader.load_dataset_kwargs),
                      HuggingFaceTokenizer(tokenizer_path=minimind_tt.HF), loader.sample_processor, seq_len=64)
print("sft windows with supervised tokens", sum(1 for _, (_, labels) in zip(range(3), dataset) if (labels != -100).any()))
'''


def torchtitan_python():
    return testlib.venv_python("TORCHTITAN_PYTHON", ".venv-torchtitan", "torchtitan.models.qwen3",
                               "pip install -r scripts/torchtitan-requirements.txt in .venv-torchtitan")


def handed_folder():
    """The tiny pretrained run handed to torchtitan (once per script)."""
    out = os.path.join(_TMP, "tt")
    if not os.path.exists(out):
        r = testlib.run_script("scripts/export_torchtitan.py", "--ckpt", testlib.tiny_run(), "--out", out,
                               "--ep", "4", "--fsdp", "8")
        assert r.returncode == 0, r.stderr
    return out


def test_torchtitan_computes_our_logits_and_saves_our_weights():
    """torchtitan's model from the generated folder: logits within 1e-4 of ours with fp32 experts, the same
    argmax with its stock bf16 experts; its HF save holds the exported tensors bitwise, and import_hf.py makes
    it a checkpoint of ours computing the same logits (the export folded the routed scaling into down_proj, so
    those tensors are k x ours: the function is what round-trips)."""
    from train.checkpoint import load_checkpoint, model_from_checkpoint
    python, folder = torchtitan_python(), handed_folder()
    ckpt = load_checkpoint(testlib.tiny_run())
    ours = model_from_checkpoint(ckpt).eval()
    work = os.path.join(_TMP, "child")
    os.makedirs(work, exist_ok=True)
    tokens = torch.randint(1, ours.config.vocab_size, TOKENS, generator=torch.Generator().manual_seed(0))
    torch.save(tokens, os.path.join(work, "tokens.pt"))
    r = subprocess.run([python, "-c", CHILD, folder, work], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    load = json.load(open(os.path.join(work, "load.json")))
    assert not load["unexpected"] and all("expert_bias" in k or "tokens_per_expert" in k for k in load["missing"]), load
    theirs = torch.load(os.path.join(work, "logits.pt"))
    with torch.no_grad():
        mine = ours(tokens).logits.float()
    fp32_diff = float((theirs["fp32"] - mine).abs().max())
    agree = float((theirs["stock"].argmax(-1) == mine.argmax(-1)).float().mean())
    print(f"        fp32 experts: max |logit diff| {fp32_diff:.2e}; stock bf16 experts: "
          f"{float((theirs['stock'] - mine).abs().max()):.2e}, argmax agrees on {agree:.1%} of tokens")
    assert fp32_diff <= 1e-4 and agree == 1.0
    # back: torchtitan's HF save holds the exported tensors bit for bit, and import_hf.py makes it our model
    from safetensors.torch import load_file
    exported, saved = (load_file(os.path.join(d, "model.safetensors")) for d in (os.path.join(folder, "hf"), work))
    assert sorted(exported) == sorted(saved) and all(torch.equal(exported[k], saved[k]) for k in exported)
    back = os.path.join(_TMP, "back_hf")
    shutil.copytree(os.path.join(folder, "hf"), back)
    shutil.copyfile(os.path.join(work, "model.safetensors"), os.path.join(back, "model.safetensors"))
    r = testlib.run_script("scripts/import_hf.py", "--hf", back, "--out", os.path.join(_TMP, "imported"))
    assert r.returncode == 0, r.stderr
    with torch.no_grad():
        again = model_from_checkpoint(load_checkpoint(os.path.join(_TMP, "imported"))).eval()(tokens).logits
    assert float((again - mine).abs().max()) <= 1e-4


def test_command_parses_and_the_mesh_builds():
    """The folder's pretrain and SFT commands, as torchtitan's config parser takes them; the mesh for EP=4 x
    FSDP=8 built on the fake backend; the SFT loader on conversations of ours (system turn, two exchanges)."""
    python, folder = torchtitan_python(), handed_folder()
    for config in ("minimind_pretrain", "minimind_sft"):
        line = [ln for ln in open(os.path.join(folder, "COMMAND.txt")) if f"--config {config} " in ln][0]
        args = line.split("-m torchtitan.train", 1)[1].split()
        r = subprocess.run([python, "-c", PARSE, folder, *args], capture_output=True, text=True, cwd=folder)
        assert r.returncode == 0, r.stderr[-3000:]
        said = [ln for ln in r.stdout.splitlines() if ln.startswith("mesh ")]
        print(f"        {config}: {said}")
        assert said and said[0].startswith("mesh 8 8 4"), r.stdout[-2000:]
    chats = os.path.join(_TMP, "chats.jsonl")
    with open(chats, "w") as f:
        for i in range(3):
            turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Question {i}?"},
                     {"role": "assistant", "content": "An answer."}, {"role": "user", "content": "And then?"},
                     {"role": "assistant", "content": f"Then {i}."}]
            f.write(json.dumps({"conversations": turns}) + "\n")
    r = subprocess.run([python, "-c", SFT, folder], capture_output=True, text=True,
                       env=dict(os.environ, MINIMIND_SFT_JSONL=chats))
    said = [ln for ln in r.stdout.splitlines() if ln.startswith("sft windows")]
    assert r.returncode == 0 and said and int(said[0].split()[-1]) >= 1, r.stdout[-1000:] + r.stderr[-3000:]


SCHEDULE = r'''
import sys
sys.path.insert(0, sys.argv[1])
import minimind_tt
pre, sft = minimind_tt.minimind_pretrain(), minimind_tt.minimind_sft()
print("schedule", pre.training.steps, sft.training.steps, pre.checkpoint.interval, sft.checkpoint.interval,
      pre.dataloader.dataset)
'''


def scheduled_folder():
    """The tiny pretrained run exported with --steps 7 --sft_steps 3 --checkpoint_interval 5 --dataset c4_test (once
    per script)."""
    out = os.path.join(_TMP, "scheduled")
    if not os.path.exists(out):
        r = testlib.run_script("scripts/export_torchtitan.py", "--ckpt", testlib.tiny_run(), "--out", out,
                               "--steps", "7", "--sft_steps", "3", "--checkpoint_interval", "5", "--dataset", "c4_test")
        assert r.returncode == 0, r.stderr
    return out


def test_schedule_flags_and_public_names_only():
    """The export side, no torchtitan needed: --steps, --sft_steps, --checkpoint_interval and --dataset are written into
    the flavor module's configs (the literal keyword values in its source: minimind_pretrain's steps 7 and dataset
    c4_test, minimind_sft's steps 3, the checkpoint interval 5); a dataset torchtitan does not register, a step count
    below 1: one error line, no folder; the flavor module imports only torchtitan's public names (no `_`-prefixed
    ones). (That torchtitan's own config builders take those values: test_schedule_reaches_torchtitans_configs.)"""
    import ast
    out = scheduled_folder()
    r = testlib.run_script("scripts/export_torchtitan.py", "--ckpt", testlib.tiny_run(), "--out", out + "_bad",
                           "--dataset", 'c4"""')
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: ") and not os.path.exists(out + "_bad")
    r = testlib.run_script("scripts/export_torchtitan.py", "--ckpt", testlib.tiny_run(), "--out", out + "_steps",
                           "--steps", "0")
    assert r.returncode == 2 and "--steps must be" in r.stderr and not os.path.exists(out + "_steps"), r.stderr
    tree = ast.parse(open(os.path.join(out, "minimind_tt.py")).read())
    written = {(f.name, k.arg): k.value.value for f in tree.body if isinstance(f, ast.FunctionDef)
               for node in ast.walk(f) if isinstance(node, ast.Call)
               for k in node.keywords if isinstance(k.value, ast.Constant)}
    want = {("minimind_pretrain", "steps"): 7, ("minimind_pretrain", "dataset"): "c4_test",
            ("minimind_sft", "steps"): 3, ("_trainer", "interval"): 5}
    assert {key: written.get(key) for key in want} == want, {key: written.get(key) for key in want}
    private = [a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module.startswith("torchtitan")
               for a in node.names if a.name.startswith("_")]
    assert not private, private


def test_schedule_reaches_torchtitans_configs():
    """In torchtitan's venv: the configs torchtitan builds from the scheduled folder's flavor module carry --steps,
    --sft_steps, --checkpoint_interval and --dataset."""
    python, out = torchtitan_python(), scheduled_folder()
    r = subprocess.run([python, "-c", SCHEDULE, out], capture_output=True, text=True)
    assert r.returncode == 0 and "schedule 7 3 5 5 c4_test" in r.stdout, r.stdout[-1000:] + r.stderr[-3000:]


def test_inexpressible_model_is_one_error_line():
    """Shared experts, --ep not dividing --fsdp or the experts, a routing-bias rate of 0: one `error:` line
    naming it, exit 2, nothing written."""
    shared = os.path.join(_TMP, "shared_run")
    r = testlib.run_script("train/pretrain.py", *testlib.TINY_RUN_FLAGS, "--max_steps", "1", "--n_shared_experts", "1",
                           "--out_dir", shared)
    assert r.returncode == 0, r.stderr
    out = os.path.join(_TMP, "refused")
    r = testlib.run_script("scripts/export_torchtitan.py", "--ckpt", shared, "--out", out)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "n_shared_experts" in lines[0], r.stderr
    assert not os.path.exists(out)
    for flags, said in ((["--ep", "3"], "--ep 3 must divide --fsdp 8"), (["--load_balance_coeff", "0"], "must be > 0"),
                        (["--ep", "8"], "must divide the model's 4 experts")):
        r = testlib.run_script("scripts/export_torchtitan.py", "--ckpt", testlib.tiny_run(), "--out", out, *flags)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and said in lines[0], (flags, r.stderr)
        assert not os.path.exists(out)


TESTS = [test_inexpressible_model_is_one_error_line, test_schedule_flags_and_public_names_only,
         test_torchtitan_computes_our_logits_and_saves_our_weights, test_command_parses_and_the_mesh_builds,
         test_schedule_reaches_torchtitans_configs]

if __name__ == "__main__":
    run(TESTS)
