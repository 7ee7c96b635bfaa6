"""Attention with the scores written out: the engine for the model's F.scaled_dot_product_attention
where torch's fused CPU kernel is slow (under bf16 autocast at training lengths; train/engines.py
decides)."""
import torch
import torch.nn.functional as F


def explicit_attention(q_BHSD, k_BGLD, v_BGLD, attn_mask=None, is_causal=False,
                       enable_gqa=True, dropout_p=0.0):
    """softmax(q k^T / sqrt(Dh) + mask) v with the scores written out: two batched GEMMs and a
    softmax, the same function as F.scaled_dot_product_attention (same arguments; attn_mask bool,
    True = may attend, broadcast to [B, H, S, L]; is_causal needs S == L), at the cost of a
    [B, H, S, L] score buffer.

    The scores stay in q's dtype: torch's softmax of bf16 scores sums in fp32 and rounds once, the
    same probabilities as an fp32 softmax cast to bf16, without the fp32 copies of the [B, H, S, L]
    buffer. The 1/sqrt(Dh) scale goes on q (exact in bf16 when Dh is a power of 4, e.g. 64)."""
    H, G = q_BHSD.shape[1], k_BGLD.shape[1]
    if G != H:
        k_BGLD, v_BGLD = (k_BGLD.repeat_interleave(H // G, dim=1),
                          v_BGLD.repeat_interleave(H // G, dim=1))
    S, L = q_BHSD.shape[2], k_BGLD.shape[2]
    scores = (q_BHSD * q_BHSD.shape[-1] ** -0.5) @ k_BGLD.transpose(-1, -2)
    if is_causal:
        attn_mask = torch.ones(S, L, dtype=torch.bool, device=q_BHSD.device).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    probs = scores.softmax(-1).to(v_BGLD.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    return probs @ v_BGLD
