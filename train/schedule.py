"""Learning-rate schedule: a pure function of the step (or, under --time_budget_s, of the training time used,
which the checkpoint carries), so a resumed run cannot get it wrong; and the clock of that training time."""
import contextlib
import math
import time


def lr_at(step, max_steps, lr, warmup_steps, min_lr_ratio=0.1, progress=None):
    """Linear warmup from lr/warmup to lr over `warmup_steps`, then cosine decay to lr * min_lr_ratio at
    `max_steps`. step is 0-based (the optimizer step about to be taken). `progress` (a run planned by time:
    the fraction of its budget used) replaces the step's progress through the decay; it is not rescaled to
    start at 0 after the warmup, so the LR drops slightly there (to 0.98 lr after a warmup of 10% of the budget)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if progress is None:
        progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    progress = min(1.0, progress)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class TrainClock:
    """Seconds of training wall clock: from `start()` on, except inside `paused()` blocks (evaluation,
    checkpoint saving), plus `elapsed_s` of earlier invocations (a resumed checkpoint's)."""

    def __init__(self, elapsed_s=0.0):
        self._done, self._since = elapsed_s, None

    def start(self):
        self._since = time.perf_counter()

    def read(self):
        return self._done + (time.perf_counter() - self._since if self._since is not None else 0.0)

    @contextlib.contextmanager
    def paused(self):
        running = self._since is not None
        self._done, self._since = self.read(), None
        try:
            yield
        finally:
            if running:
                self._since = time.perf_counter()
