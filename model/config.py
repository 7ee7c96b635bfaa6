"""MiniMindConfig: every architecture field is an explicit, documented dataclass field.

The config is a `transformers.PreTrainedConfig`, so it saves to / loads from `config.json`
and is stored inside every checkpoint; resume and export read the architecture from there.
"""
import math
from dataclasses import field

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig


def _training(default):
    """A field that says how to train or compute, not what function the model computes: it may change on
    --resume / --init_from (the flag wins over the checkpoint) and the HF export has nothing to carry."""
    return field(default=default, metadata={"training": True})


@strict
class MiniMindConfig(PreTrainedConfig):
    """Architecture (and the training choices stored with it) of the MiniMind-style GPT (GQA + q/k RMSNorm + RoPE + SwiGLU, optional MoE FFN).

    Fields (units in brackets):
        vocab_size: number of token ids.
        hidden_size: model width D.
        num_hidden_layers: number of transformer blocks.
        num_attention_heads: query heads; must divide hidden_size when head_dim is None.
        num_key_value_heads: key/value heads (GQA); must divide num_attention_heads.
        head_dim: per-head width; None -> hidden_size // num_attention_heads.
        intermediate_size: dense SwiGLU width; None -> ceil(hidden_size * pi / 64) * 64 (MiniMind's rule).
        max_position_embeddings: longest sequence RoPE tables are built for [tokens].
        rope_theta: RoPE base frequency (MiniMind-3 / Qwen3 use 1e6).
        rms_norm_eps: epsilon inside every RMSNorm.
        dropout: dropout probability on attention weights and residual branches (0 = off).
        tie_word_embeddings: share the input embedding with the LM head.
        use_moe: replace every dense FFN with a mixture of experts.
        num_experts: experts per MoE layer E.
        num_experts_per_tok: experts each token is routed to (top-k), 1 <= k <= E.
        moe_intermediate_size: SwiGLU width of one expert; None -> intermediate_size.
        norm_topk_prob: renormalise the k selected router probabilities to sum to 1.
        router_aux_loss_coef: weight of the load-balancing loss (0 = off).
        router_aux_loss_type: which balance loss (model/router.py; each per layer, averaged over layers):
            "minimind" (MiniMind's, the default; coef * K when balanced), "switch" (Switch Transformer,
            k-normalised: coef when balanced), "sequence" (DeepSeek-V3 sequence-wise), or "none".
        router_z_loss_coef: weight of the router z-loss (ST-MoE; 0 = off).
        router_bias_update_rate: aux-loss-free balancing (DeepSeek-V3): > 0 adds a per-layer fp32 buffer
            `expert_bias` that only affects which experts are selected, moved by this much per optimizer
            step towards balance (train/ updates it); 0 = off.
        router_dtype: None (default) = the gate runs in autocast's dtype, as the reference; "float32" =
            gate logits, softmax and top-k in fp32 under autocast (Megatron-LM's moe_router_dtype).
        capacity_factor: None = dropless (default); else each expert takes at most
            ceil(capacity_factor * T * K / E) of the T*K routed pairs of a batch, the rest are dropped.
        moe_drop_policy: which pairs an over-full expert keeps: "probs" (highest router weight) or
            "position" (earliest tokens).
        moe_pad_to_capacity: pad every expert's rows to the capacity with zero rows (fixed GEMM shapes).
        moe_expert_alignment: pad every expert's row count to a multiple of this (1 = no padding).
        moe_impl: how the MoE layer dispatches (same parameters, same function; model/dispatch.py):
            "sorted" (default: one host sync per layer, bitwise the masked reference), "fused" (no host
            sync, equal up to rounding; what training runs) or "masked" (the per-expert masked loop, 3
            host syncs per expert: model/moe.py masked_expert_loop; for baselines only).
        initializer_range: std of the normal init of linear and embedding weights.

    The defaults are the main job's model (train/pretrain.py): 4 layers of width 256, 4 experts, top-2.
    Fields declared with `_training(...)` (the router losses, moe_impl, moe_expert_alignment,
    router_dtype) are training choices; `MiniMindConfig.training_fields()` lists them.

    Raises:
        ValueError: naming the field, when a value or a combination is invalid.
    """

    model_type = "minimind"

    vocab_size: int = 6400
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    intermediate_size: int | None = None
    max_position_embeddings: int = 2048
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    dropout: float = 0.0
    tie_word_embeddings: bool = True
    use_moe: bool = True
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = 384
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = _training(0.01)
    capacity_factor: float | None = None
    moe_drop_policy: str = "probs"
    moe_pad_to_capacity: bool = False
    moe_expert_alignment: int = _training(1)
    moe_impl: str = _training("sorted")
    router_aux_loss_type: str = _training("minimind")
    router_z_loss_coef: float = _training(0.0)
    router_bias_update_rate: float = 0.0
    router_dtype: str | None = _training(None)
    initializer_range: float = 0.02
    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 0

    @classmethod
    def training_fields(cls):
        """Names of the fields that choose how to train or compute (see `_training`)."""
        return tuple(n for n, f in cls.__dataclass_fields__.items() if f.metadata.get("training"))

    def __post_init__(self, **kwargs):
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings", "num_experts", "num_experts_per_tok"):
            if getattr(self, name) < 1:
                raise ValueError(f"MiniMindConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"MiniMindConfig.num_attention_heads={self.num_attention_heads} must divide "
                                 f"hidden_size={self.hidden_size} (or set head_dim explicitly)")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"MiniMindConfig.head_dim must be even and >= 2 for RoPE, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"MiniMindConfig.num_key_value_heads={self.num_key_value_heads} must divide "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.intermediate_size is None:
            self.intermediate_size = math.ceil(self.hidden_size * math.pi / 64) * 64
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        for name in ("intermediate_size", "moe_intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"MiniMindConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"MiniMindConfig.num_experts_per_tok={self.num_experts_per_tok} must be <= "
                             f"num_experts={self.num_experts}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"MiniMindConfig.dropout must be in [0, 1), got {self.dropout}")
        if self.rope_theta <= 0:
            raise ValueError(f"MiniMindConfig.rope_theta must be > 0, got {self.rope_theta}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"MiniMindConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.capacity_factor is not None and not (self.capacity_factor > 0 and math.isfinite(self.capacity_factor)):
            raise ValueError(f"MiniMindConfig.capacity_factor must be finite and > 0, or None, got {self.capacity_factor}")
        if self.moe_drop_policy not in ("probs", "position"):
            raise ValueError(f"MiniMindConfig.moe_drop_policy must be 'probs' or 'position', got {self.moe_drop_policy!r}")
        if self.moe_pad_to_capacity and self.capacity_factor is None:
            raise ValueError("MiniMindConfig.moe_pad_to_capacity needs capacity_factor to be set")
        if self.moe_expert_alignment < 1:
            raise ValueError(f"MiniMindConfig.moe_expert_alignment must be >= 1, got {self.moe_expert_alignment}")
        if self.router_aux_loss_type not in ("minimind", "switch", "sequence", "none"):
            raise ValueError("MiniMindConfig.router_aux_loss_type must be 'minimind', 'switch', 'sequence' or "
                             f"'none', got {self.router_aux_loss_type!r}")
        for name in ("router_aux_loss_coef", "router_z_loss_coef", "router_bias_update_rate"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"MiniMindConfig.{name} must be finite and >= 0, got {getattr(self, name)}")
        if self.router_bias_update_rate > 0 and not self.use_moe:
            raise ValueError("MiniMindConfig.router_bias_update_rate > 0 needs use_moe=True (a dense model has no router)")
        if self.router_dtype not in (None, "float32"):
            raise ValueError(f"MiniMindConfig.router_dtype must be None or 'float32', got {self.router_dtype!r}")
        if self.moe_impl not in ("sorted", "fused", "masked"):
            raise ValueError(f"MiniMindConfig.moe_impl must be 'sorted', 'fused' or 'masked', got {self.moe_impl!r}")
        super().__post_init__(**kwargs)
