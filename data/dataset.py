"""Token streams (1-D id arrays, e.g. data/shards.py's memmaps) -> resumable batches of fixed-length windows,
gathered on demand: nothing here holds a copy of the corpus."""
import numpy as np
import torch

from data.sources import DataError  # noqa: F401  (re-exported for train/ and scripts)

# A label that predicts nothing (F.cross_entropy's default ignore_index): the loss mask travels in the labels
IGNORE_INDEX = -100


class EpochBatches:
    """`next()`: `_batch(items)` of the next batch_size items of `_epoch_items(generator)`, an order that is a pure
    function of (seed, epoch) (a batch may cross epochs), so `state_dict()` = {"epoch", "cursor"} resumes exactly."""

    def _start_epoch(self, epoch, cursor=0):
        self.epoch, self.cursor = epoch, cursor
        self._items = self._epoch_items(torch.Generator().manual_seed(self.seed * 100003 + epoch))

    def state_dict(self):
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state):
        self._start_epoch(int(state["epoch"]), int(state["cursor"]))

    def next(self):
        chosen = []
        while len(chosen) < self.batch_size:
            if self.cursor == len(self._items):
                self._start_epoch(self.epoch + 1)
            take = min(self.batch_size - len(chosen), len(self._items) - self.cursor)
            chosen.extend(self._items[self.cursor:self.cursor + take])
            self.cursor += take
        return self._batch(chosen)


class WindowBatches(EpochBatches):
    """Batches of (seq_len + 1)-token windows starting every seq_len tokens of `tokens` (1-D ids; a memmap is read
    only where a batch is), reshuffled every epoch: every token is predicted once per epoch. `next()`: x, y
    [B, S] int64, y = x shifted by one; resumable (EpochBatches). Raises DataError for under one window."""

    def __init__(self, tokens, seq_len, batch_size, seed=0, name="data"):
        self.tokens = tokens
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.num_windows = (len(self.tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise DataError(f"{name}: {len(self.tokens)} tokens is too little for one window of "
                            f"seq_len={seq_len} (+1); use a shorter --seq_len or more data")
        self._start_epoch(0)

    def _epoch_items(self, g):
        return torch.randperm(self.num_windows, generator=g).numpy()

    def _batch(self, windows):
        idx = np.asarray(windows, dtype=np.int64)[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        w = torch.from_numpy(np.asarray(self.tokens[idx], dtype=np.int64))
        return w[:, :-1], w[:, 1:]


def fixed_windows(tokens, seq_len, max_tokens):
    """The first windows of a stream (validation): [N, seq_len + 1] int64, about max_tokens tokens (only those
    are read); a stream shorter than one window yields one shorter window."""
    n = max(1, min((len(tokens) - 1) // seq_len, max(1, max_tokens // seq_len)))
    if len(tokens) - 1 < seq_len:
        return torch.from_numpy(np.asarray(tokens, dtype=np.int64))[None, :]
    t = torch.from_numpy(np.asarray(tokens[: n * seq_len + 1], dtype=np.int64))
    return t.unfold(0, seq_len + 1, seq_len)[:n].contiguous()

