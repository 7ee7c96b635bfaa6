"""What each swappable part of the model runs on, chosen when the model is built.

`MiniMindForCausalLM(config, engines)` builds every part from an `Engines`: its defaults are the
plain PyTorch of model/ (what the tests hold every engine against); train/engines.py:
`engines_for(config, device, dtype)` picks the faster ones that pay on a device, and the trainer
builds its model with them. An engine keeps the parameters and state_dict keys of the part it stands
for (checkpoints and exports are the same either way), and `print(model)` names each one.
"""
from dataclasses import dataclass
from typing import Callable

import torch.nn.functional as F
from torch import nn

from model.dispatch import PLAIN_MOVERS, RowMovers
from model.moe import expert_loop


@dataclass(frozen=True)
class Engines:
    """linear: class of the bias-free projections outside the MoE router and experts (attention,
    dense FFN, shared experts, LM head), nn.Linear or a subclass; attend: the attention kernel,
    called as F.scaled_dot_product_attention; decode_attend: the same for a decode step (queries
    after a KV cache's positions, outside autograd), or None (attend); lm_loss: (h_ND, lm_head
    weight_VD, labels_N int64) -> mean cross-entropy over labels != -100 in fp32, without logits,
    or None (logits, then F.cross_entropy); experts: the function that runs the routed experts on
    their stacked weights (model/moe.py: expert_loop's interface); movers: the row movers of the
    fused path's permute and combine (model/dispatch.py: RowMovers)."""
    linear: type = nn.Linear
    attend: Callable = F.scaled_dot_product_attention
    decode_attend: Callable | None = None
    lm_loss: Callable | None = None
    experts: Callable = expert_loop
    movers: RowMovers = PLAIN_MOVERS


PLAIN = Engines()
