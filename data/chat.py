"""Conversations for supervised fine-tuning: read and checked, rendered with the chat template into token ids
with the assistant mask, and packed into fixed windows that keep conversations apart.

Input: jsonl, one conversation per line, `{"conversations": [{"role": ..., "content": ...}, ...]}` (MiniMind's
SFT format) or `{"messages": [...]}` (OpenAI / HF). Roles: an optional `system` turn, then `user` / `assistant`
alternating, ending with `assistant`; a line breaking this, or an empty assistant turn, is a DataError (file:line).
Loss mask: exactly each assistant turn's content tokens and its `<|im_end|>`, from the chat template's
`{% generation %}` block (data/tokenizer.py), so training sees the tokens chat does. Text spelling a special
token inside a message becomes that token.
"""
import hashlib
import os
import re

import numpy as np
import torch

from data.atomic import atomic_file
from data.sources import DataError, file_sha1, jsonl_records
from data.dataset import IGNORE_INDEX, EpochBatches

ROLES = ("system", "user", "assistant")


def check_conversation(obj, where):
    """The list of {"role", "content"} messages of one record, checked. Raises DataError naming `where`."""
    if isinstance(obj, dict) and "conversations" in obj and "messages" in obj:
        raise DataError(f"{where}: both \"conversations\" and \"messages\": keep one")
    messages = obj.get("conversations", obj.get("messages")) if isinstance(obj, dict) else None
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: expected an object with a non-empty \"conversations\" or \"messages\" list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: message {i + 1} needs a \"role\" ({', '.join(ROLES)}) and a string \"content\"")
        out.append({"role": m["role"], "content": m["content"]})
    turns = out[1:] if out[0]["role"] == "system" else out
    for i, m in enumerate(turns):
        want = "user" if i % 2 == 0 else "assistant"
        if m["role"] != want:
            raise DataError(f"{where}: message {i + 1 + len(out) - len(turns)} is a {m['role']} turn where a {want} "
                            f"turn is expected (system first if any, then user / assistant alternating)")
        if want == "assistant" and not m["content"].strip():
            raise DataError(f"{where}: message {i + 1 + len(out) - len(turns)}: empty assistant turn")
    if not turns or turns[-1]["role"] != "assistant":
        raise DataError(f"{where}: the conversation must end with an assistant turn")
    return out


def tokenize_conversation(tokenizer, messages, add_generation_prompt=False):
    """(ids int64 [L], mask bool [L]): the conversation rendered with the tokenizer's chat template and the mask
    of its `{% generation %}` spans (each assistant content and its <|im_end|>).

    Tokenized piece by piece: the template's text apart from each message's content. Tokenizing the rendered
    string whole lets byte-level BPE merge a header's "\\n" with content that starts with whitespace
    ("\\n    code"), a token the chat prompt (which ends with the header) is never followed by. Pieces keep
    every prompt (`add_generation_prompt=True`) a prefix of the training ids. A template that rewrites the
    content (e.g. strips it) cannot be cut there and is tokenized whole."""
    text, spans = _render(tokenizer, messages, add_generation_prompt)
    cuts = sorted({0, len(text)} | {i for span in spans for i in span}
                  | _content_edges(tokenizer, messages, text, add_generation_prompt))
    pieces = [(a, text[a:b]) for a, b in zip(cuts, cuts[1:]) if b > a]
    ids = tokenizer([p for _, p in pieces], add_special_tokens=False)["input_ids"] if pieces else []
    mask = [any(s <= a < e for s, e in spans) for (a, _), piece in zip(pieces, ids) for _ in piece]
    return np.asarray([t for piece in ids for t in piece], dtype=np.int64), np.asarray(mask, dtype=bool)


def _content_edges(tokenizer, messages, text, add_generation_prompt):
    """Where each message's content starts and ends in `text` (found by rendering private-use marks in place of
    the contents); an empty set when the template does not copy contents verbatim."""
    marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
    shape, _ = _render(tokenizer, [{**m, "content": k} for m, k in zip(messages, marks)], add_generation_prompt)
    edges, at, done = set(), 0, 0  # where the previous content ends, in text and in shape
    for m, mark in zip(messages, marks):
        k = shape.find(mark, done)
        start = at + k - done
        if k < 0 or text[at:start] != shape[done:k] or text[start:start + len(m["content"])] != m["content"]:
            return set()
        at, done = start + len(m["content"]), k + len(mark)
        edges |= {start, at}
    return edges if text[at:] == shape[done:] else set()


def has_generation_block(template):
    """Whether a chat template marks the assistant tokens with `{% generation %}` (the SFT loss mask)."""
    return re.search(r"\{%-?\s*generation\s*-?%\}", str(template or "")) is not None


def _render(tokenizer, messages, add_generation_prompt):
    """(text, [(start, end) of each {% generation %} span]) of the chat template (transformers' renderer)."""
    from transformers.utils.chat_template_utils import render_jinja_template
    template = tokenizer.chat_template
    marked = has_generation_block(template)
    text, spans = render_jinja_template([messages], chat_template=template, return_assistant_tokens_mask=marked,
                                        add_generation_prompt=add_generation_prompt, **tokenizer.special_tokens_map)
    return text[0], [tuple(s) for s in spans[0]] if marked else []


class Conversations:
    """Tokenized conversations back to back: ids [N] int64, mask [N] bool, offsets [n + 1] int64; truncated /
    dropped: conversations cut to the window / left out (no assistant token in it); sha1: the source's hash."""

    def __init__(self, ids, mask, offsets, truncated=0, dropped=0, sha1=""):
        self.ids, self.mask, self.offsets = ids, mask, offsets
        self.truncated, self.dropped, self.sha1 = truncated, dropped, sha1

    @classmethod
    def concat(cls, parts, **kw):
        """Conversations of a list of (ids, mask) pairs; kw: truncated, dropped, sha1."""
        return cls(np.concatenate([p[0] for p in parts] or [np.zeros(0, np.int64)]),
                   np.concatenate([p[1] for p in parts] or [np.zeros(0, bool)]),
                   np.concatenate(([0], np.cumsum([len(p[0]) for p in parts]))).astype(np.int64), **kw)

    def select(self, indices):
        """The conversations at `indices` (in that order), as a new Conversations."""
        return Conversations.concat([self[i] for i in indices], sha1=self.sha1)

    def __len__(self):
        return len(self.offsets) - 1

    def __getitem__(self, i):
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.ids[a:b], self.mask[a:b]

    @property
    def supervised_tokens(self):
        return int(self.mask.sum())


def load_conversations(path, tokenizer, max_len, cache_dir, log=print):
    """Conversations of a file in file order (cached by file, tokenizer and max_len); one over max_len tokens
    is cut to it, or left out when no assistant token remains (a note says how many). Raises DataError
    (file:line, or what to change)."""
    conv = _load_conversations(path, tokenizer, max_len, cache_dir)
    if conv.truncated or conv.dropped:
        log(f"note: {conv.truncated + conv.dropped} conversations of {path} are longer than --seq_len {max_len} "
            f"tokens: {conv.truncated} cut to it (their end is not trained on), {conv.dropped} left out (no "
            f"assistant token within it)")
    return conv


def _load_conversations(path, tokenizer, max_len, cache_dir):
    sha1 = file_sha1(path) if os.path.isfile(path) else ""
    cache = os.path.join(cache_dir, f"sft-tokens-v3-{sha1[:16]}-{_tokenizer_hash(tokenizer)}-{max_len}.npz")
    if sha1 and os.path.exists(cache):
        z = np.load(cache)
        return Conversations(z["ids"], z["mask"], z["offsets"], int(z["truncated"]), int(z["dropped"]), sha1)
    if not sha1:
        raise DataError(f"{path}: conversation file not found")
    parts, truncated, dropped = [], 0, 0
    for obj, where in jsonl_records(path):
        x, m = tokenize_conversation(tokenizer, check_conversation(obj, where))
        if len(x) > max_len:
            x, m = x[:max_len], m[:max_len]
            if not m[1:].any():
                dropped += 1
                continue
            truncated += 1
        parts.append((x, m))
    if not parts:
        raise DataError(f"{path}: no conversation" + (f" has an assistant token within --seq_len {max_len} tokens; "
                                                      f"raise --seq_len" if dropped else ""))
    conv = Conversations.concat(parts, truncated=truncated, dropped=dropped, sha1=sha1)
    with atomic_file(cache) as f:
        np.savez(f, ids=conv.ids, mask=conv.mask, offsets=conv.offsets, truncated=truncated, dropped=dropped)
    return conv


def _tokenizer_hash(tokenizer):
    h = hashlib.sha1(tokenizer.backend_tokenizer.to_str().encode())
    h.update(str(tokenizer.chat_template).encode())
    return h.hexdigest()[:12]


def pack(lengths, order, seq_len):
    """Greedy packing of the conversations in `order` into seq_len windows (one that does not fit in what is
    left starts the next): a list of lists of indices."""
    windows, current, room = [], [], seq_len
    for i in order:
        n = int(lengths[i])
        if n > room and current:
            windows.append(current)
            current, room = [], seq_len
        current.append(int(i))
        room -= n
    if current:
        windows.append(current)
    return windows


def window_tensors(conv, windows, seq_len, pad_id):
    """x, y, segment_ids [W, seq_len] int64 for packed windows: position t predicts token t + 1 where that is an
    assistant token (else IGNORE_INDEX), never across conversations. Padding: pad_id, segment -1."""
    x, y, seg = (torch.full((len(windows), seq_len), fill, dtype=torch.int64) for fill in (pad_id, IGNORE_INDEX, -1))
    for w, members in enumerate(windows):
        pos = 0
        for j, i in enumerate(members):
            ids, mask = conv[i]
            n = len(ids)
            x[w, pos:pos + n] = torch.from_numpy(ids)
            y[w, pos:pos + n - 1] = torch.from_numpy(np.where(mask[1:], ids[1:], IGNORE_INDEX))
            seg[w, pos:pos + n] = j
            pos += n
    return x, y, seg


class PackedBatches(EpochBatches):
    """Batches of packed windows (x, y, segment_ids), each [batch_size, seq_len] int64: conversations permuted
    by (seed, epoch), then packed greedily; resumable (data/dataset.py's EpochBatches)."""

    def __init__(self, conv, seq_len, batch_size, pad_id, seed=0):
        self.conv, self.seq_len, self.batch_size, self.pad_id, self.seed = conv, seq_len, batch_size, pad_id, seed
        self.lengths = np.diff(conv.offsets)
        self._start_epoch(0)

    def _epoch_items(self, g):
        return pack(self.lengths, torch.randperm(len(self.conv), generator=g).tolist(), self.seq_len)

    def _batch(self, windows):
        return window_tensors(self.conv, windows, self.seq_len, self.pad_id)
