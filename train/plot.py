"""Loss curve PNG next to the checkpoint (matplotlib, headless)."""
import os


def plot_loss_curve(records, path, unigram_entropy=None):
    """records: dicts with "step" and "train_loss" and/or "val_loss". Writes a PNG atomically."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["train_loss"]) for r in records if "train_loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if train:
        ax.plot(*zip(*train), lw=1, alpha=0.8, label="train (LM loss)")
    if val:
        ax.plot(*zip(*val), "o-", ms=4, label="validation")
    if unigram_entropy is not None:
        ax.axhline(unigram_entropy, ls="--", c="gray", lw=1, label=f"unigram entropy {unigram_entropy:.2f}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
