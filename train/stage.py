"""What a training stage supplies to the shared loop (train/trainer.py): its flags, its data and its loss
mask. Everything else (model, optimizer, DDP / EP, checkpoints, resume, logging, plots) is the loop's.

The loss mask travels in the labels: a batch is (x_BS, y_BS) int64 with y[b, s] the token that position
s must predict, or IGNORE_INDEX where it predicts nothing (pretraining: nowhere; fine-tuning: the prompt).
The loop then takes the mean over the supervised tokens of the whole global batch (all micro-batches,
all ranks), so the loss does not depend on how the batch is split.
"""
from dataclasses import dataclass, field
from typing import Callable

from data.dataset import IGNORE_INDEX  # noqa: F401


@dataclass
class StageData:
    """A stage's data, ready for the loop.

    tokenizer / tokenizer_dir: the tokenizer (a transformers tokenizer) and the folder it loads from.
    train_batches: `.next() -> (x_BS, y_BS)` int64 CPU tensors of the *global* batch (batch_size x world
        rows; rank r trains on rows [r*batch_size, (r+1)*batch_size)), or `(x_BS, y_BS, segment_ids_BS)` for
        windows packed with several sequences that must not see each other (the model's `segment_ids`);
        `.state_dict()` / `.load_state_dict()` hold the exact data position for resume.
    val_batches: list of such tuples (CPU tensors), the same every evaluation.
    identity: values a resume must find unchanged (e.g. {"train_tokens": n}); stored in the checkpoint.
    unigram_entropy: nats/token of the context-free model on the validation tokens (None if not meaningful).
    val_targets / val_bytes: supervised validation tokens and the UTF-8 bytes of the text they stand for
        (filled by the loop, for bits per byte).
    """
    tokenizer: object
    tokenizer_dir: str
    train_batches: object
    val_batches: list
    identity: dict = field(default_factory=dict)
    unigram_entropy: float | None = None
    val_targets: int = 0
    val_bytes: int = 0


@dataclass
class Stage:
    """name: the stage's module under train/ (`train.<name>.STAGE`) and the progress bar's label.
    add_data_flags(group): adds the stage's own flags to an argparse group.
    load_data(args, tokenizer_dir, global_batch_size, log) -> StageData; raises data.dataset.DataError.
    data_order_flags: flags that define the data order a saved position points into (fixed on resume).
    sample_prompt: text the end-of-run sample continues.
    defaults: the stage's own defaults for shared flags (e.g. a lower learning rate for fine-tuning)."""
    name: str
    description: str
    default_out_dir: str
    add_data_flags: Callable
    load_data: Callable
    data_order_flags: tuple = ()
    sample_prompt: str = "The"
    defaults: dict = field(default_factory=dict)
