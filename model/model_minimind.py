"""MiniMind-style causal LM: GQA attention with per-head q/k RMSNorm, RoPE, RMSNorm, SwiGLU or MoE
FFN.

Shape legend: B batch, S query length, L key length (cache + S), D hidden size, H query heads,
G key/value heads, Dh head dim, V vocab.

The block is the MiniMind-3 / Qwen3 block (pre-norm, q/k norm before RoPE, rotate-half RoPE, tied
embeddings) with HF parameter names: a checkpoint maps onto `Qwen3MoeForCausalLM` by renaming. Plain
PyTorch by default; the engines of the linears, the attention kernel, the LM loss and the MoE
experts and dispatch are chosen when the model is built (model/engines.py; the trainer's come from
train/engines.py).
"""
import hashlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.config import MiniMindConfig
from model.engines import PLAIN, Engines
from model.moe import Experts, FeedForward, MOEFeedForward, local_shard
from model.router import layer_mean


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in fp32 and cast back (as Qwen3, for export
    parity)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_tables(head_dim: int, max_len: int, theta: float):
    """cos, sin: [max_len, head_dim] fp32 tables for rotate-half RoPE (Su et al. 2021, RoFormer)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(max_len, dtype=torch.int64).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    """x: [B, heads, S, Dh]; cos/sin: [S, Dh] (every row at the same positions) or [B, 1, S, Dh]
    (per-row positions, e.g. left padding). Rotates pairs (i, i + Dh/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class KVCache:
    """The keys and values of every layer for generation, written in place: keys / values
    [layers, B, G, capacity, Dh] allocated once (at the first write, in the keys' dtype and device),
    `length` positions held. Given the run's length as `capacity` (prompt + new tokens: `generate`
    does), no step copies the cache; a write past it reallocates with twice the room. What a forward
    with use_cache=True returns as past_key_values and takes back (the same object, `length`
    advanced by the call's tokens, with use_cache or without). Under autograd each layer reads a
    copy of its keys and values (a later write in place would change what backward saved)."""

    def __init__(self, num_layers, capacity=0):
        self.num_layers, self.capacity, self.length = num_layers, capacity, 0
        self.keys = self.values = None

    def write(self, layer, k_BGSD, v_BGSD):
        """Store layer `layer`'s keys and values of the call's S positions after the `length` held;
        returns that layer's keys and values so far, [B, G, length + S, Dh] (views; copies under
        autograd). Raises ValueError when the batch or heads differ from what the cache holds."""
        end = self.length + k_BGSD.shape[2]
        if self.keys is not None and k_BGSD.shape[:2] != self.keys.shape[1:3]:
            raise ValueError(f"KVCache holds batch x kv heads {tuple(self.keys.shape[1:3])}, "
                             f"got {tuple(k_BGSD.shape[:2])}")
        if self.keys is None or end > self.keys.shape[3]:
            self._reserve(k_BGSD, max(end, self.capacity, 2 * self.length))
        self.keys[layer, :, :, self.length:end] = k_BGSD
        self.values[layer, :, :, self.length:end] = v_BGSD
        k_all, v_all = self.keys[layer, :, :, :end], self.values[layer, :, :, :end]
        return (k_all.clone(), v_all.clone()) if torch.is_grad_enabled() else (k_all, v_all)

    def _reserve(self, like_BGSD, capacity):
        B, G, _, Dh = like_BGSD.shape
        keys, values = (like_BGSD.new_empty(self.num_layers, B, G, capacity, Dh) for _ in range(2))
        if self.keys is not None:  # (a forward past the capacity given: its positions kept)
            keys[:, :, :, :self.length] = self.keys[:, :, :, :self.length]
            values[:, :, :, :self.length] = self.values[:, :, :, :self.length]
        self.keys, self.values, self.capacity = keys, values, capacity


class Attention(nn.Module):
    """GQA attention; `attend` is the kernel (an Engines.attend, called as
    F.scaled_dot_product_attention), `decode_attend` the one of a decode step (queries after the
    KV cache's positions, outside autograd; None: attend)."""

    def __init__(self, config: MiniMindConfig, linear=nn.Linear,
                 attend=F.scaled_dot_product_attention, decode_attend=None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        self.attend, self.decode_attend = attend, decode_attend or attend
        self.q_proj = linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x_BSD, cos, sin, cache=None, layer=0, attn_mask_B1SL=None):
        """cache: a KVCache holding the positions before these S (this layer's keys and values go
        into it, at index `layer`), or None; attn_mask_B1SL: bool [B, 1, S, L] (True = may attend),
        already causal; None = plain causal."""
        B, S, _ = x_BSD.shape
        q = (self.q_norm(self.q_proj(x_BSD).view(B, S, self.num_heads, self.head_dim))
             .transpose(1, 2))
        k = (self.k_norm(self.k_proj(x_BSD).view(B, S, self.num_kv_heads, self.head_dim))
             .transpose(1, 2))
        v = self.v_proj(x_BSD).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.write(layer, k, v)
        L = k.shape[2]
        if attn_mask_B1SL is not None:
            mask, causal = attn_mask_B1SL, False
        elif S == L:
            mask, causal = None, True
        elif S == 1:
            mask, causal = None, False
        else:  # several new queries after a cache: query i sees keys up to L - S + i
            mask = torch.ones(S, L, dtype=torch.bool, device=x_BSD.device).tril(diagonal=L - S)
            causal = False
        attend = self.decode_attend if S < L and not torch.is_grad_enabled() else self.attend
        out = attend(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True,
                     dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.o_proj(out.transpose(1, 2).reshape(B, S, -1)))

    def extra_repr(self):
        return (f"attend={self.attend.__name__}" + (
            f", decode_attend={self.decode_attend.__name__}"
            if self.decode_attend is not self.attend else ""))


class MiniMindBlock(nn.Module):
    def __init__(self, config: MiniMindConfig, engines: Engines = PLAIN):
        super().__init__()
        self.self_attn = Attention(config, engines.linear, engines.attend, engines.decode_attend)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = (MOEFeedForward(config, engines.experts, engines.movers, engines.linear)
                    if config.use_moe
                    else FeedForward(config.hidden_size, config.intermediate_size, engines.linear))
        self.mlp_dropout = nn.Dropout(config.dropout)

    def forward(self, x, cos, sin, cache=None, layer=0, token_mask=None, attn_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, attn_mask)
        h = self.post_attention_layernorm(x)
        h = (self.mlp(h, token_mask)
             if isinstance(self.mlp, MOEFeedForward) and token_mask is not None else self.mlp(h))
        return x + self.mlp_dropout(h)


def keyed_normal(shape, std, seed, key):
    """fp32 [shape] ~ N(0, std^2), drawn on the CPU from a generator seeded by SHA-256 of
    (seed, key): the same draws for the same key whatever was drawn before or elsewhere."""
    digest = hashlib.sha256(f"{seed}/{key}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.empty(shape).normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_weights(model: nn.Module, std: float, seed: int):
    """GPT-2's init of `model`'s parameters and buffers: linear, embedding and expert weights
    ~ N(0, std^2), norm weights 1, buffers (the router's expert_bias) 0. Each weight is drawn
    from its own key (`keyed_normal`): its name in `model`, and for a stacked expert weight its
    name and the expert's index, one expert at a time. So the values are a function of the seed
    alone: the same on any device and under expert parallelism at any world size, where a
    stacked weight is a DTensor of this rank's experts and only those are drawn. Tensors on the
    meta device are skipped."""
    ones = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    stacked = {id(p) for m in model.modules() if isinstance(m, Experts) for p in m.parameters()}
    for name, param in model.named_parameters():
        local = local_shard(param)
        if local.is_meta:
            continue
        if id(param) in ones:
            local.fill_(1.0)
        elif id(param) in stacked:  # (under EP a DTensor sharded on the expert dimension)
            first = param.device_mesh.get_local_rank() * len(local) if local is not param else 0
            for index, expert in enumerate(local):
                expert.copy_(keyed_normal(expert.shape, std, seed, f"{name}.{first + index}"))
        else:
            local.copy_(keyed_normal(local.shape, std, seed, name))
    for buffer in model.buffers():
        if not buffer.is_meta:
            buffer.zero_()


class MiniMindModel(nn.Module):
    """Decoder stack. forward(input_ids [B, S] int64, past_key_values (a KVCache of the P positions
    before these, or None), use_cache, attention_mask [B, P + S] (1 = token, 0 = padding) or None)
    -> hidden [B, S, D], the KVCache with these positions added (use_cache; a new one when none was
    given) or None, aux_loss (scalar: the MoE layers' router losses averaged over layers, so one
    layer's imbalance cannot offset another's and the scale does not grow with depth).

    segment_ids [B, S] int64 (packed training windows): positions with equal ids form one sequence;
    each attends only within its own sequence, positions restart at 0 where a sequence starts, and
    id -1 marks padding (no expert, no router statistic). Sequences must be contiguous runs.

    With an attention_mask, padding (left or right) is invisible: no real token attends to it,
    positions (RoPE) count real tokens only, and the MoE layers send it to no expert and leave it
    out of every router statistic. A padded position attends to itself only (so its row stays
    finite); its output is junk.
    """

    def __init__(self, config: MiniMindConfig, engines: Engines = PLAIN):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(MiniMindBlock(config, engines)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # RoPE tables: built on first use on the input's device, not buffers, so nothing can leave
        # them stale (from_pretrained materialises non-persistent buffers from the meta device
        # uninitialised).
        self._rope = None

    def rope(self, start, length, device, position_ids_BS=None):
        """cos, sin for positions start..start+length-1 ([length, head_dim] fp32), or for the given
        per-row positions ([B, 1, S, head_dim])."""
        if self._rope is None or self._rope[0].device != device:
            cfg = self.config
            self._rope = tuple(t.to(device)
                               for t in rope_tables(cfg.head_dim, cfg.max_position_embeddings,
                                                    cfg.rope_theta))
        cos, sin = self._rope
        if position_ids_BS is not None:
            return cos[position_ids_BS].unsqueeze(1), sin[position_ids_BS].unsqueeze(1)
        return cos[start:start + length], sin[start:start + length]

    def forward(self, input_ids, past_key_values=None, use_cache=False, attention_mask=None,
                segment_ids=None):
        B, S = input_ids.shape
        if B == 0 or S == 0:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} is empty: "
                             "need at least one sequence of one token")
        cache = past_key_values
        if cache is not None and not isinstance(cache, KVCache):
            raise TypeError(f"past_key_values: the KVCache a forward with use_cache=True returned, "
                            f"got {type(cache).__name__}")
        if cache is None and use_cache:
            cache = KVCache(len(self.layers), capacity=S)
        start = cache.length if cache is not None else 0
        if start + S > self.config.max_position_embeddings:
            raise ValueError(f"sequence of {start + S} tokens exceeds max_position_embeddings="
                             f"{self.config.max_position_embeddings}")
        token_mask = attn_mask = position_ids = None
        if segment_ids is not None:
            if attention_mask is not None or start:
                raise ValueError("segment_ids (packed sequences) go without attention_mask "
                                 "and without a KV cache")
            token_mask, attn_mask, position_ids = segment_masks(segment_ids, B, S)
        elif attention_mask is not None:
            token_mask, attn_mask, position_ids = padding_masks(attention_mask, B, S, start)
        cos, sin = self.rope(start, S, input_ids.device, position_ids)
        h = self.dropout(self.embed_tokens(input_ids))
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, cache, i, token_mask, attn_mask)
        if cache is not None:
            cache.length += S
        aux_loss = layer_mean((layer.mlp.aux_loss for layer in self.layers
                               if isinstance(layer.mlp, MOEFeedForward)), h)
        return self.norm(h), (cache if use_cache else None), aux_loss


def segment_masks(segment_ids, B, S):
    """From segment ids [B, S] (packed sequences, -1 = padding) to: token_mask [B, S] bool
    (not padding); the attention mask [B, 1, S, S] bool (causal, within one sequence:
    block-diagonal); position_ids [B, S] (the index within the sequence). Raises ValueError on a
    shape that does not fit input_ids."""
    if segment_ids.shape != (B, S):
        raise ValueError(f"segment_ids {tuple(segment_ids.shape)} "
                         f"must have input_ids' shape ({B}, {S})")
    pos_S = torch.arange(S, device=segment_ids.device)
    starts_BS = torch.ones_like(segment_ids, dtype=torch.bool)
    starts_BS[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    # where each position's sequence starts
    first_BS = torch.where(starts_BS, pos_S, 0).cummax(dim=1).values
    same_BSS = segment_ids[:, :, None] == segment_ids[:, None, :]
    attn_mask_B1SS = (same_BSS & (pos_S[None, :] <= pos_S[:, None])).unsqueeze(1)
    return segment_ids >= 0, attn_mask_B1SS, pos_S - first_BS


def padding_masks(attention_mask, B, S, past):
    """From an HF-style attention_mask [B, past + S] (1 = token, 0 = padding; [B, S] also accepted
    when there is no cache) to: token_mask [B, S] bool for the new positions; the attention mask
    [B, 1, S, L] bool (causal, no padded key, every query sees at least itself); position_ids [B, S]
    int64 counting only real tokens (so a left-padded prompt gets the positions it has alone).
    Raises ValueError on a shape that does not fit input_ids and the cache."""
    L = past + S
    if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] != L:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must be "
                         f"[batch, cached + new tokens] = [{B}, {L}] ({past} cached, {S} new)")
    key_mask_BL = attention_mask.to(torch.bool)
    position_ids_BS = (key_mask_BL.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
    q_pos_S1 = torch.arange(past, L, device=key_mask_BL.device)[:, None]
    k_pos_1L = torch.arange(L, device=key_mask_BL.device)[None, :]
    attn_mask_B1SL = (((k_pos_1L <= q_pos_S1) & key_mask_BL[:, None, None, :])
                      | (k_pos_1L == q_pos_S1))
    return key_mask_BL[:, past:], attn_mask_B1SL, position_ids_BS


@dataclass
class MiniMindCausalLMOutput:
    """loss = ce_loss + aux_loss (scalars, fp32); logits [B, S, V]; past_key_values: the KVCache
    (use_cache)."""
    loss: torch.Tensor | None = None
    ce_loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    past_key_values: KVCache | None = None


class MiniMindForCausalLM(nn.Module):
    """Causal LM head on MiniMindModel. forward(input_ids [B, S] int64, labels [B, S] int64 or None
    (position t predicts labels[:, t]; -100 ignored), past_key_values, use_cache, attention_mask,
    segment_ids (see MiniMindModel), logits_to_keep (without labels: logits of the last N positions
    only; 0 = all)) -> MiniMindCausalLMOutput(loss = ce_loss + aux_loss, ce_loss,
    aux_loss, logits [B, S, V] in the compute dtype (None with labels under an Engines.lm_loss,
    which makes no logits), past_key_values: the KVCache with these positions when use_cache).
    engines: what each part runs on (model/engines.py; plain PyTorch by default)."""

    def __init__(self, config: MiniMindConfig, engines: Engines = PLAIN):
        super().__init__()
        self.config = config
        self.chunked_lm_loss = engines.lm_loss
        self.model = MiniMindModel(config, engines)
        self.lm_head = engines.linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        # keyed by a seed from torch's RNG: `torch.manual_seed(s)` first gives the same model
        init_weights(self, config.initializer_range, int(torch.randint(2**62, (), device="cpu")))

    def tie_weights(self):
        """The LM head shares the embedding's weight (tie_word_embeddings; again after `to_empty`,
        which unties them)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, labels=None, past_key_values=None, use_cache=False,
                attention_mask=None, segment_ids=None, logits_to_keep=0, **_):
        h, presents, aux_loss = self.model(input_ids, past_key_values, use_cache,
                                           attention_mask, segment_ids)
        loss = ce_loss = None
        if logits_to_keep < 0:
            raise ValueError(f"logits_to_keep {logits_to_keep}: the last N positions, N >= 0 "
                             "(0 = all)")
        if labels is None:  # (logits_to_keep: the last N positions' only, as in transformers)
            logits = self.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h)
        else:
            logits, ce_loss = self.lm_loss(h, labels)
            loss = ce_loss + aux_loss
        return MiniMindCausalLMOutput(loss=loss, ce_loss=ce_loss, aux_loss=aux_loss, logits=logits,
                                      past_key_values=presents)

    def lm_loss(self, h_BSD, labels_BS):
        """(logits [B, S, V], mean cross-entropy over labels != -100 in fp32); (None, the loss)
        under an Engines.lm_loss."""
        if self.chunked_lm_loss is not None:
            return None, self.chunked_lm_loss(h_BSD.reshape(-1, h_BSD.shape[-1]),
                                              self.lm_head.weight, labels_BS.reshape(-1))
        logits = self.lm_head(h_BSD)
        return logits, F.cross_entropy(logits.float().view(-1, logits.shape[-1]),
                                       labels_BS.reshape(-1), ignore_index=-100)

    def extra_repr(self):
        return (f"lm_loss={self.chunked_lm_loss.__name__}" if self.chunked_lm_loss is not None
                else "")

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens=64, temperature=1.0, top_k=0, top_p=1.0,
                 eos_token_id=None, use_cache=True, generator=None,
                 attention_mask=None, streamer=None):
        """Autoregressive sampling: input_ids [B, S] int64 -> [B, S + n] int64 (n <=
        max_new_tokens). Prompts of different lengths go left-padded with attention_mask [B, S]
        (`left_pad`): each row continues as it would alone. temperature 0 = greedy; top_k 0 / top_p
        1.0 = off. Stops once every row produced one of `eos_token_id` (int or list).
        use_cache=False recomputes the prefix (the tests' reference). streamer: put(ids) / end()
        (transformers' TextStreamer), given the prompt, then each new token."""
        eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or [])
        # the cache for the whole run, allocated once: no step copies it
        length = min(input_ids.shape[1] + max_new_tokens, self.config.max_position_embeddings)
        past = KVCache(self.config.num_hidden_layers, capacity=length) if use_cache else None
        ids, finished = input_ids, torch.zeros(input_ids.shape[0], dtype=torch.bool,
                                               device=input_ids.device)
        step_input, mask = input_ids, attention_mask
        if streamer is not None:
            streamer.put(input_ids.cpu())
        for _ in range(max_new_tokens):
            if ids.shape[1] >= self.config.max_position_embeddings:
                break
            out = self(step_input if use_cache else ids, past_key_values=past, use_cache=use_cache,
                       attention_mask=mask, logits_to_keep=1)
            logits = out.logits[:, -1, :].float()
            next_id = sample_next(logits, temperature, top_k, top_p, generator)
            if eos:
                next_id = torch.where(finished, torch.full_like(next_id, next(iter(eos))), next_id)
                finished |= torch.isin(next_id, torch.tensor(sorted(eos), device=ids.device))
            ids = torch.cat([ids, next_id[:, None]], dim=1)
            if streamer is not None:
                streamer.put(next_id.cpu())
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            past, step_input = (out.past_key_values, next_id[:, None]) if use_cache else (None, ids)
            if eos and bool(finished.all()):
                break
        if streamer is not None:
            streamer.end()
        return ids


def left_pad(prompts, pad_id=0, device=None):
    """A batch of token-id lists of different lengths -> (input_ids [B, S] int64, attention_mask
    [B, S] int64), right-aligned (left padding with pad_id), as `generate` wants them. Raises
    ValueError on an empty list or an empty prompt."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("left_pad needs at least one prompt and no empty prompt")
    S = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), S), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), S), dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, S - len(p):] = torch.as_tensor(p, dtype=torch.long)
        mask[b, S - len(p):] = 1
    return ids, mask


def sample_next(logits_BV, temperature=1.0, top_k=0, top_p=1.0, generator=None):
    """Pick one token per row from fp32 logits [B, V]: greedy when temperature == 0, else sample
    after temperature scaling, top-k (the k highest logits; ties at the k-th cut by position) and
    nucleus (top-p, Holtzman et al. 2019: the smallest prefix of those whose mass reaches top_p)
    filtering. The filters run on the top-k candidates alone, sorted once (topk), not on all V.
    Returns [B] int64."""
    if temperature <= 0:  # (max's indices: argmax's, the first of equal values; faster on CPU)
        return logits_BV.max(dim=-1).indices
    logits_BV = logits_BV / temperature
    V = logits_BV.shape[-1]
    if not (top_k and top_k < V) and top_p >= 1.0:
        return torch.multinomial(logits_BV.softmax(-1), 1, generator=generator).squeeze(-1)
    values_BK, ids_BK = torch.topk(logits_BV, top_k if top_k and top_k < V else V, dim=-1)
    if top_p < 1.0:  # (values_BK descending: each row's prefix mass)
        probs_BK = values_BK.softmax(-1)
        values_BK = values_BK.masked_fill(probs_BK.cumsum(-1) - probs_BK > top_p, float("-inf"))
    choice_B1 = torch.multinomial(values_BK.softmax(-1), 1, generator=generator)
    return ids_BK.gather(-1, choice_B1).squeeze(-1)
