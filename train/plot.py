"""Loss curve PNG next to the checkpoint (matplotlib, headless)."""
from data.atomic import atomic_file


def plot_loss_curve(records, path, unigram_entropy=None, bpb_per_nat=None):
    """records: dicts with "step" and "train_loss" and/or "val_loss". With bpb_per_nat (the validation
    set's bits per byte for a loss of 1 nat/token) a right axis reads the validation loss in bits per byte.
    Writes a PNG atomically."""
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
    if bpb_per_nat:  # a linear map of the loss axis: exact for the validation points
        right = ax.secondary_yaxis("right", functions=(lambda n: n * bpb_per_nat, lambda b: b / bpb_per_nat))
        right.set_ylabel("validation bits per byte")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_file(path) as f:
        fig.savefig(f, format="png")
    plt.close(fig)


def plot_expert_load(fraction_LE, path, title="share of routed tokens per expert"):
    """Heatmap of layers x experts (fraction of each layer's routed pairs; 1/E everywhere = balanced).
    fraction_LE: nested lists or an array [L, E]. Writes a PNG atomically."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    data = np.asarray(fraction_LE, dtype=float)
    L, E = data.shape
    fig, ax = plt.subplots(figsize=(min(2.5 + 0.45 * E, 16), 1.6 + 0.45 * L), dpi=110)
    im = ax.imshow(data, cmap="viridis", aspect="auto", vmin=0.0, vmax=max(data.max(), 2.0 / E))
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_xticks(range(E))
    ax.set_yticks(range(L))
    if E <= 16:
        for i in range(L):
            for j in range(E):
                ax.text(j, i, f"{data[i, j]:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if data[i, j] < 0.6 * data.max() else "black")
    fig.colorbar(im, ax=ax, label=f"fraction (balanced = {1 / E:.3f})")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    with atomic_file(path) as f:
        fig.savefig(f, format="png")
    plt.close(fig)
