"""DPO on an exported model with TRL's `DPOTrainer`, on an embedded preference set; writes a new HF folder.

    python scripts/hf/dpo.py --model exports/minimind-moe-sft --out exports/minimind-moe-dpo

Preference pairs (scripts/hf/common.py): the prompt is "What does `name` do?", chosen = the function's docstring
first paragraph, rejected = another function's. Training pairs come from the SFT set's training names, the
held-out pairs from its held-out names, so the held-out figure is about functions the model never saw answered.

Printed on the held-out pairs: the preference accuracy before and after, the share of pairs whose chosen answer
(ending in <|im_end|>) the model gives the higher summed log-probability, and after, the reward accuracy, the share
whose implicit DPO reward margin (log-ratio to the starting model of chosen minus that of rejected) is > 0 (the
starting model's margins are all 0). The figures are also written to the folder's dpo_results.json.

MoE router loss: TRL adds `router_aux_loss_coef * aux_loss` from the folder's config; scripts/export_hf.py writes
our coefficient there, and transformers' Qwen3-MoE balance loss is ours (`minimind` type: E * sum_e f_e P_e over
all K slots) except that it pools f and P over all layers before the product where we average per-layer losses.
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (check_out_dir, load_export, non_finite_guard, qa_pairs, quiet_hf,  # noqa: E402
                    run_training, save_export, training_parser, wrong_answers)

import torch  # noqa: E402

from train.flags import AT_LEAST_0, POSITIVE, Range, add, run_tool  # noqa: E402

# a rejected answer is another pair's: at least 2 pairs; a negative beta reverses the objective


def preference_dataset(pairs, seed=0):
    """datasets.Dataset in TRL's conversational preference format (prompt / chosen / rejected messages)."""
    from datasets import Dataset
    rejected = wrong_answers(pairs, 1, seed)
    return Dataset.from_list([{"prompt": [{"role": "user", "content": q}],
                               "chosen": [{"role": "assistant", "content": a}],
                               "rejected": [{"role": "assistant", "content": r[0]}]}
                              for (q, a), r in zip(pairs, rejected)])


@torch.no_grad()
def answer_logprob(model, tokenizer, question, answer):
    """(summed log-probability in nats, number of tokens) of `answer` + <|im_end|> after the chat prompt of
    `question`."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           tokenize=False)
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    a = tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([p + a], device=model.device)[:, :model.config.max_position_embeddings]
    logp = model(ids).logits[0, len(p) - 1:-1].float().log_softmax(-1)
    return logp.gather(1, ids[0, len(p):, None]).sum().item(), ids.shape[1] - len(p)


def pair_logprobs(model, tokenizer, dataset):
    """[((chosen logp, tokens), (rejected logp, tokens))] of each pair's answers under `model` (answer_logprob)."""
    model.eval()
    return [tuple(answer_logprob(model, tokenizer, r["prompt"][0]["content"], r[side][0]["content"])
                  for side in ("chosen", "rejected")) for r in dataset]


def accuracies(before, after):
    """Held-out figures from pair_logprobs of the starting and the trained model: the preference accuracy (share
    of pairs whose chosen answer has the higher summed log-probability) and its per-token form (mean log-probability
    per token, which answers of different lengths need), before and after, and the reward accuracy (share of pairs
    whose implicit DPO reward margin, the log-ratio to the starting model of chosen minus that of rejected, is > 0)."""
    def share(pairs, per_token):
        return sum(c / (nc if per_token else 1) > r / (nr if per_token else 1)
                   for (c, nc), (r, nr) in pairs) / len(pairs)
    return {"preference_accuracy_before": share(before, False), "preference_accuracy_after": share(after, False),
            "per_token_preference_accuracy_before": share(before, True),
            "per_token_preference_accuracy_after": share(after, True),
            "reward_accuracy": sum((ac - bc) - (ar - br) > 0 for ((bc, _), (br, _)), ((ac, _), (ar, _))
                                   in zip(before, after)) / len(before)}


def dpo(model_dir, out_dir, steps=100, batch_size=16, lr=5e-4, beta=0.1, sft_weight=0.2, max_train=None, max_eval=None,
        seed=0, log=print):
    """Run DPO from model_dir, write out_dir; returns the figures (also in out_dir/dpo_results.json)."""
    from trl import DPOConfig, DPOTrainer
    check_out_dir(out_dir)
    quiet_hf()
    model, tokenizer = load_export(model_dir)
    train, held_out = (preference_dataset(qa_pairs("train", max_train), seed),
                       preference_dataset(qa_pairs("val", max_eval), seed))
    log(f"preference pairs: {len(train)} train, {len(held_out)} held out")
    before = pair_logprobs(model, tokenizer, held_out)
    with tempfile.TemporaryDirectory() as tmp:
        args = DPOConfig(output_dir=tmp, max_steps=steps, per_device_train_batch_size=batch_size,
                         learning_rate=lr, beta=beta, loss_type=["sigmoid", "sft"] if sft_weight else ["sigmoid"],
                         loss_weights=[1.0, sft_weight] if sft_weight else None, warmup_steps=steps // 10,
                         lr_scheduler_type="cosine", max_length=model.config.max_position_embeddings,
                         logging_steps=max(steps // 5, 1), save_strategy="no", report_to="none", seed=seed,
                         use_cpu=not torch.cuda.is_available(), disable_tqdm=True, dataloader_num_workers=0)
        guard = non_finite_guard()
        trainer = DPOTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer, callbacks=[guard])
        trainer.train()
    results = {"held_out_pairs": len(held_out), "train_pairs": len(train), "steps": steps, "beta": beta, "lr": lr,
               "sft_weight": sft_weight, **accuracies(before, pair_logprobs(trainer.model, tokenizer, held_out))}
    r = results
    log(f"held-out pairs: preference accuracy {r['preference_accuracy_before']:.3f} before DPO, "
        f"{r['preference_accuracy_after']:.3f} after; per token {r['per_token_preference_accuracy_before']:.3f} -> "
        f"{r['per_token_preference_accuracy_after']:.3f}; reward accuracy (implicit reward margin > 0) "
        f"{r['reward_accuracy']:.3f}")
    save_export(trainer.model, tokenizer, out_dir, {"dpo_results.json": results}, guard)
    log(f"wrote {out_dir}")
    return results


def main(argv=None):
    p = training_parser(__doc__, "exports/minimind-moe-dpo", 5e-4, "preference pairs", fewest=2)
    add(p, "--beta", allowed=POSITIVE, type=float, default=0.1, help="DPO's beta: how far from the starting model")
    add(p, "--sft_weight", allowed=AT_LEAST_0, type=float, default=0.2,
        help="weight of the NLL of the chosen answers added to the DPO loss (RPO), which keeps the model fluent; "
        "0 = plain DPO")
    add(p, "--max_eval", allowed=Range(2), type=int, default=None, help="use only the first N held-out pairs")
    run_training(p, argv, lambda a: dpo(a.model, a.out, a.steps, a.batch_size, a.lr, a.beta, a.sft_weight,
                                        a.max_train, a.max_eval, a.seed))


if __name__ == "__main__":
    run_tool(main)
