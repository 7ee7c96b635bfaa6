"""Map MiniMind checkpoints to and from HF `transformers` Qwen3 architectures (no custom code needed).

The MiniMind-3 block is the Qwen3 block, so an MoE checkpoint is a `Qwen3MoeForCausalLM` ("qwen3_moe") and
a dense one a `Qwen3ForCausalLM` ("qwen3"); parity is proven by scripts/test_export.py. Experts are
written per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`), which transformers 5.x fuses on load
into `gate_up_proj` [E, 2F, D] / `down_proj` [E, D, F]; `from_hf_state_dict` reads either layout.
"""
import re


from model.config import MiniMindConfig

# How each MiniMindConfig field maps; a non-default value of a field not listed is refused, not dropped.
_SAME = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
         "intermediate_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "initializer_range",
         "pad_token_id", "bos_token_id", "eos_token_id")
_MOE_ONLY = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "router_aux_loss_coef")
# (training fields do not change the function; aux-loss-free balancing has no Qwen3-MoE counterpart)
_HANDLED = set(_SAME) | set(_MOE_ONLY) | set(MiniMindConfig.training_fields()) | {"rope_theta", "dropout", "use_moe"}


class ExportError(ValueError):
    """The checkpoint uses a feature the target HF architecture cannot represent (the message says which)."""


def check_exportable(config: MiniMindConfig):
    """Raise ExportError naming every config feature that Qwen3 / Qwen3-MoE cannot express."""
    default = MiniMindConfig()
    own = set(MiniMindConfig.__dataclass_fields__) - set(MiniMindConfig.__mro__[1].__dataclass_fields__)
    bad = [f for f in sorted(own - _HANDLED) if getattr(config, f) != getattr(default, f)]
    if bad:
        raise ExportError(f"cannot export: Qwen3/Qwen3-MoE has no equivalent of {', '.join(bad)} "
                          f"(values {[getattr(config, f) for f in bad]})")


def to_hf_config(config: MiniMindConfig):
    """Qwen3MoeConfig (use_moe) or Qwen3Config (dense) describing the same function. Raises ExportError."""
    from transformers import Qwen3Config, Qwen3MoeConfig
    check_exportable(config)
    common = {f: getattr(config, f) for f in _SAME}
    common.update(rope_parameters={"rope_type": "default", "rope_theta": float(config.rope_theta)},
                  attention_dropout=config.dropout, attention_bias=False, hidden_act="silu", use_cache=True)
    if not config.use_moe:
        return Qwen3Config(**common, architectures=["Qwen3ForCausalLM"])
    return Qwen3MoeConfig(**common, **{f: getattr(config, f) for f in _MOE_ONLY}, decoder_sparse_step=1,
                          mlp_only_layers=[], architectures=["Qwen3MoeForCausalLM"])


def from_hf_config(hf_config) -> MiniMindConfig:
    """MiniMindConfig from a Qwen3 / Qwen3-MoE config. Raises ExportError for what MiniMind cannot express."""
    mt = hf_config.model_type
    if mt not in ("qwen3", "qwen3_moe"):
        raise ExportError(f"cannot import model_type {mt!r}: only qwen3 and qwen3_moe are supported")
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ExportError(f"cannot import rope_type {rope.get('rope_type')!r}: MiniMind uses plain RoPE")
    if getattr(hf_config, "attention_bias", False):
        raise ExportError("cannot import attention_bias=True: MiniMind projections have no bias")
    if getattr(hf_config, "use_sliding_window", False):
        raise ExportError("cannot import use_sliding_window=True: MiniMind attends to the full context")
    if mt == "qwen3_moe" and (getattr(hf_config, "mlp_only_layers", None) or hf_config.decoder_sparse_step != 1):
        raise ExportError("cannot import mixed dense/MoE layers (mlp_only_layers / decoder_sparse_step)")
    kw = {f: getattr(hf_config, f) for f in _SAME}
    kw.update(rope_theta=float(rope.get("rope_theta", 10000.0)), dropout=float(getattr(hf_config, "attention_dropout", 0.0)),
              use_moe=mt == "qwen3_moe")
    if mt == "qwen3_moe":
        kw.update({f: getattr(hf_config, f) for f in _MOE_ONLY})
    return MiniMindConfig(**kw)


def to_hf_state_dict(state_dict, config: MiniMindConfig):
    """Our state_dict -> HF keys (per-expert layout). Tied lm_head is omitted (HF re-ties it)."""
    out = {}
    for k, v in state_dict.items():
        if k == "lm_head.weight" and config.tie_word_embeddings:
            continue
        out[k] = v  # our parameter names are already the HF names
    return out


_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def from_hf_state_dict(hf_state, config: MiniMindConfig):
    """HF Qwen3 / Qwen3-MoE state_dict (per-expert or fused expert layout) -> our state_dict."""
    out = {}
    for k, v in hf_state.items():
        m = _FUSED.match(k)
        if m is None:
            out[k] = v
            continue
        prefix, kind = m.groups()
        for e in range(v.shape[0]):
            if kind == "gate_up_proj":  # [E, 2F, D]: gate rows first, then up rows
                gate, up = v[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.clone()
                out[f"{prefix}.{e}.up_proj.weight"] = up.clone()
            else:  # [E, D, F]
                out[f"{prefix}.{e}.down_proj.weight"] = v[e].clone()
    if config.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def is_hf_folder(path):
    """True for a directory holding a transformers config.json of a Qwen3 / Qwen3-MoE model."""
    import json
    import os
    cfg = os.path.join(path, "config.json")
    if not (os.path.isdir(path) and os.path.exists(cfg)) or os.path.exists(os.path.join(path, "ckpt.pt")):
        return False
    try:
        with open(cfg, encoding="utf-8") as f:
            return json.load(f).get("model_type") in ("qwen3", "qwen3_moe")
    except (ValueError, AttributeError):  # a damaged config.json: train/checkpoint.py's load_hf_checked names it
        return True
