"""Data preparation and input pipeline figures for the BERT template, on a corpus it generates.

    .venv/bin/python bench/data_bench.py [--small-mb 8] [--vocab-size 8000] [--sample-mb 4] [--no-model]

Prints, for a generated English + Korean corpus (Zipf-distributed words, blank-line separated documents):
1. prepare's throughput (tokenizer training excluded and included) / raw `tokenizers` encode_batch
   throughput on the same text, same tokenizer, same cores (goal >= 0.6), by wall clock and per CPU-second
   (the latter is steadier on a shared machine); every rate is the best of 3 runs;
2. peak RSS of a fresh `prepare` process at two corpus sizes 10x apart (goal: flat, < 1.5 GB); the
   tokenizer sample (`--sample-mb`) is scaled down with the corpus so both sizes exceed it, as a real
   corpus exceeds the 64 MiB default;
3. prepared bytes / raw bytes (goal <= 1.0);
4. tf.data examples/s per core at seq 128 (read, decode, dynamic masking; no model), next to the model's
   own steps/s and examples/s (train_bench.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "templates"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from bert import prepare as prep  # noqa: E402

REPEATS = 3  # shared machines are noisy: every rate is the best of this many runs


def generate(path: Path, megabytes: float, seed: int = 0) -> Path:
    """~`megabytes` of text: Zipf(1.1) draws from 50k English-like and 20k Hangul words, 1-6 lines per doc."""
    import numpy as np

    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    english = ["".join(rng.choice(letters, size=rng.integers(2, 10))) for _ in range(50_000)]
    hangul = ["".join(chr(0xAC00 + int(c)) for c in rng.integers(0, 11172, size=rng.integers(1, 4)))
              for _ in range(20_000)]
    target = int(megabytes * 1e6)
    with open(path, "w", encoding="utf-8") as f:
        written = 0
        while written < target:
            words = hangul if rng.random() < 0.3 else english
            ranks = np.minimum(rng.zipf(1.1, size=4000), len(words)) - 1
            lines, at = [], 0
            while at < len(ranks):
                n = int(rng.integers(8, 40))
                lines.append(" ".join(words[r] for r in ranks[at:at + n]) + ".")
                at += n
                if rng.random() < 0.25:
                    lines.append("")  # document boundary
            text = "\n".join(lines) + "\n\n"
            f.write(text)
            written += len(text.encode("utf-8"))
    return path


def raw_encode_rate(corpus: Path, tokenizer_json: Path) -> dict:
    """MB/s of tokenizers' encode_batch (and encode_batch_fast) over the corpus in ~1 MB batches, text in memory."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    lines = [ln for ln in corpus.read_text(encoding="utf-8").split("\n") if ln.strip()]
    batches, batch, size = [], [], 0
    for ln in lines:
        batch.append(ln)
        size += len(ln)
        if size >= 1 << 20:
            batches.append(batch)
            batch, size = [], 0
    batches.append(batch)
    mb = corpus.stat().st_size / 1e6
    rates = {}
    for name in ("encode_batch", "encode_batch_fast"):
        fn = getattr(tok, name)
        best, best_cpu = float("inf"), float("inf")
        for _ in range(REPEATS):
            start, start_cpu = time.perf_counter(), time.process_time()
            for b in batches:
                fn(b, add_special_tokens=False)
            best = min(best, time.perf_counter() - start)
            best_cpu = min(best_cpu, time.process_time() - start_cpu)
        rates[name], rates[name + "_cpu"] = mb / best, mb / best_cpu
    return rates


_CHILD = """
import json, resource, sys, time
sys.path.insert(0, {templates!r})
from bert import prepare as prep
opts = prep.PrepareOptions(**json.loads({opts!r}))
t = time.perf_counter()
m = prep.prepare([{corpus!r}], {out!r}, opts)
u = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({{"seconds": time.perf_counter() - t, "cpu_seconds": u.ru_utime + u.ru_stime,
                  "peak_rss_mb": u.ru_maxrss / 1024,
                  "raw_bytes": m.raw_bytes, "prepared_bytes": m.prepared_bytes, "sequences": m.sequences}}))
"""


def prepare_in_child(corpus: Path, out: Path, repeats: int = 1, **opts) -> dict:
    """Run prepare in a fresh process so its peak RSS is its own; the fastest of `repeats` runs."""
    code = _CHILD.format(templates=str(Path(prep.__file__).parents[1]), opts=json.dumps(opts), corpus=str(corpus),
                         out=str(out))
    runs = [json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
                       .stdout.strip().splitlines()[-1]) for _ in range(repeats)]
    return min(runs, key=lambda r: r["seconds"])


def pipeline_rate(data_dir: str, batch: int, batches: int) -> float:
    """examples/s of make_dataset (interleaved reads, decode, masking), after one warm-up batch."""
    from bert.data import make_dataset, read_manifest

    manifest = read_manifest(data_dir)
    it = iter(make_dataset(data_dir, manifest, batch, mask_rate=0.15, max_predictions=20,
                           shuffle_buffer=10_000))
    next(it)
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batch * batches / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small-mb", type=float, default=8.0, help="the small corpus; the large one is 10x")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--sample-mb", type=int, default=4, help="tokenizer sample, below both corpus sizes")
    p.add_argument("--no-model", action="store_true", help="skip the model steps/s measurement")
    a = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    opts = {"vocab_size": a.vocab_size, "tokenizer_sample_bytes": a.sample_mb << 20, "strip_accents": False}
    with tempfile.TemporaryDirectory(prefix="data-bench-") as tmp:
        tmp = Path(tmp)
        small = generate(tmp / "small.txt", a.small_mb, seed=1)
        large = generate(tmp / "large.txt", a.small_mb * 10, seed=2)
        print(f"corpus: {small.stat().st_size / 1e6:.1f} MB and {large.stat().st_size / 1e6:.1f} MB, {cores} cores")

        full = prepare_in_child(small, tmp / "prep-small", repeats=REPEATS, **opts)
        vocab = tmp / "prep-small" / "vocab.txt"
        encode_only = prepare_in_child(small, tmp / "prep-vocab", repeats=REPEATS, vocab_file=str(vocab), **opts)
        raw = raw_encode_rate(small, tmp / "prep-small" / "tokenizer.json")
        mb = full["raw_bytes"] / 1e6
        print(f"raw tokenizers: encode_batch {raw['encode_batch']:.2f} MB/s ({raw['encode_batch_cpu']:.2f} MB per "
              f"CPU-second), encode_batch_fast {raw['encode_batch_fast']:.2f} MB/s")
        for label, run in (("given the vocab (encode+pack+write)", encode_only),
                           ("end to end (tokenizer training included)", full)):
            wall, cpu = mb / run["seconds"], mb / run["cpu_seconds"]
            print(f"prepare, {label}: {wall:.2f} MB/s = {wall / raw['encode_batch']:.2f}x encode_batch wall-clock, "
                  f"{cpu / raw['encode_batch_cpu']:.2f}x per CPU-second (goal >= 0.6)")

        big = prepare_in_child(large, tmp / "prep-large", **opts)
        print(f"peak RSS: {full['peak_rss_mb']:.0f} MB at {mb:.0f} MB of text, {big['peak_rss_mb']:.0f} MB at "
              f"{big['raw_bytes'] / 1e6:.0f} MB (goal: flat, < 1500 MB)")
        print(f"prepared / raw bytes: {full['prepared_bytes'] / full['raw_bytes']:.3f} (small), "
              f"{big['prepared_bytes'] / big['raw_bytes']:.3f} (large) (goal <= 1.0)")

        rates = {}
        for batch in (64, 1024):
            rates[batch] = pipeline_rate(str(tmp / "prep-large"), batch, max(20, 20_000 // batch))
            print(f"tf.data seq 128 batch {batch}: {rates[batch]:,.0f} examples/s = "
                  f"{rates[batch] / cores:,.0f} per core")
        if not a.no_model:
            from train_bench import measure

            r = measure(batch=64, vocab=a.vocab_size)
            print(f"model bert-tiny batch 64 seq 128: {r['steps_per_sec']:.2f} steps/s = "
                  f"{r['examples_per_sec']:.0f} examples/s (the pipeline runs "
                  f"{rates[64] / r['examples_per_sec']:.0f}x ahead at the same batch)")


if __name__ == "__main__":
    main()
