"""Byte-level BPE tokenizer trained with HF `tokenizers`, saved so `AutoTokenizer.from_pretrained` loads it.
Special tokens (fixed ids): 0 `<|endoftext|>` (document separator, pad, pretraining EOS), 1 `<|im_start|>` and
2 `<|im_end|>` (chat turns, ChatML as in MiniMind / Qwen)."""
import json
import os
import re

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from data.sources import DataError
from data.atomic import atomic_dir

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML; {% generation %} marks what an assistant turn is trained on (content and <|im_end|>), the SFT loss mask
# of apply_chat_template(return_assistant_tokens_mask=True). Rendering ignores the marks: plain ChatML.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_decoder():
    """GPT-2's byte-level alphabet, reversed: the printable character each byte is written as -> the byte."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    rest = [b for b in range(256) if b not in bs]  # the other bytes are written as chr(256), chr(257)...
    return {chr(c): b for b, c in zip(bs + rest, bs + [256 + n for n in range(len(rest))])}


def token_byte_lengths(tokenizer):
    """int64 [len(tokenizer)]: UTF-8 bytes each token id stands for (0 for specials), for bits per byte; exact via
    GPT-2's byte alphabet for byte-level BPE tokens (even part of a character), else `decode` of the id."""
    import numpy as np
    special, to_byte = set(tokenizer.all_special_ids), _byte_decoder()
    out = np.zeros(len(tokenizer), dtype=np.int64)
    for token, i in tokenizer.get_vocab().items():
        if i < len(out) and i not in special:
            out[i] = len(token) if all(ch in to_byte for ch in token) else len(tokenizer.decode([i]).encode("utf-8"))
    return out


def stop_token_ids(tokenizer):
    """Ids that end a generation: the tokenizer's eos and, when it has one, the chat turn end."""
    ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return [i for i in dict.fromkeys(ids) if isinstance(i, int) and i != tokenizer.unk_token_id]


# BPE training time grows with the square of a word's length (a 2 MB whitespace-free line would stall it for
# hours), so the training texts are cut where a run of non-space characters gets this long; encoding stays linear.
LONGEST_WORD = 256
_LONG_RUN = re.compile(r"\S{%d}" % LONGEST_WORD)


def bounded_words(texts, longest=LONGEST_WORD):
    """Each text, or where it holds a run of `longest` non-space characters, its consecutive `longest`-character
    pieces as separate texts (no word the trainer sees is longer)."""
    for text in texts:
        if _LONG_RUN.search(text) is None:
            yield text
        else:
            yield from (text[i:i + longest] for i in range(0, len(text), longest))


def train_tokenizer(texts, vocab_size):
    """A `PreTrainedTokenizerFast` byte-level BPE of `vocab_size` tokens (the trainer's: model/config.py's
    vocab_size) trained on an iterable of str (words cut to LONGEST_WORD characters). Raises ValueError if
    vocab_size cannot hold the 256 bytes plus the special tokens."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} must be >= {256 + len(SPECIAL_TOKENS)} (bytes + special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(bounded_words(texts), trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, f"special token {s} got id {tok.token_to_id(s)}, expected {i}"
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None, chat_template=CHAT_TEMPLATE,
                                   additional_special_tokens=SPECIAL_TOKENS[1:])


def save_tokenizer(tokenizer, out_dir):
    """Write the tokenizer files into out_dir atomically (data/atomic.py)."""
    with atomic_dir(out_dir) as tmp:
        tokenizer.save_pretrained(tmp)


def load_tokenizer(folder):
    """AutoTokenizer.from_pretrained(folder), or DataError naming the bad file: malformed JSON (line and column),
    or a tokenizer.json transformers cannot load."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    json.load(f)
            except ValueError as e:  # (JSONDecodeError, UnicodeDecodeError)
                raise DataError(f"{path}: malformed tokenizer file ({e})") from None
    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # tokenizers and transformers raise anything from KeyError to a bare Exception
        detail = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise DataError(f"{os.path.join(folder, 'tokenizer.json')}: not a tokenizer transformers can load "
                        f"({detail})") from None

