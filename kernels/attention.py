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
    buffer. The 1/sqrt(Dh) scale goes on q (exact in bf16 when Dh is a power of 4, e.g. 64).
    Grouped-query attention reads each key/value head once: the H/G query heads of a group are
    stacked along the query axis ([B, G, H/G * S, Dh], a view), so k and v are never repeated (the
    mask is tiled H/G times along that axis; a mask with a head axis of its own repeats k and v)."""
    (B, H, S, Dh), G, L = q_BHSD.shape, k_BGLD.shape[1], k_BGLD.shape[2]
    if is_causal:
        attn_mask = torch.ones(S, L, dtype=torch.bool, device=q_BHSD.device).tril()
    group = H // G
    if attn_mask is not None and attn_mask.dim() == 4 and attn_mask.shape[1] != 1:
        k_BGLD, v_BGLD = (k_BGLD.repeat_interleave(group, dim=1),
                          v_BGLD.repeat_interleave(group, dim=1))
        group = 1
    q_BGQD = (q_BHSD * Dh ** -0.5).reshape(B, H // group, group * S, Dh)
    scores = q_BGQD @ k_BGLD.transpose(-1, -2)
    if attn_mask is not None:
        if group > 1:  # query row j * S + s of a group is head j's position s
            attn_mask = attn_mask.repeat(*([1] * (attn_mask.dim() - 2)), group, 1)
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    probs = scores.softmax(-1).to(v_BGLD.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    return (probs @ v_BGLD).view(B, H, S, Dh)
