"""Hand a run to torchtitan (FSDP2, TP, CP, PP, EP, fp8, many nodes): a folder torchtitan 0.3.0 trains from
unedited.

    python scripts/export_torchtitan.py --ckpt checkpoints/sft --out exports/minimind-tt [--ep 4 --fsdp 8]
    cd exports/minimind-tt && cat COMMAND.txt        # the torchrun command (CUDA: torchtitan trains on GPUs)

The folder holds hf/ (export_hf.py's Qwen3 / Qwen3-MoE export, logits checked, with a chat template without
transformers' {% generation %} tags, which torchtitan's tokenizer rejects), minimind_tt.py (the model as a
torchtitan Qwen3 flavor: tied embeddings, q/k norm, RoPE theta, softmax top-k with norm_topk_prob as
route_norm, the routed scaling already folded into the experts' down projections by the export; and the
trainer configs `minimind_pretrain` / `minimind_sft`, which load hf/ at step 0 and save in HF format; built
from torchtitan's public config builders, their steps, checkpoint interval and dataset from --steps,
--sft_steps, --checkpoint_interval and --dataset), and COMMAND.txt. Routing balance: torchtitan's learned
routing bias (load_balance_coeff) is off, since a Qwen3-MoE folder cannot hold it (its exports would route
otherwise than it trained); --load_balance_coeff turns it on. torchtitan has none of our router losses or
capacity limits: those the run used are named in a warning.
Back again: torchtitan's last checkpoint (HF format, in its dump folder) -> scripts/import_hf.py (the chat
template then lacks the generation tags; train/sft.py masks by its own ChatML rule). torchtitan's SFT loader
takes one exchange per row: minimind_sft trains on each conversation's last.
A model torchtitan's Qwen3 cannot express (shared experts, another RMSNorm eps) is one `error:` line.
"""
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.atomic import atomic_dir  # noqa: E402
from model.config import MiniMindConfig  # noqa: E402
from model.hf_adapter import ExportError, check_exportable  # noqa: E402
from train.checkpoint import load_checkpoint  # noqa: E402
from train.run_dir import run_tokenizer  # noqa: E402
from train.flags import AT_LEAST_1, Parser, add, run_tool  # noqa: E402

TORCHTITAN_EPS = 1e-6  # torchtitan's Qwen3 RMSNorm eps (models/qwen3: _EPS), fixed


def check_expressible(config, ep, fsdp, load_balance_coeff):
    """Raise ExportError naming the fields torchtitan 0.3.0's Qwen3 cannot express (after export_hf's own
    refusals) and the flags that do not fit the model."""
    check_exportable(config)
    if ep < 1 or fsdp < 1:
        raise ExportError(f"--ep {ep} and --fsdp {fsdp} must be >= 1")
    if fsdp % ep:
        raise ExportError(f"--ep {ep} must divide --fsdp {fsdp} (torchtitan's EP borrows FSDP's ranks)")
    if config.use_moe and config.num_experts % ep:
        raise ExportError(f"--ep {ep} must divide the model's {config.num_experts} experts")
    if not config.use_moe and ep > 1:
        raise ExportError(f"--ep {ep}: a dense model has no experts to shard; use --ep 1")
    if load_balance_coeff is not None and not (math.isfinite(load_balance_coeff) and load_balance_coeff > 0):
        raise ExportError(f"--load_balance_coeff must be > 0 (or left out: off), got {load_balance_coeff}")
    bad = []
    if config.use_moe and config.n_shared_experts:
        bad.append(f"n_shared_experts={config.n_shared_experts} (its Qwen3 MoE has no shared experts)")
    if config.rms_norm_eps != TORCHTITAN_EPS:
        bad.append(f"rms_norm_eps={config.rms_norm_eps} (its Qwen3 fixes {TORCHTITAN_EPS})")
    if bad:
        raise ExportError(f"cannot hand to torchtitan: {'; '.join(bad)}")


def untrained_settings(config):
    """The MoE training settings of `config` that torchtitan's MoE lacks (named in a warning)."""
    active = {"router_aux_loss_coef": config.router_aux_loss_coef, "router_z_loss_coef": config.router_z_loss_coef,
              "router_dtype": config.router_dtype}  # (capacity and the aux-free bias: the HF export refuses them)
    return [f"{name}={value}" for name, value in active.items() if config.use_moe and value]


def flavor_module(config, args_of_run, source, load_balance_coeff, schedule):
    """The text of minimind_tt.py for `config` (a MiniMindConfig), the run's flags (lr, seq_len, batch, warmup)
    and `schedule` (dict: steps, sft_steps, checkpoint_interval, dataset)."""
    return TEMPLATE.format(
        source=source, dim=config.hidden_size, vocab=config.vocab_size, layers=config.num_hidden_layers,
        head_dim=config.head_dim or config.hidden_size // config.num_attention_heads, heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads, tie=bool(config.tie_word_embeddings),
        max_seq=config.max_position_embeddings, theta=float(config.rope_theta), moe=bool(config.use_moe),
        experts=config.num_experts, top_k=config.num_experts_per_tok, route_norm=bool(config.norm_topk_prob),
        lb=load_balance_coeff,
        ffn=config.moe_intermediate_size if config.use_moe else config.intermediate_size,
        lr=args_of_run.get("learning_rate", 1e-4), seq_len=args_of_run.get("seq_len", 512),
        batch=args_of_run.get("batch_size", 8), warmup=args_of_run.get("warmup_steps", 50), **schedule)


# (torchtitan's public config builders; its Qwen3 flavors' own helpers are private)
TEMPLATE = '''"""torchtitan 0.3.0 flavor of a minimind-moe run ({source}), written by scripts/export_torchtitan.py.
Configs: minimind_pretrain (a dataset torchtitan registers, streamed from the HF hub; other text through its
--dataloader.dataset / --dataloader.dataset_path), minimind_sft (MINIMIND_SFT_JSONL: our chat jsonl,
{{"conversations": [...]}} or {{"messages": [...]}} per line, each row's last exchange). Both load hf/ at step 0."""
import os
from functools import partial

from torch import nn
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.optimizer import default_adamw, LRSchedulersContainer, register_moe_load_balancing_hook
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.hf_datasets.text_datasets import ChatDataLoader, HuggingFaceTextDataLoader
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.config_utils import (get_attention_config, make_ffn_config, make_gqa_config,
                                                   make_moe_config, make_routed_experts_config, make_router_config)
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.common.param_init import skip_param_init
from torchtitan.models.qwen3 import parallelize_qwen3
from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

HF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf")
DIM, HEAD_DIM, VOCAB, FFN = {dim}, {head_dim}, {vocab}, {ffn}
NORMAL = {{"weight": partial(nn.init.normal_, std=0.02)}}  # (every weight is then loaded from hf/)


def norm(dim):
    return RMSNorm.Config(normalized_shape=dim, eps=1e-6, param_init={{"weight": nn.init.ones_}})


def block(attn_backend, rope):
    """One decoder block: Qwen3's GQA with q/k norm, then the MoE (or, for a dense run, the SwiGLU)."""
    attention = make_gqa_config(dim=DIM, n_heads={heads}, n_kv_heads={kv_heads}, head_dim=HEAD_DIM, fuse_qkv=True,
                                wqkv_param_init=NORMAL, wo_param_init=NORMAL, rope=rope, qk_norm=norm(HEAD_DIM),
                                inner_attention=get_attention_config(attn_backend))
    if not {moe}:
        return Qwen3TransformerBlock.Config(attention_norm=norm(DIM), ffn_norm=norm(DIM), attention=attention,
                                            feed_forward=make_ffn_config(dim=DIM, hidden_dim=FFN, w1_param_init=NORMAL,
                                                                         w2w3_param_init=NORMAL))
    router = make_router_config(dim=DIM, num_experts={experts}, gate_param_init=NORMAL, top_k={top_k},
                                score_func="softmax", route_norm={route_norm})  # route_norm: norm_topk_prob
    experts = make_routed_experts_config(dim=DIM, hidden_dim=FFN, num_experts={experts}, top_k={top_k},
                                         comm_backend="standard",
                                         param_init=dict.fromkeys(("w1_EFD", "w2_EDF", "w3_EFD"), NORMAL["weight"]))
    moe = make_moe_config(num_experts={experts}, router=router, routed_experts=experts,
                          load_balance_coeff={lb!r})  # (see COMMAND.txt)
    return Qwen3TransformerBlock.Config(attention_norm=norm(DIM), ffn_norm=norm(DIM), attention=attention, moe=moe)


def minimind_model_config(attn_backend="flex"):
    rope = CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len={max_seq}, theta={theta})
    return Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=norm(DIM), enable_weight_tying={tie},
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init={{"weight": skip_param_init}}),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=NORMAL),
        layers=[block(attn_backend, rope) for _ in range({layers})])


def minimind_model_spec(attn_backend="flex"):
    return ModelSpec(name="qwen3", flavor="minimind", model=minimind_model_config(attn_backend),
                     parallelize_fn=parallelize_qwen3, pipelining_fn=pipeline_llm,
                     post_optimizer_build_fn=register_moe_load_balancing_hook if {moe} else None,
                     state_dict_adapter=Qwen3StateDictAdapter)


def _trainer(dataloader, steps):
    spec = minimind_model_spec()
    return Trainer.Config(
        model_spec=spec, hf_assets_path=HF,
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=VOCAB)),
        dataloader=dataloader, optimizer=default_adamw(lr={lr}),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps={warmup}, decay_type="cosine", min_lr_factor=0.1),
        training=TrainingConfig(local_batch_size={batch}, seq_len={seq_len}, steps=steps),
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1, expert_parallel_degree=1),
        checkpoint=CheckpointManager.Config(enable=True, initial_load_path=HF, initial_load_in_hf=True,
                                            initial_load_model_only=True, last_save_in_hf=True,
                                            interval={checkpoint_interval}))


def minimind_pretrain():
    return _trainer(HuggingFaceTextDataLoader.Config(dataset={dataset!r}), steps={steps})


def last_exchange(row):
    """torchtitan 0.3.0's ChatDataset takes one [user, assistant] exchange: a conversation's last one (its system
    turn and earlier turns are dropped)."""
    turns = [t for t in (row.get("conversations") or row["messages"]) if t["role"] in ("user", "assistant")]
    return [{{"role": t["role"], "content": t["content"]}} for t in turns[-2:]]


def minimind_sft():
    data = os.environ.get("MINIMIND_SFT_JSONL", "sft.jsonl")
    return _trainer(ChatDataLoader.Config(dataset_path="json",
                                          load_dataset_kwargs={{"data_files": data, "split": "train"}},
                                          sample_processor=last_exchange), steps={sft_steps})
'''


def command(config_name, ep, fsdp):
    """The torchrun command that trains the folder (run inside it)."""
    flags = [f"--parallelism.data_parallel_shard_degree {fsdp}", f"--parallelism.expert_parallel_degree {ep}"]
    flags += ["--training.disable_cuda_graphs"] if ep > 1 else []
    return (f"PYTHONPATH=. torchrun --nproc_per_node {fsdp} -m torchtitan.train --module minimind_tt "
            f"--config {config_name} " + " ".join(flags))


OWN_FILES = {"hf", "minimind_tt.py", "COMMAND.txt", "__pycache__"}  # (torchtitan writes outputs/ beside them)


SCHEDULE = dict(steps=1000, sft_steps=300, checkpoint_interval=500, dataset="c4")  # the flags' defaults


def export(ckpt_path, out_dir, ep=1, fsdp=1, load_balance_coeff=None, tokenizer_dir=None, log=print, force=False,
           schedule=SCHEDULE):
    """Write the torchtitan folder at out_dir; `schedule` as SCHEDULE (the configs' steps, checkpoint interval
    and pretraining dataset). Raises ExportError / ValueError / FileNotFoundError (one line) before anything is
    written."""
    from export_hf import check_out, export as export_hf
    ckpt = load_checkpoint(ckpt_path, weights=False)
    config = MiniMindConfig.from_dict(ckpt["config"])
    check_expressible(config, ep, fsdp, load_balance_coeff)
    check_out(out_dir, force, marker="minimind_tt.py", own=OWN_FILES)
    run_tokenizer(ckpt_path, tokenizer_dir)  # (found now, not after the weights)
    missing = untrained_settings(config)
    if missing:
        log(f"warning: torchtitan trains without {', '.join(missing)}: its MoE has no router aux / z loss, "
            f"capacity or aux-free bias of ours")
    with atomic_dir(out_dir) as tmp:
        export_hf(ckpt_path, os.path.join(tmp, "hf"), tokenizer_dir=tokenizer_dir,
                  log=lambda line: log(line.replace(tmp, out_dir)))
        template = os.path.join(tmp, "hf", "chat_template.jinja")
        if os.path.exists(template):  # torchtitan's jinja environment has no {% generation %} extension
            with open(template, encoding="utf-8") as f:
                text = re.sub(r"{%-?\s*(end)?generation\s*-?%}", "", f.read())
            with open(template, "w", encoding="utf-8") as f:
                f.write(text)
        with open(os.path.join(tmp, "minimind_tt.py"), "w", encoding="utf-8") as f:
            f.write(flavor_module(config, ckpt.get("args") or {}, os.path.abspath(ckpt_path), load_balance_coeff,
                                  schedule))
        with open(os.path.join(tmp, "COMMAND.txt"), "w", encoding="utf-8") as f:
            f.write(f"# in this folder, with torchtitan==0.3.0 installed, on {fsdp} GPUs:\n"
                    f"{command('minimind_pretrain', ep, fsdp)}\n"
                    f"MINIMIND_SFT_JSONL=<your chat jsonl> {command('minimind_sft', ep, fsdp)}\n"
                    f"# load_balance_coeff={load_balance_coeff!r}: torchtitan's routing bias "
                    f"{'on (a Qwen3-MoE export cannot hold it)' if load_balance_coeff else 'off'}\n"
                    f"# back (torchtitan saves in outputs/): python scripts/import_hf.py --hf "
                    f"outputs/checkpoint/step-N --out <run>\n")
    log(f"torchtitan folder: {out_dir}\n{command('minimind_pretrain', ep, fsdp)}")


def main(argv=None):
    p = Parser(description=__doc__)
    p.add_argument("--ckpt", required=True, help="checkpoint file or run directory (ours)")
    p.add_argument("--out", required=True, help="output folder (new or empty)")
    p.add_argument("--ep", type=int, default=1, help="torchtitan's expert-parallel degree in the command")
    p.add_argument("--fsdp", type=int, default=8, help="its FSDP degree (= GPUs) in the command")
    p.add_argument("--load_balance_coeff", type=float, default=None, help="torchtitan's routing-bias rate "
                   "(default off: a Qwen3-MoE export cannot hold the bias)")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: tokenizer/ next to the checkpoint)")
    p.add_argument("--force", action="store_true", help="replace an earlier export at --out")
    add(p, "--steps", allowed=AT_LEAST_1, type=int, default=SCHEDULE["steps"],
        help="minimind_pretrain's training steps")
    add(p, "--sft_steps", allowed=AT_LEAST_1, type=int, default=SCHEDULE["sft_steps"],
        help="minimind_sft's training steps")
    add(p, "--checkpoint_interval", allowed=AT_LEAST_1, type=int, default=SCHEDULE["checkpoint_interval"],
        help="steps between torchtitan's checkpoints (both configs)")
    p.add_argument("--dataset", default=SCHEDULE["dataset"], choices=("c4", "c4_test", "c4_validation"),
                   help="minimind_pretrain's dataset, one torchtitan 0.3.0 registers (other text: its "
                   "--dataloader.dataset / --dataloader.dataset_path at launch)")
    args = p.parse_args(argv)
    export(args.ckpt, args.out, args.ep, args.fsdp, args.load_balance_coeff, args.tokenizer, force=args.force,
           schedule={k: getattr(args, k) for k in SCHEDULE})


if __name__ == "__main__":
    run_tool(main)
