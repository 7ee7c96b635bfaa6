"""Talk to a fine-tuned model in the terminal: multi-turn, streamed token by token, stops at end-of-turn.

    .venv/bin/python scripts/chat.py                                   # checkpoints/sft, interactive
    .venv/bin/python scripts/chat.py --prompt "What does os.path.join do?"   # one question, one answer
    .venv/bin/python scripts/chat.py --ckpt exports/minimind-moe-sft   # an exported HF folder (transformers generates)

Interactive: each line you type is a user turn; the whole conversation so far is rendered with the
tokenizer's chat template (ChatML) and the answer is generated with the KV cache, printed as it comes,
until `<|im_end|>`. `/reset` starts a new conversation, `/quit` or end of input (Ctrl-D) ends.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402

from data.chat import tokenize_conversation  # noqa: E402
from data.tokenizer import stop_token_ids  # noqa: E402
from generate import load_model  # noqa: E402
from train.flags import Parser, Range, add, run_tool, utf8_text  # noqa: E402


class Chat:
    """A conversation with one model: `ask(text)` streams the answer to `out` and returns it."""

    def __init__(self, model, tokenizer, args, device, out=sys.stdout):
        from transformers import TextStreamer
        self.model, self.tokenizer, self.args, self.device, self.out = model, tokenizer, args, device, out
        self.stop_ids = stop_token_ids(tokenizer)
        self.streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.generator = torch.Generator(device=device).manual_seed(args.seed)
        self.hf = None  # transformers' model, for an exported folder
        self.reset()

    def reset(self):
        self.messages = [{"role": "system", "content": self.args.system}] if self.args.system else []

    def ask(self, text):
        self.messages.append({"role": "user", "content": text})
        prompt, _ = tokenize_conversation(self.tokenizer, self.messages, add_generation_prompt=True)
        ids = torch.from_numpy(prompt)[None].to(self.device)  # the ids SFT trained on (data/chat.py)
        if ids.shape[1] >= self._max_positions():
            self.messages.pop()
            return None
        out = self._generate(ids)
        new = out[0, ids.shape[1]:].tolist()
        answer = self.tokenizer.decode([t for t in new if t not in self.stop_ids], skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": answer.strip()})
        return answer

    def _max_positions(self):
        model = self.model if self.model is not None else self.hf
        return model.config.max_position_embeddings

    def _generate(self, ids):
        a = self.args
        if self.model is None:  # an exported folder: transformers' generate
            sampling = dict(do_sample=True, temperature=a.temperature, top_k=a.top_k or None, top_p=a.top_p) \
                if a.temperature > 0 else dict(do_sample=False, temperature=None, top_k=None, top_p=None)
            room = self._max_positions() - ids.shape[1]
            return self.hf.generate(ids, attention_mask=torch.ones_like(ids), streamer=self.streamer,
                                    max_new_tokens=min(a.max_new_tokens, room), eos_token_id=self.stop_ids,
                                    pad_token_id=self.tokenizer.pad_token_id, **sampling)
        return self.model.generate(ids, max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k,
                                   top_p=a.top_p, eos_token_id=self.stop_ids, generator=self.generator,
                                   streamer=self.streamer)


def main(argv=None):
    p = Parser(description=__doc__)
    p.add_argument("--ckpt", default="checkpoints/sft", help="checkpoint file, run directory or exported HF folder")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (None: tokenizer/ next to the checkpoint)")
    p.add_argument("--prompt", default=None, type=utf8_text, help="ask this one question, print the answer and exit")
    p.add_argument("--system", default=None, type=utf8_text, help="a system turn at the start of every conversation")
    add(p, "--max_new_tokens", allowed=Range(1), type=int, default=200, help="longest answer, in tokens")
    add(p, "--temperature", allowed=Range(0), type=float, default=0.7,
        help="0 = greedy (small models repeat themselves greedily)")
    add(p, "--top_k", allowed=Range(0), type=int, default=40, help="keep the k most likely tokens (0 = off)")
    add(p, "--top_p", allowed=Range(0, 1, lo_open=True), type=float, default=0.95,
        help="nucleus sampling mass (1.0 = off)")
    add(p, "--seed", allowed=Range(0, 2**32 - 1), type=int, default=0, help="sampling seed")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    args = p.parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model(p, args, device)
    if not tokenizer.chat_template:
        p.error(f"{args.tokenizer or args.ckpt}: the tokenizer has no chat template (fine-tune with train/sft.py)")
    chat = Chat(model, tokenizer, args, device)
    if model is None:
        from transformers import AutoModelForCausalLM
        chat.hf = AutoModelForCausalLM.from_pretrained(args.ckpt).to(device).eval()
    if args.prompt is not None:
        if not args.prompt.strip():
            p.error("--prompt is empty")
        with torch.no_grad():
            if chat.ask(args.prompt) is None:
                p.error(f"--prompt does not fit in the model's context ({chat._max_positions()} positions)")
        return
    sys.stdin.reconfigure(errors="surrogateescape")  # bytes that are not UTF-8 become U+FFFD below, whatever the locale
    interactive = sys.stdin.isatty()
    if interactive:
        print("chat: /reset starts over, /quit or Ctrl-D ends", file=sys.stderr)
    for line in sys.stdin if not interactive else iter(lambda: input("> "), None):
        text = line.encode("utf-8", "surrogateescape").decode("utf-8", "replace").strip()  # undecodable bytes: U+FFFD
        if text == "/quit":
            break
        if text == "/reset":
            chat.reset()
            continue
        if text:
            _turn(chat, text)


def _turn(chat, text):
    """Ask, print the streamed answer; returns it, or None (and a note) when the conversation is too long."""
    with torch.no_grad():
        answer = chat.ask(text)
    if answer is None:
        print("(the conversation is longer than the model's context: /reset to start over)", file=sys.stderr)
    return answer


def _main():
    try:
        main()
    except EOFError:  # Ctrl-D at the prompt
        print()


if __name__ == "__main__":
    run_tool(_main)
