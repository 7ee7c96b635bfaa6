"""What a training stage (train/pretrain.py, train/sft.py) hands the shared loop (train/loop.py). Light on
purpose: a stage script imports only this and train/flags.py before its flags are parsed, so `--help` and a
mistyped flag answer before torch is imported.
"""
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class StageData:
    """A stage's data. train_batches: `.next() -> (x_BS, y_BS[, segment_ids_BS])` int64 CPU tensors of the
    global batch (rank r trains on rows [r*B, (r+1)*B)), `.state_dict()` / `.load_state_dict()` the exact
    position; val_batches: such tuples, the same every evaluation; identity: values a resume must find
    unchanged; unigram_entropy: nats/token of the context-free model on the validation tokens or None."""
    tokenizer: object
    tokenizer_dir: str
    train_batches: object
    val_batches: list
    identity: dict = field(default_factory=dict)
    unigram_entropy: float | None = None
    val_targets: int = 0  # supervised validation tokens and the UTF-8 bytes they stand for (bits per byte)
    val_bytes: int = 0


@dataclass
class Stage:
    """name: train/<name>.py and the progress bar's label; add_data_flags(group); load_data(args,
    tokenizer_dir, global_batch_size, log) -> StageData (raises DataError); data_order_flags: fixed on
    resume; sample_prompt: what the end-of-run sample continues; defaults: the stage's flag defaults."""
    name: str
    description: str
    default_out_dir: str
    add_data_flags: Callable
    load_data: Callable
    data_order_flags: tuple = ()
    sample_prompt: str = "The"
    defaults: dict = field(default_factory=dict)

