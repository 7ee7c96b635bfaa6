"""Map MiniMind checkpoints to and from HF `transformers` Qwen3 architectures (no custom code
needed).

The MiniMind-3 block is the Qwen3 block, so an MoE checkpoint is a `Qwen3MoeForCausalLM`
("qwen3_moe") and a dense one a `Qwen3ForCausalLM` ("qwen3"); parity is proven by
scripts/test_export.py. Experts are written per expert
(`mlp.experts.{e}.{gate,up,down}_proj.weight`), which transformers 5.x fuses on load into
`gate_up_proj` [E, 2F, D] / `down_proj` [E, D, F]; `from_hf_state_dict` reads either layout.
"""
from model.config import MiniMindConfig

# How each MiniMindConfig field maps; a non-default
# value of a field not listed is refused, not dropped.
_SAME = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings",
         "rms_norm_eps", "tie_word_embeddings", "initializer_range", "pad_token_id",
         "bos_token_id", "eos_token_id")
_MOE_ONLY = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
             "router_aux_loss_coef")
# (training fields do not change the function; aux-loss-free balancing has no Qwen3-MoE counterpart)
_HANDLED = set(_SAME) | set(_MOE_ONLY) | set(MiniMindConfig.training_fields()) | {
    "rope_theta", "dropout", "use_moe", "routed_scaling_factor"}


class ExportError(ValueError):
    """The checkpoint uses a feature the target HF architecture cannot represent (the message says
    which)."""


def check_exportable(config: MiniMindConfig):
    """Raise ExportError naming every config feature that Qwen3 / Qwen3-MoE cannot express."""
    default = MiniMindConfig()
    own = set(MiniMindConfig.__dataclass_fields__)
    bad = [f for f in sorted(own - _HANDLED) if getattr(config, f) != getattr(default, f)]
    if bad:
        raise ExportError(f"cannot export: Qwen3/Qwen3-MoE has no equivalent of {', '.join(bad)} "
                          f"(values {[getattr(config, f) for f in bad]})")


def to_hf_config(config: MiniMindConfig):
    """Qwen3MoeConfig (use_moe) or Qwen3Config (dense) describing the same function. Raises
    ExportError."""
    from transformers import Qwen3Config, Qwen3MoeConfig
    check_exportable(config)
    common = {f: getattr(config, f) for f in _SAME}
    common.update(rope_parameters={"rope_type": "default", "rope_theta": float(config.rope_theta)},
                  attention_dropout=config.dropout, attention_bias=False,
                  hidden_act="silu", use_cache=True)
    if not config.use_moe:
        return Qwen3Config(**common, architectures=["Qwen3ForCausalLM"])
    return Qwen3MoeConfig(**common,
                          **{f: getattr(config, f) for f in _MOE_ONLY}, decoder_sparse_step=1,
                          mlp_only_layers=[], architectures=["Qwen3MoeForCausalLM"])


# Import is an allow-list: a field is mapped, has no effect on the function (_NEUTRAL) or must hold
# the one value MiniMind computes (_FIXED); anything else (a new activation, a bias) is refused,
# never silently dropped.
_NEUTRAL = {"transformers_version", "architectures", "model_type", "_name_or_path", "dtype",
            "torch_dtype", "output_hidden_states", "output_attentions", "return_dict", "use_cache",
            "output_router_logits", "chunk_size_feed_forward", "is_encoder_decoder", "id2label",
            "label2id", "problem_type", "sliding_window",
            "max_window_layers"}  # (the last two act only with use_sliding_window)
_FIXED = {"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False,
          "mlp_only_layers": [], "decoder_sparse_step": 1, "rope_scaling": None,
          "pretraining_tp": 1, "layer_types": ["full_attention"]}
_MAPPED = set(_SAME) | set(_MOE_ONLY) | {"num_local_experts", "rope_parameters", "rope_theta",
                                         "attention_dropout"}


def from_hf_config(hf_config) -> MiniMindConfig:
    """MiniMindConfig from a Qwen3 / Qwen3-MoE config. Raises ExportError naming every field
    MiniMind cannot express (the allow-list above)."""
    mt = hf_config.model_type
    if mt not in ("qwen3", "qwen3_moe"):
        raise ExportError(f"cannot import model_type {mt!r}: "
                          "only qwen3 and qwen3_moe are supported")
    fields, rope = hf_config.to_dict(), dict(getattr(hf_config, "rope_parameters", None) or {})
    if "layer_types" in fields:  # one entry per layer
        fields["layer_types"] = sorted(set(fields["layer_types"] or ["full_attention"]))
    bad = [f"{k}={v!r} (MiniMind computes {_FIXED[k]!r})"
           for k, v in fields.items() if k in _FIXED and v != _FIXED[k]]
    bad += [f"{k}={v!r} (no MiniMind equivalent)" for k, v in fields.items()
            if k not in _FIXED.keys() | _NEUTRAL | _MAPPED]
    if rope.get("rope_type", "default") != "default" or set(rope) - {"rope_type", "rope_theta"}:
        bad.append(f"rope_parameters={rope!r} (MiniMind uses plain RoPE)")
    if bad:
        raise ExportError(f"cannot import {hf_config.model_type}: " + "; ".join(bad))
    kw = {f: getattr(hf_config, f) for f in _SAME}
    kw.update(rope_theta=float(rope.get("rope_theta", 10000.0)),
              dropout=float(getattr(hf_config, "attention_dropout", 0.0)),
              use_moe=mt == "qwen3_moe")
    if mt == "qwen3_moe":
        kw.update({f: getattr(hf_config, f) for f in _MOE_ONLY})
    return MiniMindConfig(**kw)


def down_proj_scale(config: MiniMindConfig):
    """What the experts' down projections are multiplied by on export: Qwen3-MoE (transformers,
    llama.cpp) has no routed_scaling_factor s, and the combine is linear in them: they take it."""
    return config.routed_scaling_factor if config.use_moe else 1.0


def to_hf_state_dict(state_dict, config: MiniMindConfig):
    """Our state_dict -> HF keys (per-expert layout), the experts' down projections times
    `down_proj_scale`. Tied lm_head is omitted (HF re-ties it)."""
    # (our parameter names are the HF names)
    scale = down_proj_scale(config)
    return {k: v * scale
            if scale != 1.0 and ".mlp.experts." in k and k.endswith("down_proj.weight") else v
            for k, v in state_dict.items()
            if not (k == "lm_head.weight" and config.tie_word_embeddings)}


def from_hf_state_dict(hf_state, config: MiniMindConfig):
    """HF Qwen3 / Qwen3-MoE state_dict -> ours: the names are ours (transformers' fused experts,
    `gate_up_proj` [E, 2F, D] gate rows first and `down_proj` [E, D, F], are our stacked tensors;
    per-expert entries load through Experts' pre-hook), plus the tied lm_head."""
    out = dict(hf_state)
    if config.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def is_hf_folder(path):
    """True for a directory holding a transformers config.json of a Qwen3 / Qwen3-MoE model."""
    import json
    import os
    cfg = os.path.join(path, "config.json")
    run_folder = any(os.path.lexists(os.path.join(path, n)) for n in ("ckpt.pt", "ckpt"))
    if not (os.path.isdir(path) and os.path.exists(cfg)) or run_folder:
        return False
    try:
        with open(cfg, encoding="utf-8") as f:
            return json.load(f).get("model_type") in ("qwen3", "qwen3_moe")
    except (ValueError, AttributeError):
        # a damaged config.json: train/hf_folder.py's load_hf_checked names it
        return True
