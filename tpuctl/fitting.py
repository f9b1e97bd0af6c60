"""Will the run fit the TPU, how fast, for how much: `tpuctl fit`, and the check `run` and `up` make first.

With the TPU compiler installed (`pip install 'tpuctl[tpu]'`: jax[tpu], whose libtpu compiles for a slice that
is not there), the template's own training step (template.json `fit`; templates/aot.py runs it in a process of
its own) is compiled for the slice's topology at the run's batch, sequence length and precision. Per chip it
reports the HBM the program needs (arguments + temporaries + outputs - aliases) against the chip's, the FLOPs
and bytes the compiler counts, and, by compiling a few more batches, the largest per-chip batch that fits.
Without the compiler the same report is an analytic estimate (a deliberately high one), marked as such.

Time and money are estimates from a roofline: max(FLOPs / peak bf16 FLOP/s, bytes / HBM bandwidth), plus
the gradient all-reduce over ICI on more than one chip; model FLOPs are 6·N·tokens plus attention
(12·layers·hidden·seq per token, PaLM's count; N the weights a matmul applies per token, the template's
`flop_params`: every weight for GPT-2, whose tied head runs on every token; BERT's head on its predicted
positions only), and the FLOPs are the compiled ones where the program does more
(a recomputed forward under remat, or GPT-2's TPU head): MFU counts the model's alone. With `slices: N`
(multislice, weak scaling: every slice runs the same per-chip batch), the step then all-reduces the gradients
across the N slices over the data-center network (DCN): `dcn_seconds`; step time, tokens/s and cost are for all
N slices, the HBM answer is one slice's. The bytes are the compiler's count, which includes accesses it serves
from on-chip memory, so the bytes term is a model too: beside the sum of the compiler's own per-instruction
cycle estimates (reported as `compiler_cycles_per_step`), it can rank two programs the other way (bert-128, and a
compiler flag that halves the bytes and adds cycles: bench/RESULTS.md, tpu_compile).
Compiles are cached under TPUCTL_HOME/fit by template content, config, topology, batch and versions: a repeat
answers at once. Silent: progress goes to `on_event`.

`job.sharding` (the template's runtime.sharding): `data` replicates the training state on every device; `zero1`
splits the optimizer's state over them (each device updates its share of every weight: the gradients'
reduce-scatter and the weights' all-gather move the all-reduce's bytes); `fsdp` splits weights, gradients and
optimizer state (each device holds 1/N of the state and gathers weights as the step uses them: its all-gathers
and gradient reduce-scatter move 1.5x the all-reduce's bytes); `auto` answers for the first of data, zero1 and
fsdp that fits (on JAX: with `framework` tensorflow, data only).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tpuctl import catalog as catalog_mod
from tpuctl import events as ev
from tpuctl import frameworks
from tpuctl import paths
from tpuctl.errors import BadInput, TpuctlError

INSTALL_HINT = "pip install 'tpuctl[tpu]'"
BATCH_STEP = 8  # per-device batches are multiples of 8 (the TPU's matrix units tile by 8; the templates require it)
MAX_COMPILES = 3  # per `fit`: the run's batch, then the largest batch predicted from it, then one to bound it
CHECK_COMPILES = 1  # per run/up check: the run's batch; the largest batch that fits is predicted from it
# run/up compile only when the analytic estimate (an overestimate) reaches this share of the chip's HBM:
# below it the run fits anyway, and a compile costs a minute even for the tiny presets on a laptop.
SCREEN_SHARE = 0.25
# Remat policies are tried (each one compile) only when the batch's own bytes (all but the state) are within
# this factor of the room the chip leaves them: a policy recomputes activations, it does not make them vanish
# (Korthikanti et al.: even full recomputation keeps each layer's input), and a hopeless batch is refused at once.
REMAT_REACH = 3.0
AOT_PREFIX = "tpuctl-aot "  # marks templates/aot.py's protocol lines among whatever else reaches its stdout


@dataclass(frozen=True)
class Chip:
    """Facts of one TPU generation, per chip, from Google's page for it (`source`)."""

    hbm_bytes: float
    peak_bf16_flops: float
    hbm_bytes_per_s: float
    allreduce_bytes_per_s: float  # per-chip all-reduce bandwidth: the pod's all-reduce bandwidth / its chips,
    # or half the bidirectional ICI bandwidth per chip where only that is published (v6e gives both: 400, 800)
    devices_per_chip: int  # JAX devices (TensorCores not fused into one megacore) per chip
    source: str
    dcn_bytes_per_s: float = 0.0  # per-chip data-center network bandwidth (DCN, between slices; see the table);
    # 0: no multislice on the generation


GiB, GB, Gbit = 2**30, 1e9, 1e9 / 8
# One table; every number is from the page named (checked 2026-11). v2's all-reduce bandwidth is not published:
# inferred as v3's.
CHIPS: dict[str, Chip] = {
    "v2": Chip(16 * GiB, 45e12, 600 * GB, 340e12 / 1024, 2, "https://cloud.google.com/tpu/docs/v2"),
    "v3": Chip(32 * GiB, 123e12, 900 * GB, 340e12 / 1024, 2, "https://cloud.google.com/tpu/docs/v3"),
    "v4": Chip(32 * GiB, 275e12, 1200 * GB, 1.1e15 / 4096, 1, "https://cloud.google.com/tpu/docs/v4", 25 * Gbit),
    "v5e": Chip(16 * GB, 197e12, 819 * GB, 51.2e12 / 256, 1, "https://cloud.google.com/tpu/docs/v5e", 25 * Gbit),
    "v5p": Chip(95 * GiB, 459e12, 2765 * GB, 1200 * GB / 2, 1, "https://cloud.google.com/tpu/docs/v5p", 50 * Gbit),
    "v6e": Chip(32 * GB, 918e12, 1640 * GB, 102.4e12 / 256, 1, "https://cloud.google.com/tpu/docs/v6e", 100 * Gbit),
    "tpu7x": Chip(192 * GiB, 2307e12, 7380 * GB, 1200 * GB / 2, 2, "https://cloud.google.com/tpu/docs/tpu7x",
                  100 * Gbit),
}
# DCN bandwidth per chip (checked 2026-11-28); a host's is this times its chips. Published per chip: v5p 50 Gbps
# (cloud.google.com/tpu/docs/v5p: "Data center network (DCN) bandwidth per chip (Gbps) 50"), v6e and TPU7x 100 Gbps
# (cloud.google.com/tpu/docs/tpu7x's table, v5p/v6e/TPU7x columns). v5e: its "Per-host NIC configuration 2 x 100
# Gbps" for 8 chips a host, and "Data center network bandwidth per Pod 6.4 Tbps" over 256 chips, both 25 Gbps a
# chip (cloud.google.com/tpu/docs/v6e, v5e column; v6e's 4 x 200 Gbps and 25.6 Tbps agree with its 100). v4: Google
# publishes none; 25 Gbps, the lowest any generation's page gives, so the estimate errs slow. v2 and v3 have no
# multislice (tpu/docs/multislice-introduction): 0.


@dataclass(frozen=True)
class Fit:
    """The answer for one run on one slice. Byte, FLOP and batch figures are per chip; `method` says whether
    they come from the TPU compiler ("compiled") or from a formula ("analytic"). Times, MFU and cost are
    estimates either way."""

    fits: bool
    method: str  # "compiled" | "analytic"
    accelerator: str
    topology: str  # as libtpu names it, e.g. "v5e:2x2"
    chips: int  # in one slice
    per_chip_batch: int
    global_batch: int
    seq_len: int
    params: int
    flop_params: int  # N of the model FLOPs' 6·N·tokens: the weights a matmul applies per token (a masked LM's
    # head runs on its predicted positions only, its embeddings are lookups); `params` where the template says not
    precision: str
    hbm_per_chip_bytes: int
    hbm_capacity_bytes: int
    max_per_chip_batch: int  # 0: not even the smallest batch fits
    max_batch_is: str  # "compiled" (it fits and the batch a step above it does not, both compiled), "predicted"
    # (from the compiles' slope), "at least" (it fits, nothing larger was ruled out: a run/up check that fits stops
    # at the run's batch)
    model_flops_per_step: float
    compiled_flops_per_step: float | None
    bytes_accessed_per_step: float
    est_step_s: float
    est_mfu: float
    est_tokens_per_s: float
    max_steps: int
    est_run_s: float
    price_per_hour: float
    est_cost_usd: float
    jax: str | None
    libtpu: str | None
    compiles: int  # compiles this call ran (0: all from the cache)
    chip_source: str
    not_compiled: str = ""  # why an analytic estimate: no compiler (how to get it), no step offered, screened
    sharding: str = "data"  # the training state on the devices: "data" (replicated), "zero1" or "fsdp" (split)
    remat_policy: str = "none"  # the template's remat policy the figures are for: the config's, or (remat_chosen)
    remat_chosen: bool = False  # the first of the template's policies that makes the batch fit when it does not
    slices: int = 1  # multislice: the step time, tokens/s, global batch, price and cost are for all of them
    dcn_s: float = 0.0  # of est_step_s: the gradient all-reduce across the slices over DCN (dcn_seconds)
    # The sum of the compiler's own per-instruction cycle estimates for a device's step (a chip's devices run
    # theirs at once): its schedule's view beside the roofline's, to compare two programs of one chip by (a
    # Pallas kernel carries none, so it counts nothing for them). None: analytic, or not in the compiler's answer.
    compiler_cycles_per_step: int | None = None
    # What the workers train with. "tensorflow": TensorFlow compiles for a TPU only on one, so the figures are its
    # Keras model's XLA program compiled through JAX, without the JAX step's Pallas kernels (TensorFlow has none:
    # attention's scores and the head's logits reach HBM) and without remat (JAX only).
    framework: str = "jax"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def hbm_line(self) -> str:
        """One line: needed against available, and the largest batch that fits."""
        how = "compiled" if self.method == "compiled" else "analytic estimate"
        # The largest batch is searched under the config's own policy, not the one chosen to fit this batch.
        without = " without it" if self.remat_chosen else ""
        largest = (f"largest per-chip batch that fits{without}: {self.max_per_chip_batch} ({self.max_batch_is})"
                   if self.max_per_chip_batch else
                   "not even the smallest batch fits: use a generation with more HBM per chip")
        # A compiled step that does not fit is one the compiler refused: it names its temporaries, not the total.
        floor = "at least " if self.method == "compiled" and not self.fits else ""
        remat = f", remat policy {self.remat_policy}" if self.remat_policy != "none" else ""
        return (f"{floor}{_gb(self.hbm_per_chip_bytes)} of HBM per chip needed, {_gb(self.hbm_capacity_bytes)} "
                f"available on {self.accelerator} ({how}, per-chip batch {self.per_chip_batch}{remat}); {largest}")


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def compiler_versions() -> tuple[str | None, str | None]:
    """(jax, libtpu) versions; libtpu None when it cannot be imported (the TPU compiler is absent)."""
    try:
        import libtpu  # noqa: F401  # importing it is the test: a wheel for another platform does not load
    except ImportError:
        return _version("jax"), None
    return _version("jax"), _version("libtpu")


def topology_of(accel: catalog_mod.AcceleratorType) -> tuple[str, dict]:
    """libtpu's topology name for a catalog type, and the options its compile-only devices need: one chip is
    its own host (libtpu's default host is 2x2x1), and v4's two TensorCores are one megacore device as JAX
    uses them on a v4 VM."""
    options: dict = {}
    if accel.chips == 1:
        options["chips_per_host_bounds"] = (1, 1, 1)
    if accel.generation == "v4":
        options["chip_config_name"] = "megacore"
    return f"{accel.generation}:{accel.topology}", options


@dataclass(frozen=True)
class _Request:
    """What is compiled: the template, the workers' config, the vocabulary and the slice."""

    template: Any  # contract.Template
    config: dict
    resolved: Any  # the template's config object (validate hook), for the analytic estimate
    vocab_size: int
    accel: catalog_mod.AcceleratorType
    chip: Chip
    price_per_hour: float  # one slice's
    framework: str  # what the workers train with: "jax", or "tensorflow" (compiled as its XLA program, via JAX)
    sharding: str = "data"
    slices: int = 1
    libtpu_args: str = ""  # the job's LIBTPU_INIT_ARGS (job.env): the compiler flags its workers add theirs to


def _request(spec, spec_dir: Path, accelerator: str | None, sharding: str = "data") -> _Request:
    """The spec's job as the workers would get it with `sharding` (placeholder bucket and run: paths change no
    compile), on the framework the run's plan picks (frameworks.for_run, as provision.plan does). Raises
    BadInput for a spec without a job, an unknown type, a zone, runtime or framework the type does not offer, a
    config the template refuses, or `slices` Google's multislice does not make (the checks `run` makes)."""
    from tpuctl.jobs import bundle as bundles
    from tpuctl.templates import contract

    job = spec.job
    if job is None:
        raise BadInput("the spec has no job: section, so there is no training step to fit", field="job",
                       hint="add `job: {template: bert, preset: bert-tiny}` (see examples/bert-tiny.yaml)")
    cat = catalog_mod.load()
    accel = cat.accelerator(accelerator or spec.accelerator or "")
    chip = CHIPS.get(accel.generation)
    if chip is None:
        raise BadInput(f"no chip facts for TPU generation {accel.generation}", field="accelerator",
                       hint=f"fit knows {', '.join(CHIPS)}")
    template = contract.find(job.template, base_dir=spec_dir)
    # zero1 or fsdp on TensorFlow: refused, naming job.sharding
    choice = frameworks.for_run(job.framework, sharding, spec.slices, accel, spec.runtime_version, template.frameworks)
    for zone in spec.zones:
        cat.check(accel.name, zone, choice.runtime_version, choice.framework)
    if spec.slices > 1:
        from tpuctl.provision import shapes  # (the whole provisioning layer, a second to import: not for one slice)

        shapes.QUEUED.check_slices(accel, spec.slices, spec.provisioning, choice.framework)
    config = bundles.job_config(job.config, preset=job.preset, bucket="fit", run="fit", data_url=None,
                                framework=choice.framework, sharding=sharding)
    bundles.check_job_config(template, job, config)
    resolved = template.validate_config(config) if template.validate_config else None
    vocab = getattr(getattr(resolved, "task", None), "vocab_size", 0) or job.data.vocab_size
    zone = spec.zones[0] if spec.zones else accel.zones[0]
    price = cat.tpu_price_per_hour(accel.name, zone, spec.provisioning in ("spot", "preemptible"))
    return _Request(template, config, resolved, vocab, accel, chip, price, choice.framework, sharding, spec.slices,
                    job.env.get("LIBTPU_INIT_ARGS", ""))


def _template_hash(template) -> str:
    """The template's content (its package and the packages it uses): an edit to the model is a new answer."""
    h = hashlib.sha256()
    for root in (template.root, *template.uses):
        for f in sorted(Path(root).rglob("*")):
            if f.is_file() and f.suffix in (".py", ".json") and "__pycache__" not in f.parts:
                h.update(str(f.relative_to(root)).encode())
                h.update(f.read_bytes())
    return h.hexdigest()


# The compiling side's own code: how it measures (e.g. the bytes of kernels that declare none) is part of an answer.
def _aot_hash() -> str:
    return hashlib.sha256(Path(importlib.util.find_spec("tpuctl.templates.aot").origin).read_bytes()).hexdigest()


def _cache_path(req: _Request, topology: str, options: dict, versions: tuple) -> Path:
    key = json.dumps({"template": _template_hash(req.template), "config": req.config, "vocab": req.vocab_size,
                      "measure": _aot_hash(), "libtpu_args": req.libtpu_args,
                      "topology": topology, "options": options, "versions": versions, "keras": _version("keras")},
                     sort_keys=True, default=str)
    return paths.home() / "fit" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


class _Compiler:
    """templates/aot.py in a child process, started on the first compile the cache cannot answer."""

    def __init__(self, req: _Request, topology: str, options: dict, log: Path):
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log
        self._log = open(log, "w")
        # The workers' compiler flags: the job's own (job.env), to which an lmkit template adds its own
        # (aot.use_the_workers_compiler_flags); not this machine's.
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "LIBTPU_INIT_ARGS": req.libtpu_args}
        self.proc = subprocess.Popen([sys.executable, "-m", "tpuctl.templates.aot"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        self._send({"root": str(req.template.root), "builtin": req.template.builtin, "config": req.config,
                    "vocab_size": req.vocab_size, "topology": topology, "topology_options": options})
        self.model = self._read()

    def _send(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(AOT_PREFIX):
                answer = json.loads(line[len(AOT_PREFIX):])
                if "error" in answer:
                    break
                return answer
        else:
            answer = {"error": f"the compiler exited ({self.proc.wait()})"}
        raise TpuctlError(f"fit: compiling the training step failed: {answer['error']}",
                          hint=f"its log: {self.log_path}; --no-fit-check skips the check")

    def compile(self, per_device_batch: int, remat: str | None = None) -> dict:
        self._send({"batch": per_device_batch, **({"remat": remat} if remat else {})})
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _need(point: dict, state_bytes: float) -> tuple[float, bool]:
    """(bytes per device, compiled) of one compile: arguments + temporaries + outputs - aliases (the donated
    state is updated in place); a compile the TPU compiler refused over HBM needs at least the state and the
    temporaries it named. The compiler accepts programs somewhat over a chip's published HBM: whether one fits
    is the caller's comparison."""
    if "oom" in point:
        return state_bytes + (point["oom"] or 0), False
    m = point["memory"]
    return (m["argument_size_in_bytes"] + m["temp_size_in_bytes"] + m["output_size_in_bytes"]
            - m["alias_size_in_bytes"]), True


def _largest(measure: Callable[[int], tuple[float, bool]], b0: int, cap: float, state: float, budget: int,
             *, grow: bool) -> tuple[int, str]:
    """The largest per-device batch (a multiple of BATCH_STEP) that fits `cap` bytes, with at most `budget`
    compiles after the run's own (`b0`); `grow` False: none when `b0` fits. `measure(batch)` is (bytes,
    compiled); a batch fits when it compiled within `cap`. The answer is "compiled" only when the batch
    BATCH_STEP above it was compiled too and does not fit, "predicted" when it was not compiled, "at least"
    when it fits and nothing larger was ruled out.
    Memory is the state plus a part proportional to the batch (activations, gradients' temporaries): far from
    `cap` the next compile is where that line, through the compiled point nearest the answer, meets `cap` (at
    most 4x the largest batch compiled). Near `cap` the line is no guide: the TPU compiler rematerializes on its
    own there, so memory stops growing with the batch until the compiler refuses (bert-base keras-hub on a v5e:
    15.75 GB at 416 a chip, 15.71 at 512, 15.88 at 640). So a batch within the last eighth of the room is
    checked one step above; where two fit that close, the search gallops (each step twice the last, at least
    an eighth of the batch) until one does not, then halves the gap between."""
    known = {b0: measure(b0)}

    def fits(batch: int) -> bool:
        need, compiled = known[batch]
        return compiled and need <= cap

    while True:
        best = max((b for b in known if fits(b)), default=0)
        above = min((b for b in known if b > best and not fits(b)), default=None)
        if above is not None and best + BATCH_STEP >= above:
            return best, "compiled"
        if fits(b0) and not grow:
            return b0, "at least"
        nearest = best or above
        per_example = (known[nearest][0] - state) / nearest
        limit = 4 * max(known)  # a small model's temporaries barely grow at first: do not leap from them
        line = max(0, _steps((cap - state) / per_example)) if per_example > 0 else limit + BATCH_STEP
        if above is not None:
            line = min(line, above - BATCH_STEP)
        if budget <= 0:
            return (line, "predicted") if best < line <= limit or not best else (best, "at least")
        close = sorted(b for b in known if fits(b) and known[b][0] >= cap - (cap - state) / 8)
        if len(close) >= 2:  # the compiler's own remat: only a refusal bounds the batch
            step = max(best / 8, 2 * (close[-1] - close[-2])) if above is None else (above - best) / 2
            guess = best + max(BATCH_STEP, _steps(step))
        elif close or line <= best:
            guess = best + BATCH_STEP
        else:
            guess = line
        guess = min(guess, limit, above - BATCH_STEP if above is not None else guess)
        known[guess] = measure(guess)
        budget -= 1


def _steps(batch: float) -> int:
    """`batch` rounded down to a multiple of BATCH_STEP."""
    return int(batch) // BATCH_STEP * BATCH_STEP


def _first_remat(measure: Callable[[str], tuple[float, bool]], policies: list[str], need: float, state: float,
                 cap: float) -> tuple[str, float] | None:
    """(policy, bytes) of the first of `policies` (most HBM first) under which the batch fits `cap` bytes,
    `measure(policy)` compiling it, or None: none is tried when the batch's own bytes without remat (`need` -
    `state`) exceed REMAT_REACH times the room the chip leaves them."""
    if need - state > REMAT_REACH * (cap - state):
        return None
    for policy in policies:
        got, ok = measure(policy)
        if ok and got <= cap:
            return policy, got
    return None


def dcn_seconds(chip: Chip, chips: int, params: int, slices: int) -> float:
    """Seconds a step spends all-reducing the float32 gradients of `params` weights across `slices` slices of
    `chips` chips over DCN, after the all-reduce (or, under fsdp, reduce-scatter) inside each slice over ICI: a
    ring over N slices moves 2(N-1)/N of the gradient's bytes, each host its share (its chips' part of the slice)
    through its own DCN bandwidth (chip.dcn_bytes_per_s times its chips): per slice, chips x the chip's figure.
    Not overlapped with compute (XLA can overlap part of it): the estimate errs slow."""
    if slices < 2:
        return 0.0
    return 2 * (slices - 1) / slices * 4 * params / (chips * chip.dcn_bytes_per_s)


def roofline(chip: Chip, chips: int, model: dict, per_chip_batch: int, bytes_per_chip: float,
             sharding: str = "data", slices: int = 1, compiled_flops_per_chip: float | None = None
             ) -> tuple[float, float]:
    """(model FLOPs per chip per step, estimated step seconds) of `model` (its "params", "layers", "hidden",
    "seq_len", and "flop_params" where the template says which weights a matmul applies per token: N of 6·N·tokens,
    else "params") at `per_chip_batch` on `chips` chips of `chip` moving `bytes_per_chip` and computing
    `compiled_flops_per_chip` (if known; the model's FLOPs where fewer: the compiler's count leaves out a Pallas
    kernel that declares none, e.g. splash attention's) per step (module docstring: the roofline, plus the
    gradients' all-reduce; under fsdp the weights' two all-gathers, forward and backward, and the gradients'
    reduce-scatter: three halves of a ring all-reduce where data and zero1 have two),
    on each of `slices` slices, plus their all-reduce over DCN (dcn_seconds)."""
    seq = model["seq_len"]
    n = model.get("flop_params", model["params"])
    model_flops = (6 * n + 12 * model["layers"] * model["hidden"] * seq) * per_chip_batch * seq
    halves = 3 if sharding == "fsdp" else 2
    allreduce_s = (halves * (chips - 1) / chips * 4 * model["params"] / chip.allreduce_bytes_per_s
                   if chips > 1 else 0.0)  # float32 gradients (and weights), ring all-reduce
    flops = max(model_flops, compiled_flops_per_chip or 0.0)
    return model_flops, (max(flops / chip.peak_bf16_flops, bytes_per_chip / chip.hbm_bytes_per_s) + allreduce_s
                         + dcn_seconds(chip, chips, model["params"], slices))


def _roofline(req: _Request, *, method: str, fits: bool, per_device_batch: int, model: dict, hbm: float,
              compiled_flops: float | None, bytes_per_chip: float, largest: tuple[int, str],
              versions: tuple, compiles: int, topology: str, remat: tuple[str, bool] = ("none", False),
              cycles: int | None = None) -> Fit:
    chip, accel = req.chip, req.accel
    devices = accel.chips * chip.devices_per_chip
    per_chip_batch = per_device_batch * chip.devices_per_chip
    seq = model["seq_len"]
    model_flops, step_s = roofline(chip, accel.chips, model, per_chip_batch, bytes_per_chip, req.sharding,
                                   req.slices, compiled_flops)
    run_s = model["max_steps"] * step_s
    price = req.price_per_hour * req.slices  # one queued resource bills its N slices
    devices *= req.slices  # weak scaling: every slice runs the per-chip batch
    return Fit(
        fits=fits, method=method, accelerator=accel.name, topology=topology, chips=accel.chips,
        per_chip_batch=per_chip_batch, global_batch=per_device_batch * devices, seq_len=seq, params=model["params"],
        flop_params=int(model.get("flop_params", model["params"])),
        precision=model["precision"], hbm_per_chip_bytes=int(hbm), hbm_capacity_bytes=int(chip.hbm_bytes),
        max_per_chip_batch=largest[0] * chip.devices_per_chip, max_batch_is=largest[1],
        model_flops_per_step=model_flops, compiled_flops_per_step=compiled_flops,
        bytes_accessed_per_step=bytes_per_chip, est_step_s=step_s,
        est_mfu=model_flops / (step_s * chip.peak_bf16_flops) if step_s else 0.0,
        est_tokens_per_s=per_device_batch * devices * seq / step_s if step_s else 0.0, max_steps=model["max_steps"],
        est_run_s=run_s, price_per_hour=price, est_cost_usd=run_s / 3600 * price,
        jax=versions[0], libtpu=versions[1], compiles=compiles, chip_source=chip.source, sharding=req.sharding,
        remat_policy=remat[0], remat_chosen=remat[1], slices=req.slices,
        dcn_s=dcn_seconds(chip, accel.chips, model["params"], req.slices), compiler_cycles_per_step=cycles,
        framework=req.framework)


def _analytic_model(req: _Request) -> dict | None:
    """The shape facts of the template's resolved config (a transformer's `task` and `trainer` fields), or
    None for a template whose config does not have them."""
    task, trainer = getattr(req.resolved, "task", None), getattr(req.resolved, "trainer", None)
    if not (all(hasattr(task, n) for n in ("seq_len", "hidden_size", "num_layers", "num_heads", "intermediate_size"))
            and all(hasattr(trainer, n) for n in ("per_replica_batch_size", "max_steps"))):
        return None
    h, i, layers, seq, vocab = task.hidden_size, task.intermediate_size, task.num_layers, task.seq_len, req.vocab_size
    precision = getattr(getattr(req.resolved, "runtime", None), "mixed_precision", "auto")
    every_token = layers * (4 * h * h + 2 * h * i + 9 * h + i) + 2 * h  # the layers and the embeddings' norm
    # A masked LM's head (transform, norm and the tied decoder's bias, beside the token embedding as its decoder)
    # runs on the predicted positions only, as its template's flop_params counts; the embeddings are lookups.
    predicted = getattr(task, "predictions_per_seq", None)
    head = 0 if predicted is None else h * h + 3 * h + vocab
    params = vocab * h + seq * h + every_token + head
    flop_params = params if predicted is None else every_token + (head + vocab * h) * predicted / seq
    return {"seq_len": seq, "hidden": h, "layers": layers, "heads": task.num_heads, "vocab": vocab,
            "params": params, "flop_params": flop_params,
            "per_device_batch": trainer.per_replica_batch_size, "max_steps": trainer.max_steps,
            "precision": "mixed_bfloat16" if precision == "auto" else precision}


def _analytic_bytes(model: dict, batch: int, shards: int = 1, sharding: str = "data") -> tuple[float, float]:
    """(HBM, bytes accessed) per device, high on purpose: float32 weights, gradients and two Adam slots (16 B a
    weight, 44 B of traffic). Split over `shards` devices: under zero1 the slots (their traffic as data's: the
    update's share saved is spent gathering the weights, bert-base compiled for a v5e moved 1.6% more bytes);
    under fsdp all of it but for the token embedding, which the templates replicate, and each device may then hold
    every weight gathered, in the compute dtype.
    16-bit activations as Korthikanti et al. count them without recomputation, s·b·h·(34 + 5·a·s/h) a layer
    (doubled in float32); float32 logits, their gradient and a 16-bit copy over the whole sequence."""
    s, h, a = model["seq_len"], model["hidden"], model["heads"]
    width = 1 if model["precision"] == "mixed_bfloat16" else 2
    activations = batch * model["layers"] * s * h * (34 + 5 * a * s / h) * width
    logits = batch * s * model["vocab"] * 10
    batch_bytes = activations + logits
    if sharding == "zero1" or shards < 2:
        params = model["params"]
        return 8 * params + 8 * params / shards + batch_bytes, 44 * params + 2 * batch_bytes
    gathered = 2 * width * model["params"]
    whole = model["vocab"] * h  # the replicated token embedding
    split = model["params"] - whole
    state = 16 * (split / shards + whole) + gathered
    return state + batch_bytes, 44 * (split / shards + whole) + 2 * gathered + 2 * batch_bytes


def _analytic(req: _Request, versions: tuple, topology: str) -> Fit | None:
    model = _analytic_model(req)
    if model is None:
        return None
    chip = req.chip
    b0 = model["per_device_batch"]
    shards = req.accel.chips * chip.devices_per_chip if req.sharding in frameworks.SPLIT else 1
    hbm_device, traffic = _analytic_bytes(model, b0, shards, req.sharding)
    cap = chip.hbm_bytes / chip.devices_per_chip
    state, _ = _analytic_bytes(model, 0, shards, req.sharding)
    per_example = _analytic_bytes(model, 1, shards, req.sharding)[0] - state
    largest = max(0, int((cap - state) / per_example) // BATCH_STEP * BATCH_STEP)
    return _roofline(req, method="analytic", fits=hbm_device <= cap, per_device_batch=b0, model=model,
                     hbm=hbm_device * chip.devices_per_chip, compiled_flops=None,
                     bytes_per_chip=traffic * chip.devices_per_chip, largest=(largest, "predicted"),
                     versions=versions, compiles=0, topology=topology)


def _compiled(req: _Request, versions: tuple, topology: str, options: dict, budget: int, grow: bool,
              on_event: ev.EventSink) -> Fit:
    chip = req.chip
    path = _cache_path(req, topology, options, versions)
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = None
    if not (isinstance(cached, dict) and isinstance(cached.get("points"), dict)
            and isinstance(cached.get("model"), (dict, type(None)))):
        cached = {"model": None, "points": {}}  # none yet, or not an answer of ours (a hand-edited file)
    compiler: _Compiler | None = None
    compiles = 0

    def start() -> _Compiler:
        nonlocal compiler
        if compiler is None:
            on_event(ev.Note(f"fit: building {req.template.name}'s training step for {topology} (the TPU compiler "
                             f"takes a minute or more per batch on a laptop; the answer is cached)"))
            compiler = _Compiler(req, topology, options, path.with_suffix(".log"))
            cached["model"] = {**compiler.model["model"], "state_bytes": compiler.model["state_bytes"]}
        return compiler

    def point(batch: int, remat: str | None = None) -> dict:
        nonlocal compiles
        key = str(batch) if remat is None else f"{batch} remat {remat}"
        if key not in cached["points"]:
            c = start()
            under = f" under remat policy {remat}" if remat else ""
            on_event(ev.Note(f"fit: compiling for {topology} at per-chip batch {batch * chip.devices_per_chip}"
                             f"{under}"))
            cached["points"][key] = c.compile(batch, remat)
            compiles += 1
            catalog_mod.write_json_atomic(path, cached)
        return cached["points"][key]

    try:
        if cached["model"] is None:
            start()
        model = cached["model"]
        b0 = model["per_device_batch"]
        cap = chip.hbm_bytes / chip.devices_per_chip
        largest = _largest(lambda b: _need(point(b), model["state_bytes"]), b0, cap, model["state_bytes"],
                           budget - 1, grow=grow)
        run = point(b0)
        need, compiled_ok = _need(run, model["state_bytes"])
        remat = (model.get("remat_policy", "none"), False)
        if not (compiled_ok and need <= cap) and remat[0] in model.get("remat_policies", []):
            # The batch does not fit under the config's policy: the template's next ones, least recomputation first.
            later = model["remat_policies"][model["remat_policies"].index(remat[0]) + 1:]
            found = _first_remat(lambda p: _need(point(b0, p), model["state_bytes"]), later, need,
                                 model["state_bytes"], cap)
            if found is not None:
                remat = (found[0], True)
                run = point(b0, found[0])
                need, compiled_ok = _need(run, model["state_bytes"])
    finally:
        if compiler is not None:
            compiler.close()
    # A program refused over HBM has no cost analysis: its FLOPs are unknown, its bytes at least its memory's.
    cost = run.get("cost") or {"flops": None, "bytes": need}
    return _roofline(req, method="compiled", fits=compiled_ok and need <= cap, per_device_batch=b0, model=model,
                     hbm=need * chip.devices_per_chip,
                     compiled_flops=cost["flops"] * chip.devices_per_chip if cost["flops"] is not None else None,
                     bytes_per_chip=cost["bytes"] * chip.devices_per_chip, largest=largest, versions=versions,
                     compiles=compiles, topology=topology, remat=remat, cycles=cost.get("estimated_cycles"))


def fit(spec, *, spec_dir: Path | None = None, accelerator: str | None = None, on_event: ev.EventSink = ev.ignore,
        max_compiles: int = MAX_COMPILES, screen: bool = False) -> Fit | None:
    """The fit of `spec`'s job (a tpuctl.spec.RunSpec) on its accelerator (or `accelerator`). Compiles with
    the TPU compiler when it is installed and the template offers its step (template.json `fit`), at most
    `max_compiles` times, plus one per remat policy tried (the template's, after the config's, when the run's
    batch does not fit: the first that fits is `remat_policy`, with `remat_chosen`); else the analytic estimate
    (None when the template's config has no transformer shape to estimate from). `screen`: answer with the analytic estimate, without compiling, when even that
    overestimate uses under SCREEN_SHARE of the chip's HBM, and search no larger batch when the run's fits (the
    check before run/up; it refuses a run that fits only under a remat policy its config does not name).
    The step is the one the run's framework trains (the plan's choice; the answer's `framework`): JAX's, or
    TensorFlow's as Fit.framework says. `job.sharding` auto: the first of data's, zero1's and fsdp's fits that
    fits, else fsdp's (not where the framework is TensorFlow, which splits nothing, nor on one device, nor for a
    template without runtime.sharding, or without one of them); the answer's `sharding` says which.
    Blocks for the compiles;
    creates nothing. Raises BadInput for a spec without a job or an unknown type, TpuctlError if a compile fails."""
    spec_dir = spec_dir or Path.cwd()
    sharding = spec.job.sharding if spec.job is not None else "data"
    if sharding != "auto":
        return _fit(_request(spec, spec_dir, accelerator, sharding), max_compiles, screen, on_event)
    req = _request(spec, spec_dir, accelerator, "data")
    answer = _fit(req, max_compiles, screen, on_event)
    if answer is None or req.framework == "tensorflow" or req.accel.chips * req.chip.devices_per_chip < 2:
        return answer  # (one device has nothing to split the state over)
    for split in frameworks.SPLIT:  # least split first
        if answer.fits:
            break
        try:
            req = _request(spec, spec_dir, accelerator, split)
        except BadInput as exc:
            if exc.field == "job.config.runtime.sharding":  # the template has no such sharding
                continue
            raise
        answer = _fit(req, max_compiles, screen, on_event)
    return answer


def _fit(req: _Request, max_compiles: int, screen: bool, on_event: ev.EventSink) -> Fit | None:
    """fit's answer for one request (one sharding)."""
    versions = compiler_versions()
    topology, options = topology_of(req.accel)
    analytic = _analytic(req, versions, topology)
    if versions[1] is None or req.template.fit_target is None:
        why = (f"the TPU compiler is not installed ({INSTALL_HINT})" if versions[1] is None else
               f"template {req.template.name} offers no step to compile (template.json `fit`)")
        return replace(analytic, not_compiled=why) if analytic else None
    if screen and analytic is not None and analytic.hbm_per_chip_bytes < SCREEN_SHARE * req.chip.hbm_bytes:
        return replace(analytic, not_compiled=f"even this overestimate is under {SCREEN_SHARE:.0%} of the chip's "
                                              "HBM; `tpuctl fit` compiles it")
    return _compiled(req, versions, topology, options, max_compiles, not screen, on_event)


def check(spec, *, spec_dir: Path | None = None, on_event: ev.EventSink = ev.ignore) -> Fit | None:
    """The check `run` and `up` make before creating anything: BadInput (exit 2) naming the HBM needed and
    available and the largest batch that fits when the compiled step does not fit; else the fit (`note` is
    its line for the plan). An analytic estimate never refuses (it errs high on purpose)."""
    result = fit(spec, spec_dir=spec_dir, on_event=on_event, max_compiles=CHECK_COMPILES, screen=True)
    if result is not None and result.method == "compiled" and not result.fits:
        split = (", or train with JAX (job.framework: jax: its attention and loss kernels, remat and a split "
                 "training state need less HBM)" if result.framework == "tensorflow" else
                 "" if result.sharding == "fsdp" or result.chips < 2 else
                 ", or split the training state (job.sharding: zero1, or fsdp for the weights too)"
                 if result.sharding == "data" else ", or split the weights too (job.sharding: fsdp)")
        raise BadInput(f"the run does not fit: {result.hbm_line()}", field="job",
                       hint="lower trainer.per_replica_batch_size in job.config, pick a type with more HBM per chip"
                            f"{split}; --no-fit-check skips this check")
    if result is not None and result.remat_chosen:  # the workers would run the config's policy, which does not fit
        raise BadInput(f"the run fits only with activation checkpointing: {result.hbm_line()}",
                       field="job.config.trainer.remat_policy",
                       hint=f"set trainer.remat_policy: {result.remat_policy} in job.config (est. "
                            f"{result.est_step_s * 1e3:.1f} ms/step), or lower trainer.per_replica_batch_size")
    return result


def note(result: Fit) -> ev.Note:
    """The fit as one line of the plan."""
    how = "compiled" if result.method == "compiled" else f"analytic estimate, not compiled: {result.not_compiled}"
    if result.framework == "tensorflow":
        how += ", TensorFlow's step as its XLA program through JAX"
    if not result.fits:  # only an analytic estimate gets here (check refuses a compiled step that does not fit)
        how += "; over the chip's HBM by this deliberately high estimate, not enforced: `tpuctl fit` compiles it"
    slices = f" on each of {result.slices} slices" if result.slices > 1 else ""
    return ev.Note(f"fit: {_gb(result.hbm_per_chip_bytes)} of {_gb(result.hbm_capacity_bytes)} HBM per chip{slices} "
                   f"({how}; sharding {result.sharding}); "
                   f"est. {result.est_step_s * 1e3:.1f} ms/step, MFU {result.est_mfu:.0%}, "
                   f"{duration_text(result.est_run_s)} and ${result.est_cost_usd:,.2f} for {result.max_steps} steps")


def duration_text(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
