"""Learning-rate schedule: a pure function of the step, so a resumed run cannot get it wrong."""
import math


def lr_at(step, max_steps, lr, warmup_steps, min_lr_ratio=0.1):
    """Linear warmup from lr/warmup to lr over `warmup_steps`, then cosine decay to lr * min_lr_ratio at
    `max_steps`. step is 0-based (the optimizer step about to be taken)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
