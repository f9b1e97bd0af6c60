"""`tpuctl run` as a state machine: validate -> up -> prepare data -> ship -> launch -> watch (-> recover ->
watch) -> collect / tear down -> done or failed. `RunState` names the states, `TRANSITIONS` is the whole flow
(one screen), `Pipeline.run` the loop that follows it, and each state's work is one method.

The TPU and VMs are torn down whenever anything after validation fails: on success, job failure, any
exception, Ctrl-C and SIGTERM (the CLI turns SIGTERM into KeyboardInterrupt) the loop goes to TEARDOWN. The
bucket stays (it carries a TTL label) unless `delete_bucket`, or unless this invocation created it and failed
before the job launched and before any prepared data landed in it: then it holds nothing worth keeping, and a
failed run must not leave half of itself behind (prepared data is kept: a rerun finds it and skips the
preparation). `detach` hands the run to a supervisor VM created alongside the TPU (`supervise`, see
`tpuctl.jobs.supervisor_vm`) and returns once it took over, or right after launch without one; `attach` picks a
detached run up again.

Preemption: every `poll_s` the node's state is read; PREEMPTED, gone, or a worker that stopped answering
triggers recovery: status.json says `recovering: true` (so gc leaves the run alone), the node is recreated
(same zone; if that fails, the plan's failover zones), the same bundle is launched again and the job resumes
from the latest checkpoint in the bucket. `max_recoveries` bounds it. A node under maintenance, or READY with
its job's processes gone (it restarted), is waited for and relaunched, not recreated.

Every state entered is marked on the run's timeline (`tpuctl.jobs.timeline`: goodput and dollars by phase).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import glob
import math
import re
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tpuctl import catalog, cost, fitting, ledger, provision
from tpuctl import events as ev
from tpuctl.errors import (BadInput, CapacityError, Interrupted, JobFailed, NotFound, RunDurationEnded, TpuctlError,
                           Unexpected, WaitTimeout)
from tpuctl.provision import Kind, State
from tpuctl.provision import labels
from tpuctl.templates import contract

if TYPE_CHECKING:
    from tpuctl.provision import Clients, Plan

from . import bundle as bundles
from . import cluster, launch as launching, logs, timeline as timelines
from .ssh import Fleet, Target

TAIL_LINES = 20
UNREACHABLE_POLLS = 3  # consecutive polls a READY node's worker may not answer before it counts as lost
# How long the log streams may take to deliver what a job that ended on every worker wrote last. Its logs are
# finite then (each tail ends with the agent), but a stream can still be connecting: a short job on a node just
# recreated can finish before its first line arrives, and cutting it off loses the run's last step.
LOG_DRAIN_S = 30.0


@dataclass(frozen=True)
class RunOptions:
    name: str | None = None
    yes: bool = False
    detach: bool = False
    attach: str | None = None
    download: Path | None = None
    delete_bucket: bool = False
    max_recoveries: int | None = None
    dry_run: bool = False
    poll_s: float = 2.0
    python: str = "python3"  # the runtime's interpreter on TPU VMs (the venv python on the local cloud)
    cancel: threading.Event | None = None  # set it (from any thread) to stop the run; it still tears down
    export: tuple[str, ...] = ()  # formats (template `exporters`) written to model/FORMAT/ when the job succeeds
    fit_check: bool = True  # compile the step for the TPU first (tpuctl.fitting.check); refuse a run over HBM
    supervise: bool = True  # with `detach`: a supervisor VM takes the run over (jobs.supervisor_vm); else it is left
    spare: tuple[str, ...] = ()  # resource keys teardown leaves (the supervisor's own VM: it deletes itself last)


@dataclass
class Outcome:
    """What happened, for the summary (`as_dict` is the --json form)."""

    run: str
    state: str = "planned"  # planned | detached | succeeded | failed | interrupted
    phases: dict[str, float] = field(default_factory=dict)
    step: int | None = None
    loss: float | None = None
    examples_per_sec: float | None = None
    recoveries: int = 0
    bucket: str | None = None
    artifacts: list[str] = field(default_factory=list)
    downloaded: str | None = None
    cost_usd: float | None = None
    price_per_hour: float | None = None
    last_step_to_delete_s: float | None = None
    failing_worker: int | None = None
    tail: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def model_url(self) -> str | None:
        return f"gs://{self.bucket}/runs/{self.run}/model" if self.bucket else None

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["model_url"] = self.model_url
        d["tensorboard"] = f"tensorboard --logdir {self.model_url}" if self.model_url else None
        return d


class _Serialized:
    """The caller's event sink, called by one thread at a time: provisioning and log streams report from
    several, and a notebook's callback should not have to lock.

    A sink that raises is not called again and its exception is kept in `failure`: raised where it happened
    (a log stream, a provisioning thread) it would be lost or taken for a cloud failure; the pipeline raises
    it at its next check instead, and still tears down."""

    def __init__(self, sink: ev.EventSink):
        self._sink = sink
        # Re-entrant: teardown's signal handler reports from the main thread, which may be inside a report.
        self._lock = threading.RLock()
        self.failure: Exception | None = None

    def __call__(self, event: ev.Event) -> None:
        with self._lock:
            if self.failure is not None:
                return
            try:
                self._sink(event)
            except Exception as exc:  # noqa: BLE001 - see the class docstring
                self.failure = exc


def _number(text: str | None, previous: float | None) -> float | None:
    """A metric from a step line as a number for --json; a finite one only (JSON has no NaN): a diverged loss
    shows in the streamed lines themselves."""
    try:
        value = float(text) if text is not None else None
    except ValueError:
        return previous
    return value if value is not None and math.isfinite(value) else previous


class _Stream:
    """Log sink: turns worker lines into WorkerLog and Metrics events, remembers each worker's last lines
    and worker 0's metrics (the outcome's). Which lines are progress is the template's (template.json `progress`,
    contract.Progress)."""

    def __init__(self, outcome: Outcome, emit: ev.EventSink = ev.ignore,
                 progress: contract.Progress = contract.Progress()):
        self.outcome = outcome
        self.emit = emit
        self.progress = progress
        self.tails: dict[int, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=TAIL_LINES))
        self.last_step_at: float | None = None
        self.max_steps: int | None = None
        self.lock = threading.Lock()

    def __call__(self, worker: int, line: str) -> None:
        metrics = None
        step_line = self.progress.step_line.match(line)
        with self.lock:
            self.tails[worker].append(line)
            if worker == 0 and (start := self.progress.start_line.match(line)):
                self.max_steps = int(start["max_steps"])
            m = step_line or self.progress.done_line.match(line)
            if m:
                values = m.groupdict()
                loss, rate = values.get("loss"), values.get("examples_per_sec")
                # When the step ended on the worker, where its line says: lines reach tpuctl in bursts (the
                # first ones only once SSH is up), so the time one arrives says little about the step.
                now = time.time()
                ended = min(_number(values.get("time"), now), now)
                metrics = ev.Metrics(worker, int(m["step"]), loss=_number(loss, None),
                                     examples_per_s=_number(rate, None), max_steps=self.max_steps, at=ended)
                if worker == 0:
                    self.outcome.step = metrics.step
                    self.outcome.loss = _number(loss, self.outcome.loss)
                    self.outcome.examples_per_sec = _number(rate, self.outcome.examples_per_sec)
                    self.last_step_at = metrics.at
        # Every worker trains the same steps: worker 0's progress lines stand for all, so a 64-host slice
        # does not log each step 64 times. Anything else (warnings, tracebacks) shows from every worker.
        if worker == 0 or not step_line:
            self.emit(ev.WorkerLog(worker, line))
        if metrics is not None:
            self.emit(metrics)


def check_runtime_tensorflow(template: contract.Template, runtime: str, default: str) -> None:
    """BadInput when the runtime image's TensorFlow is older than every one the template is tested with
    (template.json `keras_by_tensorflow`): its Keras 3 would not run there, so nothing is created."""
    m = re.match(r"^tpu-vm-tf-(\d+)\.(\d+)\.", runtime)
    tested = template.keras_by_tensorflow
    if not m or not tested:
        return
    oldest = min(tested, key=lambda v: tuple(int(x) for x in v.split(".")))
    if (int(m.group(1)), int(m.group(2))) < tuple(int(x) for x in oldest.split(".")):
        raise BadInput(f"runtime {runtime!r} carries TensorFlow {m.group(1)}.{m.group(2)}, older than any the "
                       f"{template.name} template is tested with ({oldest} and later)", field="runtime_version",
                       hint=f"use {default} (the default) or another tpu-vm-tf-{oldest}+ runtime")


def _corpus_path(pattern: str, spec_dir: Path) -> str:
    """Paths in a spec are relative to the spec file, so it works from any directory."""
    if pattern.startswith("gs://"):
        return pattern
    return str(spec_dir / Path(pattern).expanduser())


@contextmanager
def _shielded(emit: ev.EventSink) -> Iterator[None]:
    """Teardown must finish: while it runs, Ctrl-C and SIGTERM only say so (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def note(signum, frame):
        emit(ev.Warn("tearing down the TPU and VMs; interrupting now would leave them billing"))

    old = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


# --- the run's states and transitions ------------------------------------------------------------------

class RunState(enum.Enum):
    """Where a run is. Each state but DONE and FAILED is one method of `Pipeline` (`Pipeline._work`)."""

    VALIDATE = "validate"  # spec, template, plan, data and config checked; the caller confirms
    ATTACH = "attach"  # --attach: a detached run's records, found in its bucket
    UP = "up"  # TPU, VMs, bucket, IAM
    PREPARE = "prepare"  # the corpus prepared into the bucket
    SHIP = "ship"  # the job bundle uploaded
    LAUNCH = "launch"  # the job started on every worker
    WATCH = "watch"  # logs streamed, node and workers polled until the job ends or the node is lost
    RECOVER = "recover"  # the node brought back (or waited for) and the job relaunched from its checkpoint
    COLLECT = "collect"  # exports written, artifacts listed and downloaded
    TEARDOWN = "teardown"  # TPU and VMs deleted (and the bucket, when asked or when it holds nothing)
    DONE = "done"
    FAILED = "failed"


class Verdict(enum.Enum):
    """What a state's work found; with the state it picks the next one in TRANSITIONS."""

    OK = "ok"
    DRY_RUN = "dry run"
    DETACHED = "detached"
    SUCCEEDED = "succeeded"  # the job exited 0 on every worker (from TEARDOWN: its artifacts are still to collect)
    DELETE_BUCKET = "succeeded, bucket to delete"
    LOST = "lost"  # the node was preempted or is gone, or a worker stopped answering
    MAINTENANCE = "maintenance"  # the node is under maintenance, or came back from it: the same node is relaunched
    HELD = "held"  # the TPU and VMs are still up
    FAILED = "failed"  # a state raised; the error is re-raised once the run is torn down
    # WATCH only, never a transition: it raises JobFailed (after stopping every worker) or Interrupted.
    JOB_FAILED = "job failed"
    STOPPED = "stopped"


S, V = RunState, Verdict
TRANSITIONS: dict[tuple[RunState, Verdict], RunState] = {
    (S.VALIDATE, V.OK): S.UP,
    (S.VALIDATE, V.DRY_RUN): S.DONE,  # planned; nothing created
    (S.ATTACH, V.OK): S.WATCH,
    (S.ATTACH, V.LOST): S.RECOVER,  # the TPU is gone (Google deleted it while nobody watched): made again
    (S.UP, V.OK): S.PREPARE,
    (S.PREPARE, V.OK): S.SHIP,
    (S.SHIP, V.OK): S.LAUNCH,
    (S.LAUNCH, V.OK): S.WATCH,
    (S.LAUNCH, V.DETACHED): S.DONE,  # --detach: the run goes on without us; nothing is torn down
    (S.WATCH, V.LOST): S.RECOVER,
    (S.WATCH, V.MAINTENANCE): S.RECOVER,
    (S.RECOVER, V.OK): S.WATCH,  # recovery relaunched the job
    (S.WATCH, V.SUCCEEDED): S.TEARDOWN,  # the TPU goes first: it bills by the second, the artifacts wait in the bucket
    (S.TEARDOWN, V.SUCCEEDED): S.COLLECT,  # the status record says succeeded; now the artifacts
    (S.WATCH, V.DELETE_BUCKET): S.COLLECT,  # --delete-bucket: collect while the bucket exists ...
    (S.COLLECT, V.HELD): S.TEARDOWN,  # ... then tear it all down
    (S.COLLECT, V.OK): S.DONE,
    (S.TEARDOWN, V.OK): S.DONE,
    (S.TEARDOWN, V.FAILED): S.FAILED,
}
# A state that raises goes to TEARDOWN (then FAILED, re-raising), or straight to FAILED when nothing is up: from
# VALIDATE (nothing created), ATTACH (a detached run is left as it was), or once torn down.
NOTHING_UP = frozenset({S.VALIDATE, S.ATTACH})


@dataclass
class BucketUse:
    """What this invocation did with the run's bucket, which decides whether a failed run deletes it."""

    created: bool = False  # this invocation made it (UP)
    present: bool = False  # it exists, so the run's records can be written to it
    data_url: str | None = None  # where the prepared data is (PREPARE)
    holds_data: bool = False  # prepared data is in it (costly to make again)
    launched: bool = False  # a job was started on the workers, so it may hold checkpoints

    @property
    def disposable(self) -> bool:
        return self.created and not self.launched and not self.holds_data


@dataclass
class Billing:
    """When this invocation's resources started billing and when their deletion was asked for."""

    up_started: float | None = None
    delete_requested_at: float | None = None
    torn_down: bool = False


def _leads_on(work: Callable[[], object]) -> Callable[[Verdict], Verdict]:
    """A state whose work either raises or leads on to the next."""
    def step(_: Verdict) -> Verdict:
        work()
        return Verdict.OK
    return step


# --- the pipeline ------------------------------------------------------------------------------------

class Pipeline:
    """One `tpuctl run`. Construct, then `run()` (blocks to the end) or `attach()`.

    Silent: it reports through `on_event` (see tpuctl.events) and never asks. Unless `options.yes`, the
    caller's `confirm(plan)` decides after validation whether anything is created; without either the run is
    refused before it creates anything.

    What changes as it runs: `state`, `plan`/`template` (VALIDATE), the node as UP or RECOVER last
    made it (`_tpu`, `zone`, `node`) and the `record` of its launch, `bucket_use` and `billing` (what teardown
    and the cost need), `timeline`, and the `outcome` reported.
    """

    def __init__(self, clients: Clients | None, spec=None, *, project: str | None = None, spec_dir: Path | None = None,
                 options: RunOptions = RunOptions(), on_event: ev.EventSink | None = None,
                 confirm: Callable[[Plan], bool] | None = None, plan: Plan | None = None):
        # `clients` may be None for a dry run, which only validates and plans. `plan`: with `attach`, the run's
        # resolved plan (a supervisor has it from the hand-off): a TPU that is gone is made again from it.
        self.clients = clients
        self.project = project or clients.project
        self.spec = spec
        self.spec_dir = spec_dir or Path.cwd()
        self.opts = options
        self.plan = plan
        self.sharding = "data"  # job.sharding as validate() resolves it (auto: by the fit): runtime.sharding
        self.run_name = options.attach or options.name or (spec.name if spec is not None else None)
        self.outcome = Outcome(run=self.run_name or "")
        self.emit = _Serialized(on_event or ev.ignore)
        self.confirm = confirm
        self.cancel = options.cancel or threading.Event()
        self.stream = _Stream(self.outcome, self._observe)
        self.cursor = logs.Cursor()
        self.zone = ""
        self.node = ""
        self.record: cluster.LaunchRecord | None = None
        self.template: contract.Template | None = None  # set by validate()
        self._tpu: provision.Resource | None = None  # the TPU as up/recovery last made it
        self.bucket_use = BucketUse()
        self.billing = Billing()
        self.timeline = timelines.Timeline()
        self.state = RunState.ATTACH if options.attach else RunState.VALIDATE

    # -- phases
    @contextmanager
    def phase(self, name: str, detail: str = "", *, quiet: bool = False, cancellable: bool = True) -> Iterator[None]:
        """Time a phase into the outcome and report it (`quiet`: time only). A cancelled run stops at the
        next phase it starts, except tear down: that is what cancelling asks for."""
        if cancellable:
            self._check_cancel()
        if not quiet:
            self.emit(ev.PhaseStarted(name, detail))
        start, ok = time.monotonic(), False
        try:
            yield
            ok = True
        finally:
            seconds = time.monotonic() - start
            self.outcome.phases[name] = round(self.outcome.phases.get(name, 0.0) + seconds, 2)
            if not quiet:
                self.emit(ev.PhaseEnded(name, round(seconds, 2), ok))
                self._report_cost()

    def _check_cancel(self) -> None:
        if self.cancel.is_set():
            raise Interrupted(f"run {self.run_name}: cancelled")
        if self.emit.failure is not None:
            raise TpuctlError(f"run {self.run_name}: the on_event callback failed: {self.emit.failure!r}",
                              hint="fix the callback; the run was torn down") from self.emit.failure

    def _report_cost(self) -> None:
        """An estimate while resources are up (the plan's price x time since up); teardown reports the
        ledger's figure, and after it nothing bills."""
        up_started = self.billing.up_started
        if up_started is not None and self.billing.delete_requested_at is None and self.outcome.price_per_hour is not None:
            usd = self.outcome.price_per_hour * (time.time() - up_started) / 3600
            self.emit(ev.CostAccrued(round(usd, 4), self.outcome.price_per_hour))

    def validate(self):
        with self.phase("validate", quiet=True):  # bad input: one error line, nothing before it
            if self.spec is None or self.spec.job is None:
                raise BadInput("the spec has no job: section", field="job",
                               hint="add `job: {template: bert, preset: bert-tiny}` (see examples/bert-tiny.yaml)")
            # A directory relative to the spec wins over a built-in template of the same name; a template given
            # as a path is only ever looked for there.
            self.template = contract.find(self.spec.job.template, base_dir=self.spec_dir)
            self.stream.progress = self.template.progress  # which worker lines are its progress
            self.plan = provision.plan(self.spec, project=self.project, frameworks=self.template.frameworks)
            check_runtime_tensorflow(self.template, self.plan.runtime_version, self.plan.accelerator.default_runtime)
            self.run_name = self.outcome.run = self.plan.run
            self.outcome.bucket = self.plan.bucket
            self.outcome.price_per_hour = round(self.plan.price_per_hour, 4)
            self._check_data()
            self._check_config()
            if self._supervised:
                self._plan_supervisor()
            for fmt in self.opts.export:  # a format the template cannot write is bad input, before anything exists
                self.template.exporter(fmt)
            # A step over the chip's HBM would fail on the TPU once paid for (compiling reports its progress).
            fitted = fitting.check(self.spec, spec_dir=self.spec_dir,
                                   on_event=self.emit) if self.opts.fit_check else None
            # job.sharding auto: what the fit chose (data when it fits); without a fit, data.
            requested = self.spec.job.sharding
            self.sharding = fitted.sharding if fitted is not None and requested == "auto" else (
                "data" if requested == "auto" else requested)
            for note in self.plan.notes:
                self.emit(ev.Note(note))
            self.emit(ev.RunPlanned(self.plan.run, self.plan.accelerator.name, tuple(self.plan.zones), self.plan.bucket,
                                    self.plan.price_per_hour, framework=self.plan.framework,
                                    runtime_version=self.plan.runtime_version, provisioning=self.plan.provisioning))
            if fitted is not None:
                self.emit(fitting.note(fitted))

    def _check_data(self) -> None:
        """Corpus files and options are checked before anything is created: bad input costs nothing."""
        data = self.spec.job.data
        if not data.corpus:
            return
        prep = self.template.data
        if prep is None:
            raise BadInput(f"template {self.template.name} prepares no data, but the spec gives job.data.corpus",
                           field="job.data.corpus", hint="remove job.data, or pass the data through job.config")
        for c in data.corpus:
            if not c.startswith("gs://") and not glob.glob(_corpus_path(c, self.spec_dir)):
                raise BadInput(f"corpus {c!r} matches no file (paths are relative to the spec's directory, "
                               f"{self.spec_dir})", field="job.data.corpus",
                               hint="list UTF-8 text files, globs or gs:// URLs")
        try:
            self._data_options().validate()
        except prep.error as exc:
            raise BadInput(str(exc), field="job.data", hint="see `tpuctl data prepare --help`") from exc

    def _data_options(self):
        """The template's data options from `job.data`: fields the spec sets, else the preset's sequence length,
        else the spec's defaults (a gpt2-small run prepares 1024-token blocks unless told otherwise)."""
        data, prep = self.spec.job.data, self.template.data
        given = data.model_fields_set
        values = {k: getattr(data, k) for k in prep.spec_options if k in given or k != "seq_len"}
        preset = self.template.presets.get(self.spec.job.preset or self.template.default_preset)  # checked later
        if "seq_len" in prep.spec_options and "seq_len" not in given:
            values["seq_len"] = (preset.task.get("seq_len") if preset else None) or data.seq_len
        unknown = sorted((given - {"corpus"}) - set(prep.spec_options))
        if unknown:
            prep.make_options(**{unknown[0]: getattr(data, unknown[0])})  # raises, naming the field
        return prep.make_options(**values)

    def _check_config(self) -> None:
        """The template checks the config the workers would get (unknown keys, types, divisibility) before
        anything is created: a typo must not cost a TPU and leave a bucket behind."""
        job = self.spec.job
        config = bundles.job_config(job.config, preset=job.preset, bucket=self.plan.bucket, run=self.plan.run,
                                    data_url=None, profile=job.profile, framework=self.plan.framework,
                                    sharding=job.sharding)
        bundles.check_job_config(self.template, job, config)

    def up(self):
        # The function itself, not `provision.apply`: that package attribute is replaced by the `apply`
        # submodule once anything imports it (the package loads it lazily), and a module is not callable.
        from tpuctl.provision.apply import apply as apply_plan

        with self.phase("up"):
            self.billing.up_started = self.billing.up_started or time.time()
            result, supervisor = self._with_supervisor(lambda: apply_plan(
                self.clients, self.plan, progress=ev.resource_progress(self.emit), cancel=self.cancel,
                on_gone=lambda entries: ledger.remember_gone(entries, on_event=self.emit)))
        ledger.remember(result.resources + ((supervisor,) if supervisor else ()), on_event=self.emit)
        bucket = result.get(Kind.BUCKET)
        self.bucket_use.created = bucket is not None and bucket.key in result.created
        self.bucket_use.present = bucket is not None
        tpu = result.get(Kind.TPU)
        if tpu is None:
            raise TpuctlError(f"up finished without a TPU node for run {self.plan.run}")
        self._tpu = tpu
        self.zone, self.node = tpu.location, tpu.name

    # -- the supervisor of a detached run (jobs.supervisor_vm)
    @property
    def _supervised(self) -> bool:
        return self.opts.detach and self.opts.supervise

    def _plan_supervisor(self) -> None:
        from . import supervisor_vm

        supervisor_vm.check(self.plan)
        if self.clients is not None:  # its identity: present, or this caller may create it (else BadInput)
            from tpuctl.provision import supervisor_account

            supervisor_account.check(self.clients, self.spec.supervisor.service_account)
        prices = catalog.load()
        price = supervisor_vm.price_per_hour(self.plan, prices)
        self.outcome.price_per_hour = round(self.outcome.price_per_hour + price, 4)
        self.emit(ev.Note(f"supervisor VM {supervisor_vm.vm_name(self.plan.run)}: "
                          f"{supervisor_vm.machine_type(prices)} at ${price:.4f}/h (${24 * price:.2f}/day)"))

    def _with_supervisor(self, apply: Callable[[], provision.ApplyResult]):
        """`apply()`, and with `detach` the supervisor VM created meanwhile in the plan's first zone (the TPU's
        region), running as the supervisor's own service account (provision.supervisor_account: adopted or created,
        then granted the run's bucket), then the wheel it installs uploaded at once (the bucket exists now). A
        failure of either reaches the caller once both ended; teardown deletes what was made (never the account)."""
        if not self._supervised:
            return apply(), None
        from concurrent.futures import ThreadPoolExecutor

        from tpuctl.provision import bucket as buckets, supervisor_account

        from . import supervisor_vm

        tpu_account = buckets.default_service_account(self.clients) if self.plan.service_account == "default" \
            else self.plan.service_account
        account = self.spec.supervisor.service_account or supervisor_account.email_of(self.clients.project)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="supervisor-vm") as pool:
            def supervisor() -> provision.Resource:
                # Its own least-privilege identity (adopted, or created with its grants), then its VM.
                supervisor_account.ensure(self.clients, tpu_account=tpu_account,
                                          account=self.spec.supervisor.service_account)
                return supervisor_vm.create(self.clients, self.plan, self.plan.zones[0], service_account=account,
                                            cancel=self.cancel, progress=ev.resource_progress(self.emit))

            creating = pool.submit(supervisor)
            result = apply()
            made = creating.result()
        # The run's records, on the run's bucket only: the bucket exists now.
        buckets.grant(self.clients, self.plan.bucket, account, run=self.plan.run, region=self.plan.region)
        self.emit(ev.Note(f"supervisor: tpuctl wheel in "
                          f"{supervisor_vm.upload_wheel(self.clients, self.plan.run, self.plan.bucket)}"))
        return result, made

    def _hand_over(self) -> None:
        from tpuctl.provision.plan import to_record

        from . import supervisor_vm

        rec = self.record
        with self.phase("hand over", supervisor_vm.vm_name(rec.run)):
            supervisor_vm.hand_over(self.clients, rec.run, rec.bucket, on_event=self.emit, cancel=self.cancel,
                                    options={"poll_s": self.opts.poll_s, "delete_bucket": self.opts.delete_bucket,
                                             "export": list(self.opts.export), "plan": to_record(self.plan)})

    def prepare_data(self) -> str | None:
        data = self.spec.job.data
        if not data.corpus:
            return None
        url = f"gs://{self.plan.bucket}/runs/{self.plan.run}/data"
        prep = self.template.data

        with self.phase("prepare data"):
            blob = self.clients.storage.bucket(self.plan.bucket).blob(f"runs/{self.plan.run}/data/{prep.manifest}")
            if blob.exists():
                self.emit(ev.Note(f"prepared data already in {url}"))
                self.bucket_use.holds_data = True
                return url
            corpus = [_corpus_path(c, self.spec_dir) for c in data.corpus]
            options = self._data_options()
            try:
                with tempfile.TemporaryDirectory(prefix="tpuctl-data-") as staging:
                    manifest = prep.prepare(corpus, staging, options, storage_client=self.clients.storage)
                    prep.upload(staging, url, storage_client=self.clients.storage)
                    self.bucket_use.holds_data = True
            except prep.error as exc:
                raise BadInput(str(exc), field="job.data",
                               hint="corpus files must be UTF-8 text, one sentence or paragraph per line") from exc
            self.emit(ev.Note(f"data: {manifest.sequences} sequences of {manifest.seq_len} tokens, "
                              f"vocab {manifest.vocab_size}"))
        return url

    def ship(self, data_url: str | None) -> bundles.Bundle:
        workers = max(len(self._tpu.workers), self.plan.accelerator.hosts)
        max_recoveries = self.opts.max_recoveries if self.opts.max_recoveries is not None else self.spec.job.max_recoveries
        with self.phase("upload"):
            job = self.spec.job
            config = bundles.job_config(job.config, preset=job.preset, bucket=self.plan.bucket, run=self.plan.run,
                                        data_url=data_url, framework=self.plan.framework, profile=job.profile,
                                        sharding=self.sharding)
            description = bundles.JobDescription(
                run=self.plan.run, project=self.project, bucket=self.plan.bucket, module=self.template.entry_module,
                config=config, args=tuple(job.args), env=dict(job.env), num_workers=workers,
                heartbeat_s=10.0 if not self.clients.local else 2.0, storage=bundles.worker_storage(self.clients))
            from tpuctl import paths

            b = bundles.build(self.template.root, description, paths.home() / "bundles", packages=self.template.uses)
            sent = bundles.upload(self.clients.storage, self.plan.bucket, b)
            self.emit(ev.Note(f"bundle {b.sha256[:16]} {'uploaded' if sent else 'unchanged, not uploaded'}"))
        self.record = cluster.LaunchRecord(
            run=self.plan.run, zone=self.zone, node=self.node, bucket=self.plan.bucket, bundle_object=b.object_name,
            bundle_sha=b.sha256, python=self.opts.python, workers=workers,
            max_recoveries=max_recoveries, launched=time.time())
        return b

    def launch(self, *, recovering: bool = False) -> None:
        rec = self.record
        with self.phase("launch", f"{rec.workers} worker(s)"):
            key, targets = cluster.authorize(self.clients, rec.zone, rec.node)
            cluster.open_status(self.clients, rec.bucket, rec.run, recovering=recovering, on_event=self.emit)
            self.bucket_use.launched = True
            bundle = bundles.Bundle(path=Path(), sha256=rec.bundle_sha, run=rec.run,
                                    storage=bundles.worker_storage(self.clients))

            async def go():
                async with Fleet(targets, key, on_retry=lambda t, why: self.emit(ev.Note(f"worker {t.index}: waiting for ssh ({why})")),
                                 on_event=self.emit) as fleet:
                    slices = int((self._tpu.detail if self._tpu is not None else {}).get("slices", 1))
                    if slices > 1:
                        await launching.check_slices(fleet, slices)
                    await launching.launch(fleet, run=rec.run, project=self.project, bucket=rec.bucket,
                                           bundle=bundle, python=rec.python)

            asyncio.run(go())
            cluster.save_launch(self.clients, rec)
            if recovering:
                cluster.update_status(self.clients, rec.bucket, rec.run, recovering=False, on_event=self.emit)
            self.cursor = logs.Cursor()  # a (re)launched job starts a fresh log on every worker
        self.timeline.mark("workers_ready", at=time.time())

    # -- watching
    async def _watch(self, targets: list[Target], key) -> tuple[Verdict, launching.WorkerState | None]:
        """Stream logs and poll until the job ends on every worker (SUCCEEDED), fails on one (JOB_FAILED), or the
        node/a worker is lost (LOST, or MAINTENANCE while Google repairs it)."""
        rec = self.record

        async def stream(fleet: Fleet) -> None:
            try:
                await logs.follow(fleet, rec.run, self.stream, cursor=self.cursor)
            except TpuctlError:  # the node went away mid-stream; the poll loop decides what that means
                pass

        async with Fleet(targets, key, deadline_s=max(10.0, self.opts.poll_s * 5), on_event=self.emit) as fleet:
            follower = asyncio.create_task(stream(fleet))
            unreachable = 0
            ended = False  # the job exited on every worker: its logs end, so they are read to the end
            failed_worker: int | None = None  # its log ends too, and its last lines are the failure's hint
            try:
                while True:
                    if self.cancel.is_set() or self.emit.failure is not None:
                        return Verdict.STOPPED, None
                    if lost := await self._node_not_ready():
                        return lost, None
                    states = await launching.poll(fleet, rec.run)
                    failed = [s for s in states if s.done and s.exit_code != 0]
                    workers_lost = any(s.state in ("lost", "absent") for s in states)
                    # The node may have gone into maintenance or been preempted since it was read: then the
                    # workers' end is the node's, not the job's.
                    if (failed or workers_lost) and (lost := await self._node_not_ready()):
                        return lost, None
                    if failed:
                        failed_worker = failed[0].index
                        return Verdict.JOB_FAILED, failed[0]
                    if all(s.done for s in states):
                        ended = True
                        return Verdict.SUCCEEDED, None
                    if workers_lost:
                        # Every worker answers on a READY node, but the job's processes are gone: the node was
                        # restarted under it (host maintenance reboots the VMs, and can be over before a poll
                        # sees it). The same node takes the job again; recreating it would throw it away. Unless
                        # a worker refuses a new connection: the poll ran over one still open while the worker
                        # died (its processes killed before its SSH server stopped), and a dead worker is lost.
                        if not await self._workers_accept_ssh(fleet):
                            return Verdict.LOST, None
                        self.emit(ev.Warn(f"the job's processes on TPU node {rec.node} are gone: it restarted"))
                        return Verdict.MAINTENANCE, None
                    unreachable = unreachable + 1 if any(s.state == "unreachable" for s in states) else 0
                    if unreachable >= UNREACHABLE_POLLS:
                        return Verdict.LOST, None
                    # Marks the streams made (first step, checkpoints), for `job status` while it trains.
                    await asyncio.to_thread(self._save_timeline)
                    # The log streams end when every job process exited: poll at once then, not a tick later.
                    await asyncio.wait([follower], timeout=self.opts.poll_s)
            finally:
                # Let the streams print what the workers wrote last (briefly where a worker may still be writing
                # or gone), then stop them.
                try:
                    await asyncio.wait_for(asyncio.shield(follower), timeout=LOG_DRAIN_S if ended else 0.5)
                except (asyncio.TimeoutError, Exception):
                    follower.cancel()
                if failed_worker is not None:  # the rest of its log, from where its stream stopped
                    try:
                        await asyncio.wait_for(logs.follow(fleet, rec.run, self.stream, follow=False,
                                                           workers=[failed_worker], cursor=self.cursor), LOG_DRAIN_S)
                    except (asyncio.TimeoutError, TpuctlError):
                        pass  # the hint then names the log in the bucket, which the agent copies there

    @staticmethod
    async def _workers_accept_ssh(fleet: Fleet) -> bool:
        """Whether every worker accepts a new SSH connection within the fleet's deadline."""
        try:
            await asyncio.gather(*(fleet.connection(t.index, fresh=True) for t in fleet.targets))
        except WaitTimeout:
            return False
        return True

    async def _node_not_ready(self) -> Verdict | None:
        """MAINTENANCE (Google is repairing the node) or LOST (gone, preempted, ...) unless the node is READY."""
        rec = self.record
        node = await asyncio.to_thread(cluster.node_state, self.clients, rec.zone, rec.node)
        if node is not None and node.state is State.READY:
            return None
        self.emit(ev.Warn(f"TPU node {rec.node} is {'gone' if node is None else node.state.value}"))
        return Verdict.MAINTENANCE if node is not None and node.state is State.REPAIRING else Verdict.LOST

    def watch(self) -> Verdict:
        """Watch the launched job once: SUCCEEDED (DELETE_BUCKET), or LOST/MAINTENANCE for a recovery. A job that
        failed on a worker raises JobFailed once the others are stopped; a cancelled run raises Interrupted."""
        rec = self.record
        with self.phase("train"):
            try:
                key, targets = cluster.authorize(self.clients, rec.zone, rec.node)
            except CapacityError as exc:  # preempted (or stopped) before our key could be added
                self.emit(ev.Warn(exc.message))
                verdict, failed = Verdict.LOST, None
            else:
                verdict, failed = asyncio.run(self._watch(targets, key))
        if self.stream.last_step_at is not None:
            self.timeline.mark("last_step", at=self.stream.last_step_at, step=self.outcome.step)
        if verdict is Verdict.SUCCEEDED:
            self.outcome.state = "succeeded"
            return Verdict.DELETE_BUCKET if self.opts.delete_bucket else Verdict.SUCCEEDED
        self._check_cancel()
        if verdict is Verdict.JOB_FAILED:
            self._fail(targets, key, failed)
        return verdict

    def _fail(self, targets, key, failed: launching.WorkerState) -> None:
        rec = self.record
        with self.phase("stop workers"):
            async def stop():
                async with Fleet(targets, key, deadline_s=30, on_event=self.emit) as fleet:
                    await launching.cancel(fleet, rec.run)
            try:
                asyncio.run(stop())
            except TpuctlError as exc:
                self.emit(ev.Warn(f"could not stop every worker: {exc}"))
        self.outcome.failing_worker = failed.index
        self.outcome.tail = list(self.stream.tails.get(failed.index, []))
        cluster.close_status(self.clients, rec.bucket, rec.run, state="failed", exit_code=failed.exit_code,
                             on_event=self.emit)
        lines = "\n".join(f"  [w{failed.index}] {line}" for line in self.outcome.tail[-10:])
        raise JobFailed(f"the job failed on worker {failed.index} with exit code {failed.exit_code}",
                        hint=f"last lines of worker {failed.index}:\n{lines}\n  full logs: "
                             f"gs://{rec.bucket}/runs/{rec.run}/logs/worker-{failed.index}.log")

    def _run_ended(self) -> RunDurationEnded:
        """Google ended a flex-start TPU at the max run duration the user chose. That bound is the user's
        budget, and a new request would wait in the flex-start queue again with no end in sight: stop, say
        where the checkpoint is and how to resume, and exit with the code that says "time ran out"."""
        run, bucket = self.run_name, self.outcome.bucket
        ledger.remember([self._tpu], deleted=True, on_event=self.emit)  # Google deleted it: it bills no more
        if self.record is not None:
            # A final state gc and `job status` know ("failed": the job did not finish), and why.
            cluster.close_status(self.clients, self.record.bucket, self.record.run, state="failed",
                                 ended="max_run_duration", on_event=self.emit)
        return RunDurationEnded(
            f"the flex-start TPU {self.node} reached its max run duration ({self._max_run_duration()}) at "
            f"{self._tpu.detail['ends']} and Google ended it before the job finished (step "
            f"{self.outcome.step or 0}); it was not requested again",
            hint=f"checkpoints are kept in gs://{bucket}/runs/{run}/model/: `tpuctl run SPEC --name {run}` resumes "
                 "from them on a new flex-start TPU (or raise max_run_duration, up to 7d)")

    def _max_run_duration(self) -> str:
        """As the user wrote it; from the plan when attached (a supervisor has no spec)."""
        from tpuctl.spec import format_duration

        if self.spec is not None:
            return self.spec.max_run_duration
        return format_duration(self.plan.max_run_duration_s) if self.plan and self.plan.max_run_duration_s else "?"

    def _recover(self, *, maintenance: bool = False) -> None:
        """Bring the node back and relaunch (the job resumes from its checkpoint). How is the TPU's shape driver's
        call (provision.recovery_action): a node under maintenance (REPAIRING/RESTARTING) is waited for, not
        recreated (it is the same node after a reboot); one that Google ended at its max run duration is not
        requested again."""
        rec = self.record
        action = provision.recovery_action(self.clients, rec.zone, rec.node, last=self._tpu)
        # The workers can drop in the moment between the watch reading the node READY and the node showing its
        # maintenance: a node the driver says to wait for is under maintenance, whatever the watch concluded.
        maintenance = maintenance or isinstance(action, provision.Wait)
        if isinstance(action, provision.Ended):
            self._tpu = action.tpu
            raise self._run_ended()
        expires = (self.plan.labels if self.plan is not None else {}).get(labels.EXPIRES)
        if expires and time.time() >= float(expires):
            # Past its TTL gc deletes the run's TPU anyway: a new one would bill for nothing.
            raise JobFailed(f"the TPU node was lost after run {rec.run}'s TTL ended; it is not made again",
                            hint=f"checkpoints are kept in gs://{rec.bucket}/runs/{rec.run}/model/: `tpuctl run SPEC "
                                 f"--name {rec.run} --ttl DURATION` resumes from them")
        if self.outcome.recoveries >= rec.max_recoveries:
            raise JobFailed(f"the TPU node was lost {self.outcome.recoveries + 1} time(s); max recoveries is "
                            f"{rec.max_recoveries}", hint="raise --max-recoveries, or use on-demand provisioning")
        self.outcome.recoveries += 1
        attempt = self.outcome.recoveries
        self.emit(ev.RecoveryStarted(attempt, rec.max_recoveries, "maintenance" if maintenance else "node lost"))
        ok = False
        try:
            self._bring_back(action, maintenance=maintenance)
            ok = True
        finally:
            self.emit(ev.RecoveryEnded(attempt, ok))

    def _bring_back(self, action: provision.RecoveryAction, *, maintenance: bool) -> None:
        """Carry out `action` through provision.recover (wait, recreate or requeue in the node's zone); what that
        cannot do (the driver's RebuildFromPlan, or no capacity left in the zone) deletes what is left and runs
        `up` again, whose failover tries the plan's zones."""
        rec = self.record
        cluster.update_status(self.clients, rec.bucket, rec.run, state="running", recovering=True, on_event=self.emit)
        with self.phase("recover", f"attempt {self.outcome.recoveries} of {rec.max_recoveries}"):
            # A lost node bills no more; its successor (same name) is a new ledger entry.
            lost = [r for r in provision.list_resources(self.clients, rec.run)
                    if r.kind is Kind.TPU and r.name == rec.node]
            if not lost and self._tpu is not None:
                lost = [self._tpu]  # Google deleted it (a Spot VM's termination action DELETE)
            if maintenance:
                self.emit(ev.Warn(f"TPU node {rec.node} is under maintenance: waiting for it to come back"))
            else:
                ledger.remember(lost, deleted=True, on_event=self.emit)
            try:
                node = provision.recover(self.clients, action, force=not maintenance)
            except CapacityError as exc:
                node = provision.RebuildFromPlan(None, f"recreating {rec.node} in {rec.zone} failed ({exc})")
            if isinstance(node, provision.RebuildFromPlan):
                if self.plan is None:
                    raise JobFailed(f"cannot recreate TPU node {rec.node}: {node.why}",
                                    hint=f"run `tpuctl run SPEC --name {rec.run}` again to resume from the checkpoint")
                self.emit(ev.Warn(f"{node.why}; trying the plan's zones"))
                provision.delete_node(self.clients, rec.zone, rec.node)
                self.up()
            else:
                if maintenance and any(r.created != node.created for r in lost):
                    ledger.remember(lost, deleted=True, on_event=self.emit)  # it never came back and was recreated
                ledger.remember([node], on_event=self.emit)
                self._tpu = node
                self.zone, self.node = node.location, node.name
            self.record = rec = cluster.LaunchRecord(**{**rec.__dict__, "zone": self.zone, "node": self.node})
        self.launch(recovering=True)

    # -- results and teardown
    def collect(self) -> None:
        rec = self.record
        with self.phase("collect"):
            prefix = f"runs/{rec.run}/model/"
            for fmt in self.opts.export:  # from the bucket's checkpoint, like `tpuctl export`: the TPU may be gone
                from . import export as exporting

                with tempfile.TemporaryDirectory(prefix="tpuctl-export-") as local:
                    exporting.export(self.clients, rec.run, fmt, Path(local), bucket=rec.bucket)
                    exporting.upload(self.clients, Path(local), f"gs://{rec.bucket}/{prefix}{fmt}")
            blobs = list(self.clients.storage.list_blobs(rec.bucket, prefix=prefix))
            self.outcome.artifacts = sorted(b.name[len(prefix):] for b in blobs)
            if self.opts.download:
                dest = Path(self.opts.download)
                for b in blobs:
                    target = dest / b.name[len(prefix):]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    b.download_to_filename(str(target))
                self.outcome.downloaded = str(dest)

    def teardown(self) -> None:
        run = self.run_name
        self.billing.torn_down = True  # once: whatever happens in it, it is not tried again
        if not run:
            return
        with self.phase("tear down", cancellable=False), _shielded(self.emit):
            self.billing.delete_requested_at = time.time()
            if self.stream.last_step_at is not None:
                self.outcome.last_step_to_delete_s = round(self.billing.delete_requested_at - self.stream.last_step_at, 2)
            delete_bucket = self.opts.delete_bucket or self.bucket_use.disposable
            gone = provision.down(self.clients, run, delete_bucket=delete_bucket, progress=ev.resource_progress(self.emit),
                                  spare=self.opts.spare)
            self.bucket_use.present = self.bucket_use.present and not delete_bucket
            ledger.remember(gone.deleted, deleted=True, on_event=self.emit)
        if self.billing.up_started is not None:
            self.outcome.cost_usd = round(self._cost_since(self.billing.up_started), 4)
            self.emit(ev.CostAccrued(self.outcome.cost_usd, self.outcome.price_per_hour or 0.0, final=True))

    def _cost_since(self, since: float) -> float:
        """What this invocation's resources cost: each one's own price over its own lifetime, recreated
        nodes included, from the ledger that up, recovery and teardown keep."""
        try:
            entries = [e for e in ledger.Ledger().entries() if e.run == self.run_name and e.project == self.project]
        except OSError:
            entries = []
        return cost.accrued_by_run(entries, catalog.load(), now=time.time(), since=since).get(self.run_name, 0.0)

    # -- the states' work, and the loop that follows TRANSITIONS
    def _validated(self) -> Verdict:
        self.validate()
        if self.opts.dry_run:
            return Verdict.DRY_RUN
        if not self.opts.yes and not (self.confirm is not None and self.confirm(self.plan)):
            raise BadInput(f"run {self.plan.run} was not confirmed; nothing was created", field="confirm")
        return Verdict.OK

    def _attached(self) -> Verdict:
        with self.phase("attach"):
            try:
                where = cluster.locate(self.clients, self.run_name)
            except NotFound:
                if self.plan is None:
                    raise
                # No TPU: Google deleted it (a preempted Spot VM, an ended queued resource) while nobody watched.
                # The plan makes it again, as a recovery; the launch record says what ran where. A queued resource
                # left behind says what the TPU was (a flex-start's end: then it is not requested again).
                where = None
                self._tpu = next((r for r in provision.list_resources(self.clients, self.run_name)
                                  if r.kind is Kind.QUEUED), None)
            bucket = where.bucket if where is not None else self.plan.bucket
            if bucket is None:
                raise NotFound(f"run {self.run_name} has no bucket", field="run")
            self.record = cluster.load_launch(self.clients, bucket, self.run_name)
            if where is not None:
                self.record = cluster.LaunchRecord(**{**self.record.__dict__, "zone": where.zone, "node": where.node})
            self.zone, self.node = self.record.zone, self.record.node
            self.outcome.bucket = bucket
            self.billing.up_started = self.record.launched
            self.bucket_use.present = True
            # The timeline goes on where the detached run left it (its laptop saw no steps since), and so does
            # the count of recoveries that max_recoveries bounds.
            self.timeline = timelines.load(self.clients, bucket, self.run_name) or self.timeline
            self.outcome.recoveries = sum(m.what == "recover" for m in self.timeline.marks)
        self.timeline.mark("attach", at=time.time())
        return Verdict.OK if where is not None else Verdict.LOST

    def _prepared(self) -> None:
        self.bucket_use.data_url = self.prepare_data()

    def _launched(self) -> Verdict:
        self.launch()
        if self._supervised:
            self._hand_over()
        if self.opts.detach:
            self.outcome.state = "detached"
            return Verdict.DETACHED
        return Verdict.OK

    def _recovered(self, came_by: Verdict) -> Verdict:
        self._recover(maintenance=came_by is Verdict.MAINTENANCE)
        return Verdict.OK

    def _collected(self) -> Verdict:
        self.collect()
        return Verdict.OK if self.billing.torn_down else Verdict.HELD

    def _torn_down(self, failure: BaseException | None) -> Verdict:
        self.teardown()
        if failure is not None:
            return Verdict.FAILED
        if self.opts.delete_bucket:
            return Verdict.OK  # collected before; the bucket and its status record are gone
        cluster.close_status(self.clients, self.record.bucket, self.record.run, state="succeeded", exit_code=0,
                             step=self.outcome.step, on_event=self.emit)
        return Verdict.SUCCEEDED

    def _work(self, failure: BaseException | None) -> dict[RunState, Callable[[Verdict], Verdict]]:
        """Each state's work, given the verdict that led to it."""
        return {S.VALIDATE: lambda _: self._validated(), S.ATTACH: lambda _: self._attached(),
                S.UP: _leads_on(self.up), S.PREPARE: _leads_on(self._prepared),
                S.SHIP: _leads_on(lambda: self.ship(self.bucket_use.data_url)), S.LAUNCH: lambda _: self._launched(),
                S.WATCH: lambda _: self.watch(), S.RECOVER: self._recovered,
                S.COLLECT: lambda _: self._collected(), S.TEARDOWN: lambda _: self._torn_down(failure)}

    def _enter(self, state: RunState, came_by: Verdict) -> None:
        """Mark the state on the timeline (a detached run's end is not the run's) and save it while the bucket
        exists."""
        self.state = state
        what = "detached" if came_by is Verdict.DETACHED else state.value
        self.timeline.mark(what, at=time.time(), detail=came_by.value)
        self._save_timeline()

    def _save_timeline(self) -> None:
        if self.bucket_use.present:
            self.timeline.save(self.clients, self.outcome.bucket, self.run_name, on_event=self.emit)

    def _observe(self, event: ev.Event) -> None:
        """The log streams' events, on their way to the caller: worker 0's first step of each launch and its
        checkpoint saves and restores go on the timeline."""
        if isinstance(event, ev.Metrics) and event.worker == 0:
            self.timeline.first_step(event.step, at=event.at)
        elif isinstance(event, ev.WorkerLog) and event.worker == 0 and (m := timelines.SAVE_LINE.match(event.line)):
            self.timeline.mark(m.group(1), at=event.at, step=int(m.group(2)))
        self.emit(event)

    # -- entry points
    def run(self) -> Outcome:
        """Follow TRANSITIONS from VALIDATE (from ATTACH with `options.attach`) to DONE, or to FAILED: then it
        raises what failed, once the run is torn down."""
        failure: BaseException | None = None
        came_by = Verdict.OK
        try:
            while self.state not in (RunState.DONE, RunState.FAILED):
                state = self.state
                try:
                    came_by = self._work(failure)[state](came_by)
                    self._enter(TRANSITIONS[state, came_by], came_by)
                except BaseException as exc:
                    if state in NOTHING_UP:
                        raise
                    if failure is not None:  # tearing down after a failure failed too
                        raise exc from failure
                    failure = self._failed(exc)
                    came_by = Verdict.FAILED
                    self._enter(RunState.FAILED if self.billing.torn_down else RunState.TEARDOWN, came_by)
        finally:
            if not self.billing.torn_down and self.state not in (*NOTHING_UP, RunState.DONE):
                self.teardown()  # a second Ctrl-C while the first was being recorded: TEARDOWN was not reached
        if failure is not None:
            raise failure
        return self.outcome

    attach = run  # `--attach RUN`: the same loop, from ATTACH

    def _failed(self, exc: BaseException) -> BaseException:
        """Record how the run failed; return what to raise once it is torn down."""
        if isinstance(exc, KeyboardInterrupt) or self.cancel.is_set():
            self.outcome.state = "interrupted"
            if self.record is not None:
                cluster.close_status(self.clients, self.record.bucket, self.record.run, state="failed",
                                     interrupted=True, on_event=self.emit)
            return exc
        self.outcome.state = "failed"
        if not isinstance(exc, Exception):  # SystemExit and the like: not a failure of the run to report
            return exc
        # Any exception is reported as one of ours (one line, exit 1).
        error = Unexpected.of(exc)
        if not isinstance(error, RunDurationEnded) and self._tpu is not None and provision.run_ended(self._tpu):
            # Whatever broke when the TPU went (a launch, an SSH session), its end is the reason.
            error = self._run_ended()
        self.outcome.error = str(error)
        if error is not exc:
            error.__cause__ = exc
        return error
