"""Token streams -> resumable batches of fixed-length windows.

The streams are 1-D arrays of token ids (the memory-mapped token caches of data/shards.py, or any
array): windows are gathered from them on demand, so nothing here holds a copy of the corpus.
"""
import numpy as np
import torch

from data.sources import DataError  # noqa: F401  (re-exported: where the trainer and scripts look for it)


class WindowBatches:
    """Batches of (seq_len + 1)-token windows starting every seq_len tokens of a stream (neighbours share
    one boundary token, so every token is predicted once per epoch), in an order reshuffled every epoch.

    tokens: 1-D array of ids (np.memmap welcome: only the windows of a batch are read). `next()` returns
    x, y: [B, S] int64 with y = x shifted by one. The order is a pure function of (seed, epoch), so
    `state_dict()` = {"epoch", "cursor"} resumes exactly.

    Raises DataError if the stream holds fewer than one window.
    """

    def __init__(self, tokens, seq_len, batch_size, seed=0, name="data"):
        self.tokens = tokens
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.num_windows = (len(self.tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise DataError(f"{name}: {len(self.tokens)} tokens is too little for one window of "
                            f"seq_len={seq_len} (+1); use a shorter --seq_len or more data")
        self.epoch, self.cursor = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch):
        g = torch.Generator().manual_seed(self.seed * 100003 + epoch)
        return torch.randperm(self.num_windows, generator=g).numpy()

    def state_dict(self):
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state):
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._epoch_order(self.epoch)

    def next(self):
        starts = []
        while len(starts) < self.batch_size:
            if self.cursor == self.num_windows:
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            take = min(self.batch_size - len(starts), self.num_windows - self.cursor)
            starts.extend(self._order[self.cursor:self.cursor + take] * self.seq_len)
            self.cursor += take
        idx = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(self.seq_len + 1)
        w = torch.from_numpy(np.asarray(self.tokens[idx], dtype=np.int64))
        return w[:, :-1], w[:, 1:]


def fixed_windows(tokens, seq_len, max_tokens):
    """The first windows of a stream (validation): [N, seq_len + 1] int64, about max_tokens tokens (only
    those are read). A stream shorter than one window yields one shorter window."""
    n = max(1, min((len(tokens) - 1) // seq_len, max(1, max_tokens // seq_len)))
    if len(tokens) - 1 < seq_len:
        return torch.from_numpy(np.asarray(tokens, dtype=np.int64))[None, :]
    t = torch.from_numpy(np.asarray(tokens[: n * seq_len + 1], dtype=np.int64))
    return t.unfold(0, seq_len + 1, seq_len)[:n].contiguous()


def unigram_entropy(tokens):
    """Entropy of the empirical token distribution, in nats: the loss of the best context-free model."""
    counts = np.bincount(np.asarray(tokens))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
