"""Data pipeline at scale: synthetic corpora of growing size, prepared and trained on, one at a time.

    python scripts/bench/bench_data.py                          # 20, 100 and 400 MB
    python scripts/bench/bench_data.py --sizes_mb 20 1500       # up to the size of MiniMind's pretrain_hq.jsonl

For every size it runs `train/pretrain.py --data_path corpus.jsonl --max_steps 20` twice in a fresh
process each: cold (an empty data cache: preparation + training) and warm (the prepared cache), after
timing `prepare_data` alone (in a fresh process, after its imports, on an empty cache), and
prints one row per run: documents, tokens, preparation time and MB/s, peak RSS during preparation and
during training (and the PSS of the preparing process plus its tokenizer workers), the trainer's own
count of seconds from its start (after Python's imports) to its first training step (its "setup:" line),
and the whole run's wall time. Memory is sampled every 0.1 s from /proc.

The corpora are English-like jsonl ({"text": ...} per line), 1-40 sentences of 12 words per document,
seeded, written once under --work_dir (see `synthetic_corpus` for the two kinds of word draws).
Times on a shared 2-core machine are noisy: look at `uptime` before and after (printed).
"""
import json
import os
import shutil
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))  # scripts/bench
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from data.atomic import atomic_file  # noqa: E402


def synthetic_corpus(path, size_mb, seed=0, kind="longtail"):
    """Write (once) a jsonl of about size_mb MB of English-like documents; returns its path.

    kind "plain": sentences of words drawn from the embedded corpus's (about 20k distinct words, few
    rare ones: tokenizers' word caches hit almost always, so this flatters any tokenizer). kind
    "longtail" (default): words drawn from a Zipf law (exponent 1.1, like natural text) over a vocabulary
    of 2M: the embedded corpus's words by frequency first, then made-up words of 2-5 syllables, so a
    corpus of hundreds of MB has hundreds of thousands of distinct words, as real web text does."""
    if os.path.exists(path):
        return path
    import numpy as np
    from collections import Counter
    from data.corpus import default_corpus
    with open(default_corpus()["train"], encoding="utf-8") as f:
        counts = Counter(w for line in f for w in json.loads(line)["text"].split() if w.isalpha())
    real = [w for w, _ in counts.most_common()]
    rng = np.random.default_rng(seed)
    if kind == "plain":
        vocab, p = np.array(list(counts.elements()), dtype=object), None
    else:
        syll = np.array([c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"] + ["th", "ch", "qu", "ing", "er"])
        n_made = 2_000_000 - len(real)
        parts = [syll[rng.integers(0, len(syll), n_made)] for _ in range(5)]
        n_syll = rng.integers(2, 6, n_made)
        made = ["".join(x[:k]) for x, k in zip(zip(*parts), n_syll)]
        vocab = np.array(real + made, dtype=object)
        p = 1.0 / np.arange(1, len(vocab) + 1) ** 1.1
        p /= p.sum()
    target, written = size_mb * 1_000_000, 0
    with atomic_file(path, "w", encoding="utf-8") as f:
        while written < target:
            n_words = rng.integers(12, 480, 256)  # 256 documents of 2-40 sentences of ~12 words
            words = vocab[rng.choice(len(vocab), int(n_words.sum()), p=p)]
            pos = 0
            for n in n_words:
                doc = words[pos:pos + n]
                pos += n
                text = ". ".join(" ".join(doc[i:i + 12]).capitalize() for i in range(0, n, 12)) + "."
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                written += len(line)
    return path


def _memory_kb(pid):
    """(RSS of the process, PSS summed over it and its descendants) in kB, from /proc: forked workers share
    pages with their parent, which PSS counts once and RSS once per process."""
    rss = pss = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                fields = {line.split(":")[0]: int(line.split()[1]) for line in f if line.split()[1:2] != []
                          and line.split()[1].isdigit()}
            pss += fields.get("Pss", 0)
            rss = rss or fields.get("Rss", 0)
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            pass
    return rss, pss


def timed_run(cmd, cwd):
    """Run cmd; returns dict(wall, prep_s (from the start until the 'data:' line), first_step_s (the trainer's
    "setup: N s to the first step" line, None when it prints none (an old tree)), prep_rss_mb / train_rss_mb
    (peak RSS of the process before / after the data line), prep_tree_mb (peak PSS of the process and its
    workers before the data line))."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marks, peaks, out = {}, {"prep": 0, "prep_tree": 0, "train": 0}, []

    def read():
        for line in proc.stdout:
            out.append(line)
            if line.startswith("data:") and "prep" not in marks:
                marks["prep"] = time.time() - t0
            if line.startswith("setup: "):  # the trainer's own count, from after its imports
                marks["setup"] = float(line.split()[1])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while proc.poll() is None:
        phase = "train" if "prep" in marks else "prep"
        rss, pss = _memory_kb(proc.pid)
        peaks[phase] = max(peaks[phase], rss)
        if phase == "prep":
            peaks["prep_tree"] = max(peaks["prep_tree"], pss)
        time.sleep(0.1)
    reader.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{''.join(out[-30:])}")
    return dict(wall=time.time() - t0, prep_s=marks.get("prep"), first_step_s=marks.get("setup"),
                prep_rss_mb=peaks["prep"] / 1024, prep_tree_mb=peaks["prep_tree"] / 1024,
                train_rss_mb=peaks["train"] / 1024, log="".join(out))


def import_seconds(tree):
    t0 = time.time()
    subprocess.run([sys.executable, "-c", "import train.pretrain"], cwd=tree, check=True)
    return time.time() - t0


PREP_ONLY = ("import sys, time; sys.path.insert(0, sys.argv[1]); from data.prepare import prepare_data; "
             "from model.config import MiniMindConfig; t = time.time(); "
             "prepare_data(sys.argv[2], vocab_size=MiniMindConfig.vocab_size, cache_dir=sys.argv[3], "
             "log=lambda *a: None); "
             "print(f'data: prepare_data took {time.time() - t:.3f} s', flush=True)")


def prep_only(tree, corpus, work):
    """prepare_data alone in a fresh process and an empty cache: (seconds of the call, after the imports;
    peak RSS of the process MB; peak PSS with its workers MB)."""
    cache = os.path.join(work, "prep-cache")
    shutil.rmtree(cache, ignore_errors=True)
    r = timed_run([sys.executable, "-c", PREP_ONLY, tree, corpus, cache], work)
    shutil.rmtree(cache, ignore_errors=True)
    seconds = float(next(l for l in r["log"].splitlines() if "prepare_data took" in l).split()[3])
    return seconds, r["prep_rss_mb"], r["prep_tree_mb"]


def train_cmd(tree, corpus, out_dir, steps):
    return [sys.executable, os.path.join(tree, "train", "pretrain.py"), "--data_path", corpus, "--out_dir", out_dir,
            "--max_steps", str(steps), "--log_interval", "1", "--eval_tokens", "4096", "--eval_interval", "100000",
            "--save_interval", "100000", "--sample_tokens", "0", "--no_progress"]


def bench(tree, label, corpus, work, steps, cold):
    cache = os.path.join(tree, "data", "cache")
    if cold:  # drop this corpus's caches (tokenizer and tokens) but keep the embedded corpus build
        for name in os.listdir(cache) if os.path.isdir(cache) else ():
            if name.startswith(("tokens-", "tokenizer-", "fingerprints")):
                p = os.path.join(cache, name)
                shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
    out_dir = os.path.join(work, f"run-{label}")
    shutil.rmtree(out_dir, ignore_errors=True)
    r = timed_run(train_cmd(tree, corpus, out_dir, steps), work)
    line = next(l for l in r["log"].splitlines() if l.startswith("data:"))
    r["docs"] = line.split(": ")[2].split(" train")[0] if ": " in line else "?"
    r["tokens"] = line.split("documents, ")[1].split(" train")[0] if "documents, " in line else "?"
    return r


def main(argv=None):
    from train.flags import AT_LEAST_1, Parser, add
    p = Parser(description=__doc__)
    p.add_argument("--sizes_mb", type=int, nargs="+", default=[20, 100, 400], help="corpus sizes (MB)")
    p.add_argument("--work_dir", default="/tmp/bench_data", help="where corpora and runs go")
    add(p, "--steps", allowed=AT_LEAST_1, type=int, default=20, help="training steps per run")
    p.add_argument("--corpus", default="longtail", choices=("longtail", "plain"),
                   help="longtail: Zipf words over a 2M vocabulary, like real text; plain: the embedded corpus's words")
    args = p.parse_args(argv)
    if any(size < 1 for size in args.sizes_mb):
        p.error(f"--sizes_mb must be >= 1 each, got {args.sizes_mb}")
    os.makedirs(args.work_dir, exist_ok=True)
    print(f"uptime before: {os.getloadavg()}; import seconds: {import_seconds(ROOT):.1f}", flush=True)
    head = (f"{'size':>6} {'tree':>5} {'run':>5} {'documents':>10} {'train tokens':>13} {'data at s':>9} {'MB/s':>7} "
            f"{'prep RSS MB':>11} {'+workers':>8} {'train RSS MB':>12} {'1st step s':>10} {'wall s':>7}")
    rows, prep_rows = [], []
    prep_head = f"{'size':>6} {'tree':>5} {'prep s':>8} {'MB/s':>9} {'RSS MB':>11} {'+workers':>8}"
    print("preparation alone (prepare_data, after the imports, empty cache):\n" + prep_head, flush=True)
    for size in args.sizes_mb:
        corpus = synthetic_corpus(os.path.join(args.work_dir, f"corpus-{args.corpus}-{size}mb.jsonl"), size,
                                  kind=args.corpus)
        mb = os.path.getsize(corpus) / 1e6
        seconds, rss, pss = prep_only(ROOT, corpus, args.work_dir)  # the preparation alone
        prep_rows.append(f"{size:>6} {'ours':>5} {seconds:>8.1f} {mb / seconds:>9.2f} {rss:>11.0f} {pss:>8.0f}")
        print(prep_rows[-1], flush=True)
        runs = [("ours", ROOT, True), ("ours", ROOT, False)]
        for label, tree, cold in runs:
            r = bench(tree, label, corpus, args.work_dir, args.steps, cold)
            prep = r["prep_s"] if cold else None
            first = r["first_step_s"] if r["first_step_s"] is not None else float("nan")
            prep_s = f"{prep:.1f}" if prep else "-"
            rate = f"{mb / prep:.2f}" if prep else "-"
            prep_rss = f"{r['prep_rss_mb']:.0f}" if cold else "-"
            tree = f"{r['prep_tree_mb']:.0f}" if cold else "-"
            row = (f"{size:>6} {label:>5} {'cold' if cold else 'warm':>5} {r['docs']:>10} {r['tokens']:>13} "
                   f"{prep_s:>9} {rate:>7} {prep_rss:>11} {tree:>8} {r['train_rss_mb']:>12.0f} "
                   f"{first:>10.1f} {r['wall']:>7.1f}")
            rows.append(row)
            print(head + "\n" + row if len(rows) == 1 else row, flush=True)
    print(f"\nuptime after: {os.getloadavg()}")
    print("\npreparation alone (prepare_data, after the imports, empty cache):\n" + prep_head + "\n"
          + "\n".join(prep_rows))
    print("\ntraining runs (--max_steps %d; cold: empty cache, so preparation included):\n" % args.steps + head + "\n"
          + "\n".join(rows))


if __name__ == "__main__":
    main()
