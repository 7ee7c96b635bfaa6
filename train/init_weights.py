"""Where a run's first weights come from besides a fresh init: a checkpoint or HF folder (--init_from), a
dense run cut into experts (--upcycle_from, sparse upcycling), and the tokenizer that goes with them.
"""
import json
import os
import sys

import torch

from model.config import MiniMindConfig
from model.hf_adapter import is_hf_folder
from train.checkpoint import load_checkpoint, model_from_checkpoint
from train.hf_folder import load_hf_checked
from train.flags import TRUNK_FIELDS
from train.run_dir import run_dir_of


def upcycled_base(args, dense):
    """The config dict of the MoE that --upcycle_from makes of the dense config dict `dense`. Raises ValueError
    for an MoE source and for sizes with which step 0 would not compute the dense model (`slices_per_copy`)."""
    if dense.get("use_moe"):
        raise ValueError(f"{args.upcycle_from}: an MoE model already; --upcycle_from takes a dense one (--use_moe 0)")
    defaults = MiniMindConfig.__dataclass_fields__
    moe = {k: bool(v) if isinstance(defaults[k].default, bool) else v for k, v in vars(args).items()
           if k in defaults and k not in TRUNK_FIELDS}
    slices_per_copy(dense["intermediate_size"], moe["moe_intermediate_size"] or dense["intermediate_size"],
                    moe["num_experts"], moe["num_experts_per_tok"])
    return {**dense, **moe, "use_moe": True}


def slices_per_copy(dense_width, expert_width, num_experts, top_k):
    """G = dense_width / expert_width: each dense FFN is cut into G slices, the experts are E / G copies of
    them, and top-k takes whole copies when k is a multiple of G; only then (with norm_topk_prob) does the
    upcycled MoE compute the dense model at step 0. Raises ValueError naming the flags otherwise."""
    G = dense_width // expert_width
    if dense_width % expert_width or num_experts % G:
        raise ValueError(f"--moe_intermediate_size {expert_width} must divide the dense intermediate_size "
                         f"{dense_width}, and --num_experts {num_experts} be a multiple of the {max(G, 1)} slices")
    if top_k % G:
        raise ValueError(f"--num_experts_per_tok {top_k} must be a multiple of the {G} slices each dense FFN is cut "
                         f"into (intermediate_size {dense_width} / --moe_intermediate_size {expert_width}): otherwise "
                         f"step 0 does not compute the dense model")
    return G


def weights_source(args):
    """(model to start from or None, tokenizer dir or None); a resumed / initialised run uses its own tokenizer."""
    init_model, source_dir = None, None
    if args.resume:
        source_dir = os.path.dirname(os.path.abspath(args.resume))
    elif args.init_from or args.upcycle_from:  # trained weights (ours or an exported HF folder), fresh optimizer
        path = args.init_from or args.upcycle_from
        if is_hf_folder(path):
            init_model, source_dir = load_hf_checked(path), path
        else:
            init_model = model_from_checkpoint(load_checkpoint(path))
            source_dir = run_dir_of(path)
    own = next((cand for cand in (os.path.join(source_dir, "tokenizer"), source_dir)
                if os.path.exists(os.path.join(cand, "tokenizer.json"))), None) if source_dir else None
    if args.tokenizer is not None or source_dir is None:
        if init_model is not None and own is not None and tokens_of(own) != tokens_of(args.tokenizer):
            print(f"warning: --tokenizer {args.tokenizer} is not the tokenizer of "
                  f"{args.init_from or args.upcycle_from} "
                  f"({own}): the same ids stand for other text, so its trained embeddings start out wrong",
                  file=sys.stderr)
        return init_model, args.tokenizer
    if own is not None:
        return init_model, own
    if init_model is not None:  # a fresh tokenizer would not match the trained embeddings
        raise ValueError(f"{args.init_from or args.upcycle_from}: no tokenizer next to the weights; "
                         "pass --tokenizer DIR")
    return init_model, None


def tokens_of(folder):
    """A tokenizer folder's vocabulary, merges and added tokens (tokenizer.json), to compare two; None when
    unreadable (the loading reports that)."""
    try:
        with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as file:
            spec = json.load(file)
        return spec.get("model"), spec.get("added_tokens")
    except (OSError, ValueError, AttributeError):
        return None


@torch.no_grad()
def upcycle(model, dense, seed=0):
    """--upcycle_from, sparse upcycling (Komatsuzaki et al. 2022), fine-grained: `model` (an MoE with the dense
    model's trunk) gets its embeddings, attention, norms and head. Each dense FFN is cut into G = F_dense / F
    slices: expert e = slice e % G of copy e // G, its down projection times G / routed_scaling_factor, and
    router row e a random row per copy, so top-k (k a multiple of G) takes whole copies; with norm_topk_prob
    the MoE then computes the dense model (up to rounding). A shared
    expert starts with a zero down projection. Raises ValueError (naming the flags) when the sizes do not tile."""
    missing = model.load_state_dict({k: v for k, v in dense.state_dict().items() if ".mlp." not in k}, strict=False)
    assert all(".mlp." in k for k in missing.missing_keys) and not missing.unexpected_keys, missing
    generator, config = torch.Generator().manual_seed(seed), model.config
    F = config.moe_intermediate_size
    G = slices_per_copy(dense.config.intermediate_size, F, config.num_experts, config.num_experts_per_tok)
    for layer, dense_layer in zip(model.model.layers, dense.model.layers):
        moe, ffn = layer.mlp, dense_layer.mlp
        for e, expert in enumerate(moe.experts):
            rows, (gate, up, down) = slice((e % G) * F, (e % G + 1) * F), expert.weights()
            gate.copy_(ffn.gate_proj.weight[rows])
            up.copy_(ffn.up_proj.weight[rows])
            down.copy_(ffn.down_proj.weight[:, rows] * (G / config.routed_scaling_factor))
        copies = (torch.randn(config.num_experts // G, config.hidden_size, generator=generator)
                  * config.initializer_range)
        moe.gate.weight.copy_(copies.repeat_interleave(G, dim=0))
        if moe.shared_experts is not None:
            moe.shared_experts.down_proj.weight.zero_()
