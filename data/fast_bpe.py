"""A faster encoder for byte-level BPE tokenizers: the same ids from `tiktoken` when the tokenizer allows it.

HF `tokenizers` and `tiktoken` run the same GPT-2 byte-level BPE (split with GPT-2's regex, then repeatedly
merge the adjacent pair whose merged token ranks lowest). HF ranks by position in `merges`, tiktoken by the
merged token's id: they agree when ids grow with merge order, as `tokenizers`' BpeTrainer numbers them.
`tiktoken_for` returns an Encoding only for tokenizers it can reproduce (no normalizer, plain ByteLevel with the
GPT-2 regex, BPE without dropout / prefixes / suffixes / byte fallback / ignore_merges, every byte in the vocab)
and that match `tokenizers` on probe texts (the caller also compares a corpus sample); else None.
"""
import json

GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
PROBES = ["Hello, world! It's 2026; don't   stop.\n\n\tTabs\r\nand CRLF", "emoji 🙂 中文 café naïve Ωmega",
          "numbers 1234567 3.14 -42 0x1F", "<|endoftext|>inside<|im_start|>text<|im_end|>", "   lead and trail   ",
          "def f(x):\n    return x ** 2  # comment", "''''' \"\"\" ``` ~~~", "a" * 300]


def _byte_decoder():
    """GPT-2's byte-level alphabet, reversed: the printable character each byte is written as -> the byte."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    rest = [b for b in range(256) if b not in bs]  # the other bytes are written as chr(256), chr(257)...
    return {chr(c): b for b, c in zip(bs + rest, bs + [256 + n for n in range(len(rest))])}


def tiktoken_for(tokenizer_json):
    """A tiktoken Encoding giving this tokenizer's ids, or None (not installed, or not reproducible)."""
    try:
        import tiktoken
        from tokenizers import Tokenizer
    except ImportError:
        return None
    with open(tokenizer_json, encoding="utf-8") as f:
        spec = json.load(f)
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if not (spec.get("normalizer") is None and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
            and not pre.get("add_prefix_space") and model.get("type") == "BPE" and model.get("dropout") is None
            and not model.get("continuing_subword_prefix") and not model.get("end_of_word_suffix")
            and not model.get("byte_fallback") and not model.get("ignore_merges")):
        return None
    vocab, merges, to_byte = spec["model"]["vocab"], spec["model"]["merges"], _byte_decoder()
    specials = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    try:  # (special tokens may sit in the BPE vocab too: they are matched before BPE, never merged into)
        ranks = {bytes(to_byte[ch] for ch in token): i for token, i in vocab.items() if token not in specials}
        merged = [vocab["".join(m.split(" ") if isinstance(m, str) else m)] for m in merges]
    except KeyError:  # a token outside the byte alphabet, or a merge whose result is not in the vocab
        return None
    if len(ranks) != len(vocab) - len(set(specials) & set(vocab)) or any(b >= a for a, b in zip(merged[1:], merged)) \
            or not all(bytes([b]) in ranks for b in range(256)) or set(ranks.values()) & set(specials.values()):
        return None
    try:
        enc = tiktoken.Encoding("bpe", pat_str=GPT2_SPLIT, mergeable_ranks=ranks, special_tokens=specials)
    except ValueError:
        return None
    hf = Tokenizer.from_file(tokenizer_json)
    return enc if same_ids(enc, hf, PROBES) else None


def encode(enc, text):
    """Ids of `text`; special-token text becomes the special token (as `tokenizers` treats added tokens)."""
    return enc.encode(text, allowed_special="all")


def same_ids(enc, hf_tokenizer, texts):
    """True when tiktoken and `tokenizers` give the same ids for every text."""
    hf_ids = [e.ids for e in hf_tokenizer.encode_batch(list(texts), add_special_tokens=False)]
    return all(encode(enc, t) == ids for t, ids in zip(texts, hf_ids))
