"""tpuctl from Python: `up`, `run`, `down`, `status`, `gc`, `fit` (re-exported as `tpuctl.up`, `tpuctl.run`, ...).

Each function resolves its spec and its target exactly as the CLI does (TPUCTL_* env > spec > user config >
gcloud config > defaults; the embedded local cloud when no Google project is named, `cloud`
forces either), reports through `on_event` (tpuctl.events; nothing is printed) and raises the `TpuctlError`
hierarchy (tpuctl.errors). Calling a function that creates or deletes is the consent: pass `confirm` to
decide after seeing the plan.

The Google client libraries load on first use (seconds), not on `import tpuctl`.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, Union

from tpuctl import config, ledger
from tpuctl import spec as spec_mod
from tpuctl.errors import BadInput, Interrupted, NotFound, TpuctlError
from tpuctl.events import EventSink, Warn, ignore, resource_progress

if TYPE_CHECKING:
    from tpuctl.fitting import Fit
    from tpuctl.jobs.pipeline import Outcome
    from tpuctl.provision import ApplyResult, Clients, DownResult, Plan, RunStatus
    from tpuctl.provision.gc import Action, GcResult

T = TypeVar("T")
SpecLike = Union[str, "os.PathLike[str]", Mapping[str, Any], spec_mod.RunSpec]


@dataclass(frozen=True)
class Run:
    """A run whose resources are up (what `up` returns; `down` and `status` take it or its name)."""

    name: str
    project: str
    target: str  # "local" or "gcp"
    zone: str
    bucket: str
    workers: tuple[str, ...]  # host:port of each TPU worker's SSH
    created: tuple[str, ...]  # keys (KIND/LOCATION/NAME) this call created
    adopted: tuple[str, ...]  # keys that existed already (up is idempotent)


@dataclass(frozen=True)
class Resolved:
    spec: spec_mod.RunSpec
    settings: config.Settings
    spec_dir: Path  # where relative paths in the spec are looked up: its file's directory, else the cwd


def resolve(spec: SpecLike, *, cloud: str | None = None, on_event: EventSink = ignore) -> Resolved:
    """The spec (a YAML path, a mapping or a RunSpec) merged with env and config as the CLI merges it, and
    the target. Blocks only to start the embedded local cloud when it is the target and not running."""
    if isinstance(spec, spec_mod.RunSpec):
        run_spec, sources, spec_dir = spec, {}, Path.cwd()
    else:
        is_path = isinstance(spec, (str, os.PathLike))
        raw = spec_mod.read_file(spec) if is_path else dict(spec)
        merged, sources = config.layered({}, raw)
        run_spec = spec_mod.from_mapping(merged, on_event=on_event)
        spec_dir = Path(spec).resolve().parent if is_path else Path.cwd()
    settings = config.settings(project=run_spec.project, cloud=cloud, sources=sources, on_event=on_event)
    return Resolved(run_spec, settings, spec_dir)


def connect(project: str | None = None, cloud: str | None = None, *, on_event: EventSink = ignore) -> Clients:
    """Clients for the target the CLI would pick with `--project`/`--cloud`."""
    from tpuctl import provision

    return provision.connect(config.settings(project=project, cloud=cloud, on_event=on_event))


def apply_plan(clients: Clients, plan: Plan, *, on_event: EventSink = ignore, keep_on_failure: bool = False,
               cancel: threading.Event | None = None) -> ApplyResult:
    """Create what `plan` needs and record it in the cost ledger. Blocks until every resource is READY;
    idempotent (adopts what exists); on failure or `cancel` removes what it created (see provision.apply).
    A Ctrl-C once all is READY rolls nothing back: it raises `kept_after_ready(plan.run)`."""
    from tpuctl import provision

    result = provision.apply(clients, plan, progress=resource_progress(on_event), keep_on_failure=keep_on_failure,
                             cancel=cancel, on_gone=lambda entries: ledger.remember_gone(entries, on_event=on_event))
    try:
        ledger.remember(result.resources, on_event=on_event)
    except KeyboardInterrupt:
        raise kept_after_ready(plan.run) from None
    if (kept := ttl_kept(plan, result)) is not None:
        on_event(Warn(kept))
    return result


def ttl_kept(plan: Plan, result: ApplyResult) -> str | None:
    """What to warn of when a resource `result` adopted was made with another TTL than `plan`'s: adopting changes
    no label, so gc deletes the run by the expiry it was made with, not by the TTL the plan quoted. None when
    the TTLs agree (or none is set)."""
    from tpuctl.provision import labels

    def ttl(marks) -> int | None:
        return (int(marks[labels.EXPIRES]) - int(marks[labels.CREATED])
                if labels.EXPIRES in marks and labels.CREATED in marks else None)

    planned = ttl(plan.labels)
    kept = sorted((int(r.labels[labels.EXPIRES]) for r in result.resources
                   if r.key in result.adopted and ttl(r.labels) not in (None, planned)))
    if planned is None or not kept:
        return None
    left = kept[0] - time.time()
    when = (f"in {spec_mod.format_duration(max(60, round(left / 60) * 60))}" if left > 0 else
            "at its next pass (its expiry has passed)")
    return (f"run {plan.run} keeps the expiry it was made with: gc deletes it {when}, not in "
            f"{spec_mod.format_duration(planned)} as this plan's TTL says (adopting changes no label; "
            f"`tpuctl down {plan.run}` and `up` again to change it)")


def kept_after_ready(run: str) -> Interrupted:
    """The interrupt of an `up` whose resources were all READY: nothing was rolled back, and the error must
    not pretend it was."""
    return Interrupted(f"interrupted after run {run} was ready: its resources are kept",
                       hint=f"remove them with `tpuctl down {run}`")


def delete_run(clients: Clients, run: str, *, delete_bucket: bool = False,
               on_event: EventSink = ignore) -> DownResult:
    """Delete a run's resources (its bucket too with `delete_bucket`), verify none remain, record it in the
    cost ledger, and end its timeline if nothing did (`tpuctl.jobs.timeline.close`). Blocks until done;
    idempotent (nothing left is not an error)."""
    from tpuctl import provision
    from tpuctl.jobs import timeline
    from tpuctl.provision.gc import COMPUTE_KINDS

    started = time.time()
    result = provision.down(clients, run, delete_bucket=delete_bucket, progress=resource_progress(on_event))
    ledger.remember(result.deleted, deleted=True, on_event=on_event)
    bucket = next((r.name for r in result.kept if r.kind is provision.Kind.BUCKET), None)  # deleted: no timeline
    if bucket is not None and any(r.kind in COMPUTE_KINDS for r in result.deleted):
        timeline.close(clients, bucket, run, by="down", started=started, ended=time.time(), on_event=on_event)
    return result


def close_timelines(clients: Clients, result: GcResult, *, on_event: EventSink = ignore) -> None:
    """After a gc pass (`gc`, `tpuctl gc`): end the timeline of each run whose compute it deleted, if nothing did
    (`tpuctl.jobs.timeline.close`), over the time its deletions took, saying why gc deleted it. A run with compute
    gc failed to delete has not ended."""
    from tpuctl import provision
    from tpuctl.jobs import timeline
    from tpuctl.provision.gc import COMPUTE_KINDS

    tried = [o for o in result.outcomes if o.started is not None and o.action.resource.kind in COMPUTE_KINDS]
    failed = {o.action.run for o in tried if not o.ok}
    spans: dict[str, tuple[float, float, tuple[str, ...]]] = {}
    for o in tried:
        if o.action.run not in failed:
            t0, t1, _ = spans.get(o.action.run, (o.started, o.started, ()))
            spans[o.action.run] = (min(t0, o.started), max(t1, o.started + o.seconds), o.action.reasons)
    if not spans:
        return
    try:
        buckets = {r.run: r.name for r in provision.list_resources(clients) if r.kind is provision.Kind.BUCKET}
    except TpuctlError as exc:  # best effort: the deletions stand
        on_event(Warn(f"could not find the buckets of the runs gc ended, to end their timelines: {exc}"))
        return
    for run, (started, ended, reasons) in sorted(spans.items()):
        if run in buckets:
            timeline.close(clients, buckets[run], run, by=f"gc: {', '.join(reasons)}", started=started, ended=ended,
                           on_event=on_event)


def cost_entries(clients: Clients, *, now: float, on_event: EventSink = ignore) -> list[ledger.Entry]:
    """What `tpuctl cost` reports on: a fresh scan merged into the cost ledger (`tpuctl.provision.gc.cost_entries`),
    every entry of the project, live and gone.

    A resource the scan found gone went while nobody here watched (a detached run's supervisor tore it down while
    this machine slept): the ledger closes it at the scan, the latest it can have gone. Its run's timeline, when it
    ended, says when it went (`tpuctl.jobs.timeline.gone_by`); that time is written back to the ledger, once. A run
    whose bucket is gone has no timeline left: its entries keep the scan's time."""
    from tpuctl.jobs import timeline
    from tpuctl.provision import gc

    book = ledger.Ledger()
    entries = gc.cost_entries(clients, now=now, ledger=book)
    buckets = {e.run: e.name for e in entries if e.kind == "bucket" and e.deleted is None}
    records: dict[str, timeline.Timeline | None] = {}
    for run in sorted({e.run for e in entries if e.closed_by_scan and e.run in buckets}):
        try:
            records[run] = timeline.load(clients, buckets[run], run)
        except (TpuctlError, ValueError, TypeError) as exc:  # asked again next time
            on_event(Warn(f"could not read gs://{buckets[run]}/{timeline.name(run)}: {exc}"))

    def deleted_at(e: ledger.Entry) -> float | None:
        if e.project != clients.project or e.run not in records:
            return None
        found = records[e.run]
        return e.deleted if found is None else timeline.gone_by(found.marks, e.kind)  # no timeline: nothing better

    if records:
        book.settle(deleted_at)
        entries = [e for e in book.entries() if e.project == clients.project]
    return entries


def check_owner(run: str, found) -> None:
    """BadInput (field run) when any of `found`, the run's resources, carries another owner's label than this
    caller's (provision.labels.owner): two owners may pick one run name, and one's `down` must not delete the
    other's run (gc keeps them apart the same way); that owner, or TPUCTL_OWNER set to them, deletes it."""
    from tpuctl.provision import labels

    mine = labels.owner()
    others = sorted({r.labels.get(labels.OWNER) for r in found} - {mine, None, ""})
    if others:
        raise BadInput(f"run {run} belongs to owner {', '.join(others)}, not {mine}: nothing was deleted",
                       field="run", hint=f"act as its owner: TPUCTL_OWNER={others[0]} tpuctl down {run}")


def unknown_run(clients: Clients, run: str) -> NotFound | None:
    """Whether a run that no resource carries the label of is a mistake: None when this machine's cost ledger
    remembers a resource of it in the project (it was deleted; a second `down` is done, not an error), else
    the NotFound to raise (exit 2), naming the closest run that exists. The ledger decides only this, never
    what to delete."""
    import difflib

    from tpuctl import provision

    try:
        if any(e.run == run and e.project == clients.project for e in ledger.Ledger().entries()):
            return None
    except OSError:
        pass  # an unreadable ledger remembers nothing
    runs = sorted({r.run for r in provision.list_resources(clients) if r.run})
    close = difflib.get_close_matches(run, runs, n=1, cutoff=0.5)
    return NotFound(f"no resource carries the label tpuctl-run={run} in project {clients.project}, and no run of "
                    "that name was made from here", field="run",
                    hint=f"did you mean {close[0]} (`tpuctl down {close[0]}`)?" if close else
                    "`tpuctl list` shows the runs that exist")


def up(spec: SpecLike, *, on_event: EventSink | None = None, cloud: str | None = None,
       confirm: Callable[[Plan], bool] | None = None, keep_on_failure: bool = False, fit_check: bool = True) -> Run:
    """Create the spec's TPU, VMs, bucket and bucket IAM; blocks until all are READY. Idempotent.

    `confirm(plan)` returning False stops before anything is created (BadInput); so does a job whose step
    does not fit the TPU's HBM (`fit_check`, see `fit`)."""
    from tpuctl import fitting, provision

    sink = on_event or ignore
    r = resolve(spec, cloud=cloud, on_event=sink)
    plan = provision.plan(r.spec, project=r.settings.project)
    fitted = fitting.check(r.spec, spec_dir=r.spec_dir, on_event=sink) if fit_check and r.spec.job else None
    if fitted is not None:
        sink(fitting.note(fitted))
    if confirm is not None and not confirm(plan):
        raise BadInput(f"run {plan.run} was not confirmed; nothing was created", field="confirm")
    result = apply_plan(provision.connect(r.settings), plan, on_event=sink, keep_on_failure=keep_on_failure)
    tpu = result.get(provision.Kind.TPU)
    return Run(name=plan.run, project=r.settings.project, target=r.settings.target, zone=result.zone,
               bucket=plan.bucket, workers=tuple(f"{w.ip}:{w.port}" for w in tpu.workers) if tpu else (),
               created=result.created, adopted=result.adopted)


def run(spec: SpecLike, *, on_event: EventSink | None = None, cancel: threading.Event | None = None,
        confirm: Callable[[Plan], bool] | None = None, cloud: str | None = None,
        download: str | os.PathLike[str] | None = None, delete_bucket: bool = False,
        max_recoveries: int | None = None, poll_s: float = 2.0, fit_check: bool = True,
        profile: str | None = None, detach: bool = False) -> Outcome:
    """Train the spec's job end to end (up, data, ship, train, collect) and tear the TPU and VMs down,
    whatever happens. Blocks until the end; returns the Outcome (`state` "succeeded").

    Setting `cancel` (from another thread) stops the run at its next check (within `poll_s` while training),
    tears down, and raises Interrupted. A failed job raises JobFailed; the Outcome so far is on the
    exception's `outcome` attribute in both cases. `confirm(plan)` returning False stops before anything is
    created (BadInput); so does a job whose step does not fit the TPU's HBM (`fit_check`, see `fit`).
    `profile` ("FIRST-LAST", as `job.profile`, which it replaces): a profiler trace of those steps on worker 0
    in the run's TensorBoard directory (`tpuctl board RUN`, profile tab). `detach`: hand the run to a supervisor
    VM (created with the TPU) and return once it took over (`state` "detached"); it watches, recovers, collects
    and tears down without this process (README "Runs that last days")."""
    from tpuctl import provision
    from tpuctl.jobs.pipeline import Pipeline, RunOptions

    r = resolve(spec, cloud=cloud, on_event=on_event or ignore)
    run_spec = spec_mod.with_profile(r.spec, profile)
    cancel = cancel or threading.Event()
    options = RunOptions(yes=confirm is None, download=Path(download) if download else None,
                         delete_bucket=delete_bucket, max_recoveries=max_recoveries, poll_s=poll_s, cancel=cancel,
                         fit_check=fit_check, detach=detach)
    pipeline = Pipeline(provision.connect(r.settings), run_spec, project=r.settings.project, spec_dir=r.spec_dir,
                        options=options, on_event=on_event, confirm=confirm)
    try:
        return _outside_event_loop(pipeline.run, cancel)
    except TpuctlError as exc:
        exc.outcome = pipeline.outcome  # type: ignore[attr-defined]  # the phases, steps and cost so far
        raise


def fit(spec: SpecLike, *, accelerator: str | None = None, zone: str | None = None, spot: bool | None = None,
        on_event: EventSink | None = None, max_compiles: int | None = None, spec_dir: Path | None = None) -> Fit | None:
    """Whether the spec's job fits its TPU (or `accelerator`), with the per-chip HBM, FLOPs and bytes, the
    largest per-chip batch that fits, and estimated step time, MFU, run time and cost (`zone`, `spot`: where
    and how it is priced). Compiles the template's training step with the TPU compiler when it is installed
    (`pip install 'tpuctl[tpu]'`; minutes for gpt2-small, cached under TPUCTL_HOME), else an analytic estimate
    (`method` says which); None for a template with neither. Creates nothing and starts no cloud. Raises BadInput.
    `spec_dir`: where a RunSpec's relative paths start (default: the working directory)."""
    from tpuctl import fitting as fit_mod

    flags = {"accelerator": accelerator, "zone": zone, "provisioning": "spot" if spot else None}
    if isinstance(spec, spec_mod.RunSpec):
        given = {k: v for k, v in flags.items() if v is not None}
        run_spec = spec.model_copy(update={**given, **({"zones": tuple(zone.split(","))} if zone else {})})
        spec_dir = spec_dir or Path.cwd()
    else:
        is_path = isinstance(spec, (str, os.PathLike))
        merged, _ = config.layered(flags, spec_mod.read_file(spec) if is_path else dict(spec))
        run_spec = spec_mod.from_mapping(merged, on_event=on_event or ignore)
        spec_dir = Path(spec).resolve().parent if is_path else Path.cwd()
    return fit_mod.fit(run_spec, spec_dir=spec_dir, on_event=on_event or ignore,
                       max_compiles=fit_mod.MAX_COMPILES if max_compiles is None else max_compiles)


def _outside_event_loop(fn: Callable[[], T], cancel: threading.Event) -> T:
    """`fn()`, in a thread of its own when this one runs an event loop: Jupyter's kernel does, and the run's
    SSH fleet needs an `asyncio.run` of its own, which cannot nest. Ctrl-C (interrupt the kernel) then sets
    `cancel`, and the run tears down before the interrupt is raised."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return fn()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tpuctl-run") as pool:
        future = pool.submit(fn)
        try:
            return future.result()
        except KeyboardInterrupt:
            cancel.set()
            return future.result()


def _run_name(run: Run | str) -> str:
    return run.name if isinstance(run, Run) else run


def _clients_for(run: Run | str | None, project: str | None, cloud: str | None, on_event: EventSink) -> Clients:
    """A Run knows its project and target; a name is looked up where `project`/`cloud` resolve to."""
    if isinstance(run, Run):
        return connect(run.project, run.target, on_event=on_event)
    return connect(project, cloud, on_event=on_event)


def down(run: Run | str, *, delete_bucket: bool = False, on_event: EventSink | None = None,
         project: str | None = None, cloud: str | None = None) -> DownResult:
    """Delete every resource of `run` (the bucket too with `delete_bucket`) and verify none remain. Blocks;
    idempotent: a run deleted before is done again. A Run carries its project and target; a name uses
    `project`/`cloud` or the resolved ones. A name no resource carries and this machine never made raises
    NotFound (see `unknown_run`): a mistyped name must not pass for a clean teardown."""
    from tpuctl.provision import labels

    name = _run_name(run)
    labels.check_name(name, field="run")
    sink = on_event or ignore
    clients = _clients_for(run, project, cloud, sink)
    from tpuctl import provision

    check_owner(name, provision.list_resources(clients, name, include_iam=True))
    result = delete_run(clients, name, delete_bucket=delete_bucket, on_event=sink)
    if not (result.deleted or result.kept) and (missing := unknown_run(clients, name)) is not None:
        raise missing
    return result


def status(run: Run | str | None = None, *, project: str | None = None,
           cloud: str | None = None) -> list[RunStatus]:
    """Every run's state (or one run's), with hourly price and cost so far; reads only."""
    from tpuctl import catalog, cost, provision

    prices = catalog.load()
    clients = _clients_for(run, project, cloud, ignore)
    return provision.status(clients, None if run is None else _run_name(run),
                            price=lambda r: cost.hourly(ledger.entry_of(r), prices))


def gc(*, dry_run: bool = False, idle_s: float | None = 3600.0, budget_usd: float | None = None,
       budget_per: str = "run", all_owners: bool = False, owner: str | None = None, buckets: bool = False,
       confirm: Callable[[list[Action]], bool] | None = None, project: str | None = None,
       cloud: str | None = None) -> GcResult:
    """One cleanup pass, as `tpuctl gc`: delete runs past their TTL, finished, idle for `idle_s`, preempted
    and abandoned, or over `budget_usd`; only this owner's unless `all_owners`. Blocks until the deletions end.
    `confirm(deletions)` returning False stops before anything is deleted (BadInput)."""
    from tpuctl import catalog, paths
    from tpuctl.provision import gc as gc_mod
    from tpuctl.provision import labels

    def ask(going: list[Action]) -> None:  # gc.run's contract: raise to stop
        if confirm is not None and not confirm(going):
            raise BadInput("gc was not confirmed; nothing was deleted", field="confirm")

    policy = gc_mod.Policy(now=time.time(), owner=labels.label_value(owner) if owner else labels.owner(),
                           all_owners=all_owners, idle_s=idle_s, budget_usd=budget_usd, budget_per=budget_per,
                           buckets=buckets)
    clients = connect(project, cloud)
    result = gc_mod.run(clients, policy, dry_run=dry_run, catalog=catalog.load(), ledger=ledger.Ledger(),
                        lock=paths.gc_lock(), confirm=ask)
    close_timelines(clients, result)
    return result


def board(runs: str | list[str], *, port: int | None = None, bucket: str | None = None, interval_s: float = 10.0,
          stop: threading.Event | None = None, on_event: EventSink | None = None, project: str | None = None,
          cloud: str | None = None) -> str:
    """TensorBoard on 127.0.0.1 over the runs' TensorBoard files (read from the bucket, or mirrored from it every
    `interval_s`), as `tpuctl board`. Blocks until `stop` is set; `on_event` gets `tpuctl.jobs.board.BoardReady`
    (url, logdir, source) once it serves. Returns the logdir (gs://... or a local path)."""
    from tpuctl.jobs import board as board_mod

    sink = on_event or ignore
    return board_mod.serve(connect(project, cloud, on_event=sink), [runs] if isinstance(runs, str) else list(runs),
                           port=port, bucket=bucket, interval_s=interval_s, stop=stop, on_event=sink)
