"""LoRA fine-tuning of an exported model with PEFT (through TRL's `SFTTrainer`), merged back into a plain HF folder.

    python scripts/hf/lora.py --model exports/minimind-moe-sft --out exports/minimind-moe-lora
    python scripts/import_hf.py --hf exports/minimind-moe-lora --out checkpoints/lora      # back into our format
    python train/sft.py --init_from checkpoints/lora --out_dir checkpoints/lora-sft         # and on with our trainer

Adapters sit on the attention projections (q, k, v, o) and on the experts' fused weights (`gate_up_proj`
[E, 2F, D], `down_proj` [E, D, F], through PEFT's `target_parameters`); the data is the embedded SFT set's
training split, the loss only on assistant tokens (the chat template's {% generation %} marks). After training
the adapters are merged (`merge_and_unload`) and the folder holds an ordinary Qwen3-MoE model, which
scripts/import_hf.py reads back with the same logits (scripts/test_hf_stack.py checks it).
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (check_out_dir, load_export, non_finite_guard, quiet_hf, run_training,  # noqa: E402
                    save_export, sft_conversations, training_parser)

import torch  # noqa: E402

from train.flags import AT_LEAST_1, add, run_tool  # noqa: E402

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def conversations(split, limit=None):
    """datasets.Dataset of {"messages": [...]} from the embedded SFT set's split."""
    from datasets import Dataset
    return Dataset.from_list([{"messages": m} for m in sft_conversations(split)[:limit]])


def lora(model_dir, out_dir, steps=100, batch_size=16, lr=1e-3, rank=8, max_train=None, seed=0, log=print):
    """Train LoRA adapters from model_dir, merge them, write out_dir. Returns (merged model, final train loss)."""
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer
    check_out_dir(out_dir)
    quiet_hf()
    model, tokenizer = load_export(model_dir)
    moe = model.config.model_type == "qwen3_moe"
    peft_config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=ATTENTION,
                             target_parameters=EXPERTS if moe else None, task_type="CAUSAL_LM")
    with tempfile.TemporaryDirectory() as tmp:
        args = SFTConfig(output_dir=tmp, max_steps=steps, per_device_train_batch_size=batch_size, learning_rate=lr,
                         warmup_steps=steps // 10, lr_scheduler_type="cosine", assistant_only_loss=True,
                         max_length=model.config.max_position_embeddings, logging_steps=max(steps // 5, 1),
                         save_strategy="no", report_to="none", seed=seed, use_cpu=not torch.cuda.is_available(),
                         disable_tqdm=True, dataloader_num_workers=0)
        guard = non_finite_guard()
        trainer = SFTTrainer(model=model, args=args, train_dataset=conversations("train", max_train),
                             processing_class=tokenizer, peft_config=peft_config, callbacks=[guard])
        n_train = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        log(f"LoRA r={rank} on {', '.join(ATTENTION + (EXPERTS if moe else []))}: {n_train:,} trainable parameters")
        result = trainer.train()
    merged = trainer.model.merge_and_unload().eval()
    save_export(merged, tokenizer, out_dir, guard=guard)
    log(f"merged the adapters and wrote {out_dir} (final train loss {result.training_loss:.4f})")
    return merged, result.training_loss


def main(argv=None):
    p = training_parser(__doc__, "exports/minimind-moe-lora", 1e-3, "conversations")
    add(p, "--rank", allowed=AT_LEAST_1, type=int, default=8, help="LoRA rank (alpha = 2 x rank)")
    run_training(p, argv, lambda a: lora(a.model, a.out, a.steps, a.batch_size, a.lr, a.rank, a.max_train, a.seed))


if __name__ == "__main__":
    run_tool(main)
