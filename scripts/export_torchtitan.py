"""Hand a run to torchtitan (FSDP2, TP, CP, PP, EP, fp8, many nodes): a folder torchtitan 0.3.0 trains from
unedited.

    python scripts/export_torchtitan.py --ckpt checkpoints/sft --out exports/minimind-tt [--ep 4 --fsdp 8]
    cd exports/minimind-tt && cat COMMAND.txt        # the torchrun command (CUDA: torchtitan trains on GPUs)

The folder holds hf/ (export_hf.py's Qwen3 / Qwen3-MoE export, logits checked, with a chat template without
transformers' {% generation %} tags, which torchtitan's tokenizer rejects), minimind_tt.py (the model as a
torchtitan Qwen3 flavor: tied embeddings, q/k norm, RoPE theta, softmax top-k with norm_topk_prob as
route_norm, the routed scaling already folded into the experts' down projections by the export; and the
trainer configs `minimind_pretrain` / `minimind_sft`, which load hf/ at step 0 and save in HF format), and
COMMAND.txt. Routing balance: torchtitan's learned routing bias (load_balance_coeff) is off, since a Qwen3-MoE
folder cannot hold it (its exports would route otherwise than it trained); --load_balance_coeff turns it on.
torchtitan has none of our router losses or capacity limits: those the run used are named in a warning.
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
from train.flags import Parser, run_tool  # noqa: E402

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


def flavor_module(config, args_of_run, source, load_balance_coeff):
    """The text of minimind_tt.py for `config` (a MiniMindConfig) and the run's flags (lr, seq_len, batch)."""
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
    layers = (f"_build_qwen3_moe_layers(n_layers={config.num_hidden_layers}, dim=DIM, n_heads="
              f"{config.num_attention_heads}, n_kv_heads={config.num_key_value_heads}, head_dim=HEAD_DIM,\n"
              f"            moe_hidden_dim={config.moe_intermediate_size}, num_experts={config.num_experts}, "
              f"top_k={config.num_experts_per_tok}, attn_backend=attn_backend,\n"
              f"            moe_comm_backend=\"standard\", rope=rope)" if config.use_moe else
              f"_build_qwen3_layers(n_layers={config.num_hidden_layers}, dim=DIM, n_heads="
              f"{config.num_attention_heads}, n_kv_heads={config.num_key_value_heads}, head_dim=HEAD_DIM,\n"
              f"            hidden_dim={config.intermediate_size}, attn_backend=attn_backend, rope=rope)")
    moe_settings = (f"    for layer in cfg.layers:\n"
                    f"        layer.moe.router.route_norm = {bool(config.norm_topk_prob)}  # norm_topk_prob\n"
                    f"        layer.moe.load_balance_coeff = {load_balance_coeff!r}  # (see COMMAND.txt)\n"
                    if config.use_moe else "")
    return TEMPLATE.format(
        source=source, dim=config.hidden_size, head_dim=head_dim, vocab=config.vocab_size,
        tie=bool(config.tie_word_embeddings), max_seq=config.max_position_embeddings, theta=float(config.rope_theta),
        layers=layers, moe_settings=moe_settings, lb_hook="register_moe_load_balancing_hook" if config.use_moe
        else "None", lr=args_of_run.get("learning_rate", 1e-4), seq_len=args_of_run.get("seq_len", 512),
        batch=args_of_run.get("batch_size", 8), warmup=args_of_run.get("warmup_steps", 50))


TEMPLATE = '''"""torchtitan 0.3.0 flavor of a minimind-moe run ({source}), written by scripts/export_torchtitan.py.
Configs: minimind_pretrain (torchtitan's registered "c4", streamed from the HF hub; other text through its
--dataloader.dataset / --dataloader.dataset_path), minimind_sft (MINIMIND_SFT_JSONL: our chat jsonl,
{{"conversations": [...]}} or {{"messages": [...]}} per line, each row's last exchange). Both load hf/ at step 0."""
import os

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.optimizer import default_adamw, LRSchedulersContainer, register_moe_load_balancing_hook
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.hf_datasets.text_datasets import ChatDataLoader, HuggingFaceTextDataLoader
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.qwen3 import (_EMBEDDING_SKIP_INIT, _LINEAR_INIT, _build_qwen3_layers, _build_qwen3_moe_layers,
                                     _qwen3_norm, parallelize_qwen3)
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

HF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf")
DIM, HEAD_DIM, VOCAB = {dim}, {head_dim}, {vocab}


def minimind_model_config(attn_backend="flex"):
    rope = CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len={max_seq}, theta={theta})
    cfg = Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=_qwen3_norm(DIM), enable_weight_tying={tie},
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_SKIP_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_LINEAR_INIT),
        layers={layers})
{moe_settings}    return cfg


def minimind_model_spec(attn_backend="flex"):
    return ModelSpec(name="qwen3", flavor="minimind", model=minimind_model_config(attn_backend),
                     parallelize_fn=parallelize_qwen3, pipelining_fn=pipeline_llm,
                     post_optimizer_build_fn={lb_hook}, state_dict_adapter=Qwen3StateDictAdapter)


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
                                            initial_load_model_only=True, last_save_in_hf=True, interval=500))


def minimind_pretrain():
    return _trainer(HuggingFaceTextDataLoader.Config(dataset="c4"), steps=1000)


def last_exchange(row):
    """torchtitan 0.3.0's ChatDataset takes one [user, assistant] exchange: a conversation's last one (its system
    turn and earlier turns are dropped)."""
    turns = [t for t in (row.get("conversations") or row["messages"]) if t["role"] in ("user", "assistant")]
    return [{{"role": t["role"], "content": t["content"]}} for t in turns[-2:]]


def minimind_sft():
    data = os.environ.get("MINIMIND_SFT_JSONL", "sft.jsonl")
    return _trainer(ChatDataLoader.Config(dataset_path="json", load_dataset_kwargs={{"data_files": data, "split": "train"}},
                                          sample_processor=last_exchange), steps=300)
'''


def command(config_name, ep, fsdp):
    """The torchrun command that trains the folder (run inside it)."""
    flags = [f"--parallelism.data_parallel_shard_degree {fsdp}", f"--parallelism.expert_parallel_degree {ep}"]
    flags += ["--training.disable_cuda_graphs"] if ep > 1 else []
    return (f"PYTHONPATH=. torchrun --nproc_per_node {fsdp} -m torchtitan.train --module minimind_tt "
            f"--config {config_name} " + " ".join(flags))


OWN_FILES = {"hf", "minimind_tt.py", "COMMAND.txt", "__pycache__"}  # (torchtitan writes outputs/ beside them)


def export(ckpt_path, out_dir, ep=1, fsdp=1, load_balance_coeff=None, tokenizer_dir=None, log=print, force=False):
    """Write the torchtitan folder at out_dir. Raises ExportError / ValueError / FileNotFoundError (one line)
    before anything is written."""
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
            f.write(flavor_module(config, ckpt.get("args") or {}, os.path.abspath(ckpt_path), load_balance_coeff))
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
    args = p.parse_args(argv)
    try:
        export(args.ckpt, args.out, args.ep, args.fsdp, args.load_balance_coeff, args.tokenizer, force=args.force)
    except (ExportError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    run_tool(main)
