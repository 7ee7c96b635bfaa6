"""MiniMindConfig: the architecture of the MiniMind-style GPT (GQA + q/k RMSNorm + RoPE + SwiGLU or
MoE FFN), and the MoE training choices stored with it. A plain dataclass (importing it imports
neither torch nor transformers, so the trainer's flags parse in a blink): saved as config.json and
inside every checkpoint (`to_dict`), from where resume and export read the architecture
(`from_dict`).

The defaults are the main job's model (train/pretrain.py). Each field is declared once (`knob`):
default, meaning, allowed values, whether it is a training choice; the trainer's flags of the same
names are built from it. Loss weights above 10 and a bias step above 1 (the router scores are
probabilities) are typos.
"""
import json
import math
import typing
from dataclasses import asdict, dataclass, field

# Keys transformers' PreTrainedConfig added to the config dicts of checkpoints written while
# MiniMindConfig was one: read and dropped, so those checkpoints still resume.
HF_CONFIG_KEYS = {"transformers_version", "architectures", "output_hidden_states", "return_dict",
                  "dtype", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
                  "problem_type", "_name_or_path", "model_type", "output_attentions"}


# a larger magnitude becomes inf in the fp32 tensors every value ends up in
FP32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class Range:
    """The numbers a field or flag accepts: finite in fp32 (|value| <= FP32_MAX), within [lo, hi]
    (an end is excluded when *_open)."""
    lo: float
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, value):
        return (math.isfinite(value) and abs(value) <= FP32_MAX
                and (value > self.lo if self.lo_open else value >= self.lo)
                and (value < self.hi if self.hi_open or self.hi == math.inf else value <= self.hi))

    def __str__(self):
        if self.hi == math.inf:
            return f"{'>' if self.lo_open else '>='} {self.lo}"
        return f"{'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"

    def worded(self, value):
        """What `value` must be, for an error message: `in [0, 1)`, `> 0 and finite` (a float),
        `>= 1`."""
        if self.hi != math.inf:
            return f"in {self}"
        return f"{self} and finite in fp32" if isinstance(value, float) else str(self)


AT_LEAST_1, AT_LEAST_0, POSITIVE = Range(1), Range(0), Range(0, lo_open=True)


def knob(default, doc, allowed=None, flag=True, training=False):
    """A MiniMindConfig field, declared once: its default, what it means (with `flag`, the help of
    the trainer's flag of the same name, train/flags.py, which takes its type, default and
    `allowed` from here), the values it accepts (a Range, checked for numbers, None passing where
    the type allows it; or a tuple of choices), and whether it says how to train rather than what
    function the model computes (`training`: it may change on --resume / --init_from; the HF
    export has nothing to carry for it)."""
    return field(default=default, metadata={"doc": doc, "allowed": allowed, "flag": flag,
                                            "training": training})


@dataclass(kw_only=True)
class MiniMindConfig:
    """Raises TypeError naming the field for a value of the wrong type (`hidden_size="64"`) or an
    unknown field, ConfigError (a ValueError) naming the fields for a value outside its `allowed`
    or a bad combination."""

    model_type: typing.ClassVar[str] = "minimind"

    # (the trainer's --vocab_size, a data flag, sizes the tokenizer it trains)
    vocab_size: int = knob(6400, "vocabulary size", AT_LEAST_1, flag=False)
    hidden_size: int = knob(256, "model width D", AT_LEAST_1)
    num_hidden_layers: int = knob(4, "transformer blocks", AT_LEAST_1)
    num_attention_heads: int = knob(4, "attention (query) heads; divide hidden_size unless "
                                    "head_dim is set", AT_LEAST_1)
    num_key_value_heads: int = knob(2, "key/value heads (GQA); divide num_attention_heads",
                                    AT_LEAST_1)
    head_dim: int | None = knob(None, "per-head width; None: hidden_size // num_attention_heads "
                                "(even, for RoPE)", flag=False)
    intermediate_size: int | None = knob(None, "dense FFN width (None: ceil(D * pi / 64) * 64, "
                                         "MiniMind's rule)", AT_LEAST_1)
    # (RoPE tables are built for all of them: 2 x 4 bytes x head_dim each)
    max_position_embeddings: int = knob(2048, "longest sequence the model supports",
                                        Range(1, 2**20))
    rope_theta: float = knob(1e6, "RoPE base (MiniMind-3 / Qwen3)", POSITIVE, flag=False)
    rms_norm_eps: float = knob(1e-6, "RMSNorm epsilon", POSITIVE, flag=False)
    dropout: float = knob(0.0, "dropout probability on attention weights and residual branches",
                          Range(0, 1, hi_open=True))
    tie_word_embeddings: bool = knob(True, "the LM head shares the input embedding", flag=False)
    use_moe: bool = knob(True, "1: MoE feed-forward (model/moe.py), 0: dense")
    num_experts: int = knob(4, "experts per MoE layer (E)", AT_LEAST_1)
    num_experts_per_tok: int = knob(2, "experts per token (top-k), 1 <= k <= E", AT_LEAST_1)
    moe_intermediate_size: int | None = knob(384, "SwiGLU width of one expert; None: "
                                             "intermediate_size", AT_LEAST_1)
    n_shared_experts: int = knob(0, "shared experts (DeepSeekMoE, Qwen2-MoE): a dense SwiGLU every "
                                 "token takes beside the routed ones", AT_LEAST_0)
    shared_expert_intermediate_size: int | None = knob(
        None, "shared experts' width (None: n_shared_experts x moe_intermediate_size)", AT_LEAST_1)
    norm_topk_prob: bool = knob(True, "renormalise the k chosen router probabilities to sum to 1",
                                flag=False)
    routed_scaling_factor: float = knob(1.0, "combine weights times this (DeepSeek-V2/V3; the "
                                        "trainer's default: top-k)", POSITIVE)
    router_aux_loss_coef: float = knob(0.01, "load-balancing loss weight (0 = off)", Range(0, 10),
                                       training=True)
    capacity_factor: float | None = knob(None, "expert capacity = ceil(factor * tokens * top_k / "
                                         "experts); None: dropless", POSITIVE)
    moe_drop_policy: str = knob("probs", "which pairs an over-full expert keeps: the highest "
                                "weight or the earliest", ("probs", "position"))
    moe_pad_to_capacity: bool = knob(False, "pad every expert's rows to the capacity (fixed GEMM "
                                     "shapes)")
    moe_expert_alignment: int = knob(1, "pad each expert's rows to a multiple of this", AT_LEAST_1,
                                     training=True)
    moe_impl: str = knob("sorted", "MoE dispatch: fused (no host sync; training's default) or "
                         "sorted (bitwise MiniMind's masked loop, 1 host sync per layer; the "
                         "layer's default)", ("sorted", "fused"), training=True)
    router_aux_loss_type: str = knob("minimind", "balance loss (model/router.py): minimind (coef * "
                                     "K when balanced), switch (coef), sequence (DeepSeek-V3's "
                                     "sequence-wise) or none",
                                     ("minimind", "switch", "sequence", "none"), training=True)
    router_z_loss_coef: float = knob(0.0, "router z-loss weight (ST-MoE; 0 = off)", Range(0, 10),
                                     training=True)
    router_bias_update_rate: float = knob(0.0, "aux-loss-free balancing (DeepSeek-V3): an fp32 "
                                          "buffer expert_bias steers the top-k choice, moved this "
                                          "much per optimizer step (e.g. 1e-3; 0 = off)",
                                          Range(0, 1))
    router_dtype: str | None = knob(None, "float32: router logits / softmax / top-k in fp32 under "
                                    "autocast (Megatron-LM)", (None, "float32"), training=True)
    initializer_range: float = knob(0.02, "std of the initial weights", AT_LEAST_0, flag=False)
    pad_token_id: int | None = knob(0, "padding token id", flag=False)
    bos_token_id: int | None = knob(None, "beginning-of-sequence token id", flag=False)
    eos_token_id: int | list[int] | None = knob(0, "end-of-sequence token id(s)", flag=False)

    @classmethod
    def training_fields(cls):
        """Names of the fields that choose how to train (`knob`'s `training`)."""
        return tuple(n for n, f in cls.__dataclass_fields__.items() if f.metadata.get("training"))

    def to_dict(self):
        """Every field (plain JSON values) and `model_type`."""
        return {**asdict(self), "model_type": self.model_type}

    def to_json_string(self):
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, fields):
        """The config a `to_dict()` (or an older checkpoint's config dict) describes. Raises
        TypeError / ValueError as the constructor."""
        return cls(**{k: v for k, v in fields.items() if k not in HF_CONFIG_KEYS})

    def _check(self, ok, template, **fields):
        if not ok:
            raise ConfigError(template, **fields)

    def _check_types(self):
        for name, f in self.__dataclass_fields__.items():
            value = getattr(self, name)
            if not any(_is_a(value, t) for t in (typing.get_args(f.type) or (f.type,))):
                wanted = f.type.__name__ if isinstance(f.type, type) else str(f.type)
                raise TypeError(f"MiniMindConfig.{name} must be {wanted}, got {value!r} "
                                f"({type(value).__name__})")

    def __post_init__(self):
        self._check_types()
        for name, f in self.__dataclass_fields__.items():
            value, allowed = getattr(self, name), f.metadata.get("allowed")
            if isinstance(allowed, Range):
                self._check(value is None or value in allowed,
                            f"{{{name}}} must be {allowed.worded(value)}, got {value}",
                            **{name: None})
            elif allowed is not None:  # (the value's repr is literal text in the template)
                got = repr(value).replace("{", "{{").replace("}", "}}")
                self._check(value in allowed, f"{{{name}}} must be one of {allowed}, got {got}",
                            **{name: None})
        if self.head_dim is None:
            self._check(self.hidden_size % self.num_attention_heads == 0,
                        "{num_attention_heads} must divide {hidden_size}",
                        num_attention_heads=self.num_attention_heads, hidden_size=self.hidden_size)
            self.head_dim = self.hidden_size // self.num_attention_heads
        self._check(self.head_dim >= 2 and self.head_dim % 2 == 0,
                    "{head_dim} must be even and >= 2 (RoPE)", head_dim=self.head_dim)
        self._check(self.num_attention_heads % self.num_key_value_heads == 0,
                    "{num_key_value_heads} must divide {num_attention_heads}",
                    num_key_value_heads=self.num_key_value_heads,
                    num_attention_heads=self.num_attention_heads)
        if self.intermediate_size is None:
            self.intermediate_size = math.ceil(self.hidden_size * math.pi / 64) * 64
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        self._check(self.n_shared_experts == 0 or self.use_moe,
                    "{n_shared_experts} needs {use_moe}",
                    n_shared_experts=self.n_shared_experts, use_moe=True)
        self._check(self.shared_expert_intermediate_size is None or self.n_shared_experts > 0,
                    "{shared_expert_intermediate_size} needs {n_shared_experts} > 0",
                    shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                    n_shared_experts=None)
        if self.n_shared_experts and self.shared_expert_intermediate_size is None:
            self.shared_expert_intermediate_size = (self.n_shared_experts
                                                    * self.moe_intermediate_size)
        self._check(self.num_experts_per_tok <= self.num_experts,
                    "{num_experts_per_tok} must be <= {num_experts}",
                    num_experts_per_tok=self.num_experts_per_tok, num_experts=self.num_experts)
        self._check(not self.moe_pad_to_capacity or self.capacity_factor is not None,
                    "{moe_pad_to_capacity} needs {capacity_factor} to be set",
                    moe_pad_to_capacity=True, capacity_factor=None)
        self._check(self.router_bias_update_rate == 0 or self.use_moe,
                    "{router_bias_update_rate} needs {use_moe} "
                    "(a dense model has no router)",
                    router_bias_update_rate=self.router_bias_update_rate, use_moe=True)


# The main job's model (`python train/pretrain.py`) is these defaults with the trainer's departures:
# the fused path (no host sync, the fastest) and routed scaling k (None: num_experts_per_tok). The
# layer's own defaults stay MiniMind's sorted path and scaling 1, which the acceptance test pins.
TRAINING_DEFAULTS = {"moe_impl": "fused", "routed_scaling_factor": None}


def trained_config(**fields) -> MiniMindConfig:
    """The config the trainer builds from `fields` (a checkpoint's config dict too: from_dict) over
    the defaults and TRAINING_DEFAULTS (with none: the main job's model); routed_scaling_factor None
    becomes num_experts_per_tok. Raises ConfigError / TypeError."""
    fields = {**TRAINING_DEFAULTS, **fields}
    if fields["routed_scaling_factor"] is None:
        fields["routed_scaling_factor"] = float(fields.get("num_experts_per_tok",
                                                           MiniMindConfig.num_experts_per_tok))
    return MiniMindConfig.from_dict(fields)


class ConfigError(ValueError):
    """An invalid MiniMindConfig value or combination. `template` names each field it is about as a
    `{field}` placeholder; `fields` maps it to the value to show beside its name (None: the name
    alone). str(): `MiniMindConfig: num_experts_per_tok=8 must be <= num_experts=4`;
    `worded(name_value)` writes each field as `name_value(field, value)` instead (the trainer's
    flags: `--num_experts_per_tok 8 must be <= --num_experts 4`)."""

    def __init__(self, template, **fields):
        self.template, self.fields = template, fields
        super().__init__("MiniMindConfig: " + self.worded(lambda name, value: name if value is None
                                                          else f"{name}={value!r}"))

    def worded(self, name_value):
        return self.template.format_map({name: name_value(name, value)
                                         for name, value in self.fields.items()})


def _is_a(value, annotation):
    """Whether `value` is of the field type `annotation` (one member of a union): bool is not an
    int, an int is a float, list[int] holds ints."""
    if annotation is type(None):
        return value is None
    if typing.get_origin(annotation) is list:
        return isinstance(value, list) and all(_is_a(v, int) for v in value)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)
