"""Regenerate bench/RESULTS.md: run every benchmark under bench/ once and record what each printed, with the
exact command, the machine, the date and the commit.

    .venv/bin/python bench/report.py [--only chaos,run_bench] [--chaos-scenarios 200] [--timeout 3600]

Benchmarks run one after another (they are timing-sensitive). A benchmark that fails or times out is recorded
as such with its output tail; the figures are never edited by hand. With --only, the other sections of the
existing RESULTS.md are kept as they were.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "RESULTS.md"
PY = ".venv/bin/python"


def benchmarks(chaos_scenarios: int, chaos_seed: int) -> dict[str, tuple[str, list[str]]]:
    """name -> (what it measures, command), in the order they run (the long chaos run last). Default arguments
    are each benchmark's own."""
    return {
        "provision_bench": ("provisioning: `up`/`down` wall time over the slowest single create/delete (target <= 1.10)",
                            [PY, "bench/provision_bench.py"]),
        "data_bench": ("data prep: prepare vs raw tokenizers throughput, peak RSS, bytes ratio, tf.data rate",
                       [PY, "bench/data_bench.py"]),
        "train_bench": ("train: bert-tiny steps/s and examples/s fed from memory", [PY, "bench/train_bench.py"]),
        "backends": ("bert-tiny on TensorFlow vs JAX on this CPU, same data and seed: steps/s ratio, loss within 2 %",
                     [PY, "bench/backends.py"]),
        "peers": ("peers: tpuctl vs keras-hub training steps/s; GPT-2 data prepare vs run_clm's recipe and the "
                  "tokenizers floor (wall, disk, peak memory)", [PY, "bench/peers.py"]),
        "hf_parity": ("Hugging Face export: transformers' logits vs Keras' (max |diff| <= 1e-4, float32) and tokenizer "
                      "ids (identical), in its own venv with transformers + CPU torch",
                      [PY, "bench/hf_parity.py"]),
        "run_bench": ("run latency: last training step to TPU delete request (target <= 5 s)",
                      [PY, "bench/run_bench.py"]),
        "cost_accuracy": ("cost accuracy: tpuctl's accrued cost vs the local cloud's meter (tolerance 1 %)",
                          [PY, "bench/cost_accuracy.py"]),
        "runtime_matrix": ("runtime matrix: bert-tiny killed halfway and resumed on each TensorFlow runtime family's own "
                           "interpreter (image venvs cached in $TPUCTL_RUNTIME_CACHE or ~/.tpuctl/localcloud/runtimes)",
                           [PY, "bench/runtime_matrix.py"]),
        "localcloud_soak": ("local cloud daemon RSS over up/down cycles with concurrent uploads (goal: flat, < 200 MB)",
                            [PY, "bench/localcloud_soak.py"]),
        "fsdp_fit": ("`tpuctl fit` of gpt2-xl on v5litepod-8, v5p-8 and v6e-8 with job.sharding data, zero1 and fsdp "
                     "(fits or not, HBM per chip, est. step time) and auto's pick", [PY, "bench/fsdp_fit.py"]),
        "weak_scaling": ("`tpuctl fit --slices N` of gpt2-small (seq 1024) on 1, 2 and 4 slices of v5p-8, same per-chip "
                         "batch: est. step time, tokens/s, scaling efficiency", [PY, "bench/weak_scaling.py"]),
        "chaos": ("chaos: leaked resources, lost checkpoints, wrong exit codes over seeded fault scenarios (goal 0/0/0)",
                  [PY, "bench/chaos.py", "--scenarios", str(chaos_scenarios), "--seed", str(chaos_seed)]),
        "suite_time": ("Test suite time: the fast tier (`-m \"not slow\"`, goal < 5 min) and the whole suite (the README's "
                       "command, goal < 25 min) on this machine, with its load", [PY, "bench/suite_time.py"]),
    }


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    mem = ""
    try:
        kb = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
        mem = f", {kb / 1024 / 1024:.0f} GiB RAM"
    except (OSError, AttributeError):
        pass
    return f"{platform.system()} {platform.release()}, {cpu}, {cores} cores usable{mem}, Python {platform.python_version()}"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def figures(stdout: str) -> str:
    """What the benchmark printed as its result: a final JSON object in full, else its last 12 lines."""
    text = stdout.strip()
    start = text.rfind("\n{")
    for candidate in ([text] if text.startswith("{") else []) + ([text[start + 1:]] if start >= 0 else []):
        try:
            return json.dumps(json.loads(candidate), indent=2)
        except ValueError:
            continue
    lines = text.splitlines()
    flagged = [l for l in lines[:-12] if _FLAGGED.search(l)]
    return "\n".join(flagged + (["..."] if flagged else []) + lines[-12:])


# Lines a benchmark marks as a failure (chaos prints LEAKED / LOST / WRONG EXIT on a scenario's line).
_FLAGGED = re.compile(r"\b(LEAKED|LOST|WRONG EXIT|FAILED?)\b")


def run_one(name: str, what: str, cmd: list[str], timeout_s: float) -> str:
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    t0 = time.monotonic()
    print(f"running {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        code = "timeout"
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
    wall = time.monotonic() - t0
    body = figures(out) or "(no output on stdout)"
    section = [f"## {name}", "", what, "", f"- command: `{' '.join(cmd)}`", f"- run: {started}, {wall:.0f} s wall, "
               f"exit {code}", "", "```", body, "```"]
    if code != 0:
        section += ["", "stderr tail:", "", "```", "\n".join(err.strip().splitlines()[-8:]), "```"]
    return "\n".join(section) + "\n"


def existing_sections() -> dict[str, str]:
    if not RESULTS.exists():
        return {}
    parts = re.split(r"(?m)^(?=## )", RESULTS.read_text())
    # One blank line after each section, however many the file had: re-rendering must not grow it.
    return {p.split("\n", 1)[0][3:].strip(): p.rstrip("\n") + "\n" for p in parts if p.startswith("## ")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated benchmark names; the other sections are kept")
    ap.add_argument("--chaos-scenarios", type=int, default=200)
    ap.add_argument("--chaos-seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per benchmark")
    a = ap.parse_args(argv)
    table = benchmarks(a.chaos_scenarios, a.chaos_seed)
    chosen = [] if a.only == "none" else a.only.split(",") if a.only else list(table)
    unknown = set(chosen) - set(table)
    if unknown:
        ap.error(f"unknown benchmark(s) {', '.join(sorted(unknown))}; known: {', '.join(table)}")
    sections = existing_sections()
    for name in chosen:
        what, cmd = table[name]
        sections[name] = run_one(name, what, cmd, a.timeout)
        write(table, sections)  # after each benchmark, so an interrupted report keeps what finished
    write(table, sections)
    print(f"wrote {RESULTS}", file=sys.stderr)
    return 0


# The headline of each benchmark's printed figures: output lines matching a pattern, or top-level JSON keys.
HEADLINE_LINES = {
    "provision_bench": re.compile(r"^(up|down) .*"),
    "data_bench": re.compile(r"^(prepare|peak RSS|prepared).*"),
    "localcloud_soak": re.compile(r"^growth after warm-up.*"),
    "chaos": re.compile(r"^(leaked|lost checkpoints|wrong exit codes|scenarios): \d+$"),
    "runtime_matrix": re.compile(r"^tpu-vm-tf-\S+ tf=.*"),
    "peers": re.compile(r"^(train \S+ \S+:|prepare /|recipe /).*"),
    "suite_time": re.compile(r"^(fast|suite): \d+ s .*"),
    "fsdp_fit": re.compile(r"^gpt2-xl \S+ (data|zero1|fsdp): fits \S+ [\d.]+ of [\d.]+ GB|^gpt2-xl \S+ auto: .*"),
    "weak_scaling": re.compile(r"^gpt2-small \d x v5p-8 .*"),
}
HEADLINE_KEYS = {
    "train_bench": ("steps_per_sec", "examples_per_sec"),
    "backends": ("tensorflow_steps_per_sec", "jax_steps_per_sec", "jax_over_tf_steps_per_sec", "loss_rel_diff", "ok"),
    "run_bench": ("worker_s_median", "worker_s_max", "target_s", "ok"),
    "cost_accuracy": ("max_rel_error_in_1h", "tolerance", "ok"),
    "hf_parity": ("max_abs_logit_diff", "tolerance", "tokenizer_ids_identical", "transformers", "ok"),
}


def headline(name: str, section: str) -> tuple[str, str]:
    """(when it ran, its headline figures) from a rendered section: its latest run, the last `- run:` line and
    the last output block (a section may record several runs, oldest first)."""
    runs = re.findall(r"^- run: (.*)$", section, re.MULTILINE)
    # Output blocks only: a failed run's "stderr tail:" block follows its output and holds no figures.
    bodies = re.findall(r"(?<!stderr tail:\n\n)```\n(.*?)\n```", section, re.DOTALL)
    text = bodies[-1] if bodies else ""
    when = runs[-1] if runs else "?"
    if "(" in when:  # a note after the run; the table keeps it only when it closes on this line
        when = when[:when.index(")") + 1] if ")" in when else when[:when.index("(")].rstrip()
    if name in HEADLINE_KEYS:
        try:
            doc = json.loads(text)
            figures = "; ".join(f"{k} {_short(doc[k])}" for k in HEADLINE_KEYS[name] if k in doc)
        except ValueError:
            figures = ""
    else:
        pattern = HEADLINE_LINES.get(name)
        figures = "; ".join(l.strip() for l in text.splitlines() if pattern and pattern.match(l.strip()))
    return when, (figures or "see below")


def _short(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def write(table: dict, sections: dict[str, str]) -> None:
    head = ["# Benchmark results", "",
            "Regenerated by `.venv/bin/python bench/report.py` (one section per benchmark under bench/; "
            "`--only NAME` reruns one, `--only none` re-renders without running). Figures are exactly what each "
            "command printed.", "",
            f"- machine: {machine()}",
            f"- commit: {commit()}; machine shared with other work while measuring, so wall-clock rates are noisy",
            "", "| benchmark | run | headline figures |", "|---|---|---|"]
    for name in table:
        if name in sections:
            when, figures = headline(name, sections[name])
            head.append(f"| {name} | {when} | {figures.replace('|', '/')} |")
    RESULTS.write_text("\n".join(head) + "\n\n" + "\n".join(sections[n] for n in table if n in sections))


if __name__ == "__main__":
    sys.exit(main())
