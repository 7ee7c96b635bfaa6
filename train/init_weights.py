"""Where a run's first weights come from besides a fresh init: a checkpoint or HF folder (--init_from), a
dense run cut into experts (--upcycle_from, sparse upcycling), and the tokenizer that goes with them.
"""
import os

import torch

from model.config import MiniMindConfig
from model.hf_adapter import is_hf_folder
from train.checkpoint import load_checkpoint, load_hf_checked, model_from_checkpoint

# What an upcycled model keeps of the dense one (--upcycle_from); its MoE fields come from the flags
TRUNK_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "max_position_embeddings", "rope_theta", "rms_norm_eps", "dropout",
                "tie_word_embeddings", "initializer_range", "pad_token_id", "bos_token_id", "eos_token_id")


def upcycled_base(args, dense):
    """The config dict of the MoE that --upcycle_from makes of the dense config dict `dense`. Raises ValueError."""
    if dense.get("use_moe"):
        raise ValueError(f"{args.upcycle_from}: an MoE model already; --upcycle_from takes a dense one (--use_moe 0)")
    defaults = MiniMindConfig.__dataclass_fields__
    moe = {k: bool(v) if isinstance(defaults[k].default, bool) else v for k, v in vars(args).items()
           if k in defaults and k not in TRUNK_FIELDS}
    return {**dense, **moe, "use_moe": True}


def weights_source(args):
    """(model to start from or None, tokenizer dir or None); a resumed / initialised run uses its own tokenizer."""
    init_model, source_dir = None, None
    if args.resume:
        source_dir = os.path.dirname(os.path.abspath(args.resume))
    elif args.init_from or args.upcycle_from:  # trained weights (ours or an exported HF folder), fresh optimizer
        path = args.init_from or args.upcycle_from
        if args.init_from and args.upcycle_from:
            raise ValueError("--init_from and --upcycle_from: pass one")
        if is_hf_folder(path):
            init_model, source_dir = load_hf_checked(path), path
        else:
            init_model = model_from_checkpoint(load_checkpoint(path))
            source_dir = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    if args.tokenizer is not None or source_dir is None:
        return init_model, args.tokenizer
    for cand in (os.path.join(source_dir, "tokenizer"), source_dir):
        if os.path.exists(os.path.join(cand, "tokenizer.json")):
            return init_model, cand
    if init_model is not None:  # a fresh tokenizer would not match the trained embeddings
        raise ValueError(f"{args.init_from or args.upcycle_from}: no tokenizer next to the weights; pass --tokenizer DIR")
    return init_model, None


@torch.no_grad()
def upcycle(model, dense, seed=0):
    """--upcycle_from, sparse upcycling (Komatsuzaki et al. 2022), fine-grained: `model` (an MoE with the dense
    model's trunk) gets its embeddings, attention, norms and head. Each dense FFN is cut into G = F_dense / F
    slices: expert e = slice e % G of copy e // G, its down projection times G / routed_scaling_factor, and
    router row e a random row per copy, so top-k (k a multiple of G) takes whole copies; with norm_topk_prob
    the MoE then computes the dense model (up to rounding), else as close as its weights allow. A shared
    expert starts with a zero down projection. Raises ValueError (naming the flags) when the sizes do not tile."""
    missing = model.load_state_dict({k: v for k, v in dense.state_dict().items() if ".mlp." not in k}, strict=False)
    assert all(".mlp." in k for k in missing.missing_keys) and not missing.unexpected_keys, missing
    generator, config = torch.Generator().manual_seed(seed), model.config
    F_dense, F = dense.config.intermediate_size, config.moe_intermediate_size
    G = F_dense // F
    if F_dense % F or config.num_experts % G:
        raise ValueError(f"--moe_intermediate_size {F} must divide the dense intermediate_size {F_dense}, and "
                         f"--num_experts {config.num_experts} be a multiple of the {max(G, 1)} slices")
    for layer, dense_layer in zip(model.model.layers, dense.model.layers):
        moe, ffn = layer.mlp, dense_layer.mlp
        for e, expert in enumerate(moe.experts):
            rows = slice((e % G) * F, (e % G + 1) * F)
            expert.gate_proj.weight.copy_(ffn.gate_proj.weight[rows])
            expert.up_proj.weight.copy_(ffn.up_proj.weight[rows])
            expert.down_proj.weight.copy_(ffn.down_proj.weight[:, rows] * (G / config.routed_scaling_factor))
        copies = torch.randn(config.num_experts // G, config.hidden_size, generator=generator) * config.initializer_range
        moe.gate.weight.copy_(copies.repeat_interleave(G, dim=0))
        if moe.shared_experts is not None:
            moe.shared_experts.down_proj.weight.zero_()
