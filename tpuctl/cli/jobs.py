"""`tpuctl run` (the one-shot run), `tpuctl ssh`, `tpuctl logs`, `tpuctl job status|cancel`."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from pathlib import Path

import click

from tpuctl import config, console
from tpuctl import spec as spec_mod
from tpuctl.cli.spec_flags import SpecFlags, spec_options
from tpuctl.errors import BadInput, NotFound, TpuctlError

SECTION = "Run a training job"


def _cloud_options(f):
    f = click.option("--cloud", type=click.Choice(config.TARGETS), help="force the target (default: auto)")(f)
    f = click.option("--project", help="Google Cloud project [env TPUCTL_PROJECT]")(f)
    return f


def _clients(project: str | None, cloud: str | None):
    from tpuctl import provision

    return provision.connect(config.settings(project=project, cloud=cloud, on_event=console.report))


def _summary(o) -> None:
    d = o.as_dict()
    phases = ", ".join(f"{k} {v:.0f}s" for k, v in o.phases.items())
    console.info(f"run {o.run}: {o.state}" + (f" after {o.recoveries} recovery(ies)" if o.recoveries else ""))
    if phases:
        console.info(f"  phases: {phases}")
    if o.step is not None:
        console.info(f"  last step {o.step}" + (f", loss {o.loss:g}" if o.loss is not None else "")
                     + (f", {o.examples_per_sec:g} examples/s" if o.examples_per_sec is not None else ""))
    if o.cost_usd is not None:
        console.info(f"  cost: about ${o.cost_usd:.4f} (${o.price_per_hour:.2f}/h while up)")
    if o.last_step_to_delete_s is not None:
        console.info(f"  last step to TPU delete request: {o.last_step_to_delete_s:.1f}s")
    if d["model_url"]:
        console.info(f"  artifacts: {d['model_url']}/ ({len(o.artifacts)} files)"
                     + (f", copied to {o.downloaded}" if o.downloaded else ""))
        console.info(f"  TensorBoard: tpuctl board {o.run}")


@click.command("run")
@click.argument("spec_file", required=False, type=click.Path(exists=True, dir_okay=False))
@click.option("--name", help="run name (default: the spec's name, else OWNER-ACCELERATOR)")
@click.option("--yes", "-y", is_flag=True, help="create resources without asking")
@click.option("--detach", is_flag=True,
              help="hand the run to a small supervisor VM that watches, recovers and tears it down; return once it took over")
@click.option("--no-supervisor", "no_supervisor", is_flag=True,
              help="with --detach: no supervisor VM; return after launch (`tpuctl run --attach RUN` or `tpuctl gc` finish it)")
@click.option("--attach", "attach", metavar="RUN", help="watch a detached run to its end, then tear it down")
@click.option("--download", type=click.Path(file_okay=False), help="copy the artifacts to this directory")
@click.option("--delete-bucket", is_flag=True, help="also delete the bucket at the end (default: kept, with a TTL)")
@click.option("--max-recoveries", type=click.IntRange(0), help="preemptions to recover from (default: the spec's, 3)")
@click.option("--poll", "poll_s", type=click.FloatRange(0.2), default=2.0, show_default=True,
              help="seconds between job/node checks")
@click.option("--migrate", is_flag=True, help="turn a legacy TPU Node request into the equivalent TPU VM")
@spec_options
@click.option("--export", "export", multiple=True, metavar="FORMAT",
              help="also write the final model in this format of the template's (hf: Hugging Face) to model/FORMAT/")
@click.option("--dry-run", is_flag=True, help="validate and show the plan; create nothing")
@click.option("--profile", metavar="FIRST-LAST",
              help="job.profile: trace these training steps on worker 0 (e.g. 100-110) for TensorBoard's profile tab")
@click.option("--no-fit-check", "no_fit_check", is_flag=True,
              help="skip compiling the step for the TPU first (`tpuctl fit`)")
@click.option("--json", "as_json", is_flag=True,
              help="print each event, then the summary, as one JSON object per line on stdout")
@_cloud_options
def run_command(spec_file, name, yes, detach, no_supervisor, attach, download, delete_bucket, max_recoveries, poll_s, migrate,
                spec_flags: SpecFlags, export, dry_run, profile, no_fit_check, as_json, cloud, project) -> None:
    """Run a training job end to end: up, prepare data, ship, train on every worker, collect, tear down.

    The TPU and VMs are deleted whatever happens (success, failure, Ctrl-C, SIGTERM); the bucket with the
    checkpoints, logs and TensorBoard events is kept with a TTL label unless --delete-bucket.
    """
    from tpuctl.jobs.pipeline import Pipeline, RunOptions

    if attach and (spec_file or detach or dry_run or migrate or spec_flags.given or profile):
        given = (*spec_flags.given, *(("--profile",) if profile else ()))
        raise BadInput("--attach takes a run name and no spec, --detach, --dry-run, --migrate or spec-field flag"
                       + (f" ({', '.join(given)})" if given else ""), field="attach",
                       hint="tpuctl run --attach RUN")
    if not attach and not spec_file:
        raise BadInput("no spec file given", field="spec", hint="tpuctl run examples/bert-tiny.yaml --yes")
    if no_supervisor and not detach:
        raise BadInput("--no-supervisor applies to --detach, which was not given", field="no-supervisor",
                       hint=f"add --detach, e.g. tpuctl run {spec_file or 'SPEC'} --detach --no-supervisor")
    opts = RunOptions(name=name, yes=yes, detach=detach, attach=attach, download=Path(download) if download else None,
                      delete_bucket=delete_bucket, max_recoveries=max_recoveries, dry_run=dry_run, poll_s=poll_s,
                      export=tuple(export), fit_check=not no_fit_check, supervise=not no_supervisor)
    if not attach and not dry_run:
        console.can_confirm(yes=yes, to="create the run's resources")  # before the local cloud even starts
    lines = console.JsonLines() if as_json else None
    board = console.Board(f"tpuctl run {attach or spec_file}")
    on_event = console.tee(board, lines)

    def confirm(plan) -> bool:
        with board.paused():  # the question needs the terminal the live view is drawing on
            return console.confirm(f"create {plan.accelerator.name} for run {plan.run} at "
                                   f"~${plan.price_per_hour:.2f}/h (torn down when the job ends)?",
                                   yes=yes, to=f"create run {plan.run}")

    if attach and _watch_supervised(attach, poll_s, cloud, project):
        return
    if attach:
        pipeline = Pipeline(_clients(project, cloud), options=opts, on_event=on_event)
        go = pipeline.attach
    else:
        from tpuctl import provision
        from tpuctl.cli.provision import resolve

        # Flags > TPUCTL_* env > spec file > user config > gcloud config > defaults, as for `up`.
        spec, settings = resolve(spec_file, spec_flags, cloud=cloud, migrate=migrate, on_event=on_event, name=name,
                                 project=project)
        spec = spec_mod.with_profile(spec, profile)  # the flag wins over the file's job.profile
        clients = None if dry_run else provision.connect(config.ensure_endpoint(settings, on_event=on_event))
        pipeline = Pipeline(clients, spec, project=settings.project, spec_dir=Path(spec_file).resolve().parent,
                            options=opts, on_event=on_event, confirm=confirm)
        go = pipeline.run
    try:
        with board:
            outcome = go()
    finally:  # after the live view ended, so the summary is the last thing on the terminal
        _finish(pipeline.outcome, lines)
    if dry_run and detach and not no_supervisor and (reached := config.reachable(settings)) is not None:
        from tpuctl.provision import supervisor_account

        # The identity its supervisor would run as: present, or creatable by this caller (read-only).
        supervisor_account.check(provision.connect(reached), spec.supervisor.service_account)
    if dry_run and not as_json:
        plan = pipeline.plan
        console.table(("step", "kind", "name", "where", "$/h"),
                      [(s.key, s.kind.value, s.name, s.location, f"{s.price_per_hour:.2f}" if s.price_per_hour else "-")
                       for s in plan.steps], title=f"plan for run {plan.run} ({settings.target})"
                      + (f": {plan.framework} on {plan.runtime_version}" if plan.framework else ""))
    elif outcome.state == "detached" and not no_supervisor:
        console.info(f"detached: run {outcome.run} is in the hands of its supervisor VM; follow with "
                     f"`tpuctl logs {outcome.run} -f` or `tpuctl job status {outcome.run}`; stop it with "
                     f"`tpuctl down {outcome.run}`")
    elif outcome.state == "detached":
        console.info(f"detached: follow with `tpuctl logs {outcome.run} -f`; finish with "
                     f"`tpuctl run --attach {outcome.run}` (or `tpuctl gc` tears it down when it ends)")


def _watch_supervised(run: str, poll_s: float, cloud, project) -> bool:
    """`--attach` of a run its supervisor VM watches: follow it to its end, touching nothing (a second
    pipeline would recover and tear down alongside the supervisor's). False when no supervisor watches it."""
    from tpuctl.errors import JobFailed
    from tpuctl.jobs import supervisor_vm

    clients = _clients(project, cloud)
    found = supervisor_vm.live(clients, run)
    if found is None:
        return False
    bucket, beat = found
    console.info(f"run {run} is in the hands of its supervisor VM {beat.vm}: following it (Ctrl-C stops following, "
                 f"not the run; `tpuctl down {run}` stops the run)")
    status = supervisor_vm.follow(clients, run, bucket, poll_s=poll_s, on_event=console.report)
    if status.state != "succeeded":
        raise JobFailed(f"run {run} ended {status.state}", hint=f"see `tpuctl logs {run}` and `tpuctl job status {run}`")
    console.info(f"run {run}: succeeded at step {status.step}; artifacts in gs://{bucket}/runs/{run}/model/")
    return True


def _finish(outcome, lines: console.JsonLines | None) -> None:
    """The summary, whatever happened: the last JSON line with --json, else a few lines on stderr."""
    if lines is not None:
        lines.summary(outcome.as_dict())
    elif outcome.state != "planned":
        _summary(outcome)


run_command.section = SECTION


def _fleet_for(clients, run: str, worker: str | None):
    from tpuctl.jobs import cluster

    where = cluster.locate(clients, run)
    key, targets = cluster.authorize(clients, where.zone, where.node)
    index = _worker_index(run, worker, [t.index for t in targets])
    if index is not None:
        targets = [t for t in targets if t.index == index]
    return where, key, targets


def _worker_index(run: str, worker: str | None, indices: list[int]) -> int | None:
    """`--worker` checked against the run's workers `indices`: None for all of them (unset or `all`), else the
    one index. BadInput when it is neither a number nor one of them, naming the workers there are."""
    if worker in (None, "all"):
        return None
    try:
        index = int(worker)
    except ValueError:
        raise BadInput(f"--worker must be a number or all, not {worker!r}", field="worker") from None
    if index not in indices:
        known = sorted(indices)
        span = (f"{known[0]}-{known[-1]}" if known == list(range(known[0], known[-1] + 1))
                else ", ".join(map(str, known)))
        raise BadInput(f"run {run} has workers {span}", field="worker")
    return index


@click.command("ssh", context_settings={"ignore_unknown_options": True})
@click.argument("run")
@click.option("--worker", "-w", default=None, help="worker index, or all (default: 0 for a shell, all for a command)")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@_cloud_options
def ssh_command(run, worker, command, cloud, project) -> None:
    """Open a shell on a worker, or run `-- CMD` on one or all workers (output prefixed per worker)."""
    from tpuctl.jobs.remote import shell_command
    from tpuctl.jobs.ssh import Fleet

    clients = _clients(project, cloud)
    if not command:
        _, key, targets = _fleet_for(clients, run, worker or "0")
        if len(targets) != 1:
            raise BadInput("an interactive shell needs one worker", field="worker", hint="--worker 0, or pass -- CMD")
        _interactive(key, targets[0])
        return
    _, key, targets = _fleet_for(clients, run, worker or "all")
    line = shell_command(list(command))
    prefix = len(targets) > 1

    async def go():
        async with Fleet(targets, key, on_event=console.report) as fleet:
            return await fleet.run_all(lambda t: line)

    results = asyncio.run(go())
    for r in results:
        for stream, text in ((sys.stdout, r.stdout), (sys.stderr, r.stderr)):
            for out_line in text.splitlines():
                stream.write(f"[w{r.index}] {out_line}\n" if prefix else out_line + "\n")
    sys.stdout.flush()
    # The remote codes are reported, not passed through: tpuctl's own exit codes mean something else
    # (3 is "no capacity", 2 "bad input"), so a failed remote command is exit 1.
    for r in results:
        console.info(f"worker {r.index}: exit {r.exit_status}")
    failed = [r for r in results if r.exit_status != 0]
    if failed:
        raise TpuctlError(f"the command failed on {len(failed)} of {len(results)} worker(s): "
                          + ", ".join(f"worker {r.index} exit {r.exit_status}" for r in failed))


def _interactive(key, target) -> None:
    """Hand the terminal to the system ssh client, pinned to the published (or recorded) host key."""
    from tpuctl import paths

    exe = shutil.which("ssh")
    if exe is None:
        raise BadInput("no ssh client on PATH for an interactive shell", field="command",
                       hint="install OpenSSH, or pass a command: tpuctl ssh RUN -- CMD")
    known = paths.ssh_dir() / "known_hosts"
    if target.host_key:
        # The key the node publishes now, not whatever an earlier node at this address had.
        known = paths.ssh_dir() / "published_known_hosts"
        known.write_text(f"{target.known_hosts_name} {target.host_key}\n")
    # HostKeyAlias makes OpenSSH look the key up (and record it) under the machine's identity alone, port or
    # not, as jobs/ssh.py does; unhashed, so tpuctl's own connections can read what the user accepted here.
    alias = ["-o", f"HostKeyAlias={target.host_key_alias}"] if target.host_key_alias else []
    argv = [exe, "-i", str(key.private_path), "-p", str(target.port), "-o", f"UserKnownHostsFile={known}",
            # Unpublished: a key recorded for this machine is enforced; an unknown one is the user's to accept.
            "-o", "StrictHostKeyChecking=yes" if target.host_key else "StrictHostKeyChecking=ask",
            "-o", "HashKnownHosts=no", *alias, "-o", "IdentitiesOnly=yes", f"{key.user}@{target.host}"]
    os.execv(exe, argv)


@click.command("logs")
@click.argument("run")
@click.option("--follow", "-f", is_flag=True, help="keep streaming until the job ends (reconnects on drops)")
@click.option("--worker", "-w", default=None, help="worker index, or all (default)")
@_cloud_options
def logs_command(run, follow, worker, cloud, project) -> None:
    """Print the job's log from every worker, prefixed [wN]; from the bucket once the TPU is gone."""
    from tpuctl.jobs import launch, logs
    from tpuctl.jobs.ssh import Fleet

    clients = _clients(project, cloud)

    def sink(index: int, line: str) -> None:
        sys.stdout.write(f"[w{index}] {line}\n")
        sys.stdout.flush()

    try:
        _, key, targets = _fleet_for(clients, run, worker)
    except NotFound:
        _logs_from_bucket(clients, run, worker, sink)
        return

    async def go():
        async with Fleet(targets, key, on_event=console.report) as fleet:
            _require_job(run, await launch.poll(fleet, run))
            await logs.follow(fleet, run, sink, follow=follow)

    asyncio.run(go())


def _require_job(run: str, states) -> None:
    """An empty log and exit 0 would read as "the job printed nothing": say that there is no job instead."""
    if all(s.state == "absent" for s in states):
        raise NotFound(f"run {run} has no job on its workers", field="run",
                       hint=f"start one with `tpuctl run SPEC --name {run}`")


def _logs_from_bucket(clients, run: str, worker: str | None, sink) -> None:
    from tpuctl import provision
    from tpuctl.provision import Kind

    bucket = next((r.name for r in provision.list_resources(clients, run) if r.kind is Kind.BUCKET), None)
    if bucket is None:
        raise NotFound(f"run {run} has neither a TPU node nor a bucket", field="run", hint="see `tpuctl list`")
    prefix = f"runs/{run}/logs/"
    blobs = sorted(clients.storage.list_blobs(bucket, prefix=prefix), key=lambda b: b.name)
    if not blobs:
        raise NotFound(f"run {run} has no TPU node and no job logs in gs://{bucket}/{prefix}", field="run",
                       hint="see `tpuctl list`")
    logs = {int(b.name[len(prefix):].removeprefix("worker-").removesuffix(".log")): b for b in blobs}
    chosen = _worker_index(run, worker, list(logs))  # as `ssh -w` checks it, against the workers with a log
    console.note(f"the TPU is gone; logs from gs://{bucket}/{prefix}")
    for index, b in logs.items():
        if chosen in (None, index):
            for line in b.download_as_text().splitlines():
                sink(index, line)


@click.group("job")
def job_group() -> None:
    """Inspect or stop a launched job."""


job_group.section = SECTION


@job_group.command("status")
@click.argument("run")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@_cloud_options
def job_status(run, as_json, cloud, project) -> None:
    """The job's state per worker (over SSH) and its status record in the bucket; from the run's timeline there,
    its recoveries and its goodput (the share of the time it held a TPU that trained steps it kept)."""
    import time

    from tpuctl import provision
    from tpuctl.jobs import cluster, launch, timeline
    from tpuctl.jobs.ssh import Fleet
    from tpuctl.provision import Kind

    clients = _clients(project, cloud)
    found = provision.list_resources(clients, run)
    bucket = next((r.name for r in found if r.kind is Kind.BUCKET), None)
    status = cluster.read_status(clients, bucket, run) if bucket else None
    doc = {"run": run, "status": status.to_doc() if status else None, "workers": []}
    if any(r.kind is Kind.TPU for r in found):
        _, key, targets = _fleet_for(clients, run, None)

        async def go():
            async with Fleet(targets, key, deadline_s=30, on_event=console.report) as fleet:
                return await launch.poll(fleet, run)

        doc["workers"] = [s.__dict__ for s in asyncio.run(go())]
    if doc["status"] is None and not doc["workers"]:
        raise NotFound(f"run {run} has no job", field="run", hint="see `tpuctl list`")
    marks = timeline.load(clients, bucket, run) if bucket else None
    account = timeline.account(marks, now=time.time()) if marks is not None else None
    doc["recoveries"] = account.recoveries if account else None
    doc["goodput"] = account.to_json()["goodput"] if account else None
    if as_json:
        console.emit_json(doc)
        return
    step = status.step if status else None
    console.info(f"run {run}: {status.state if status else 'unknown'}, "
                 + (f"step {step}" if step is not None else "no step finished yet")
                 + (f" ({why})" if status and (why := _why_it_ended(status)) else ""))
    if account is not None:  # a goodput nobody saw the steps of is unknown, not 0 (timeline.account)
        goodput = "unknown" if doc["goodput"] is None else f"{doc['goodput']:.0%}"
        console.info(f"  goodput {goodput} after {doc['recoveries']} recovery(ies) (`tpuctl cost {run}`)")
    console.table(("worker", "state", "exit code", "pid"),
                  [(w["index"], w["state"], w["exit_code"], w["pid"]) for w in doc["workers"]])


def _why_it_ended(status) -> str | None:
    """What the status record (a RunStatus) says about how the job ended (or that a recovery is under way)."""
    if status.recovering:
        return "recovering"
    if status.ended == "max_run_duration":
        return "Google ended the flex-start TPU at its max run duration"
    if status.interrupted:
        return "interrupted: `tpuctl run` was stopped"
    if status.state == "failed" and status.exit_code is not None:
        return f"exit code {status.exit_code}"
    return None


@job_group.command("cancel")
@click.argument("run")
@click.option("--json", "as_json", is_flag=True, help="print what was cancelled as JSON")
@_cloud_options
def job_cancel(run, as_json, cloud, project) -> None:
    """Stop the job on every worker (SIGTERM, then SIGKILL); the TPU stays up (`tpuctl down RUN`).

    Its status record then says `cancelled`. A job that already ended is left as it is; no job at all is an
    error (exit 2)."""
    from tpuctl.jobs import cluster, launch
    from tpuctl.jobs.ssh import Fleet

    clients = _clients(project, cloud)
    where, key, targets = _fleet_for(clients, run, None)

    async def go():
        async with Fleet(targets, key, deadline_s=60, on_event=console.report) as fleet:
            before = await launch.poll(fleet, run)
            _require_job(run, before)
            live = [s.index for s in before if s.state in ("running", "unreachable")]
            if live:
                await launch.cancel(fleet, run, indices=live)
            return before, live

    before, live = asyncio.run(go())
    if live and where.bucket:
        cluster.close_status(clients, where.bucket, run, state="cancelled", on_event=console.report)
    record = None if live or not where.bucket else cluster.read_status(clients, where.bucket, run)
    state = "cancelled" if live else (record.state if record else "ended")
    if as_json:
        console.emit_json({"run": run, "state": state, "cancelled_workers": live,
                           "workers": [s.__dict__ for s in before]})
    elif live:
        console.info(f"run {run}: job cancelled on {len(live)} worker(s); `tpuctl down {run}` deletes the TPU")
    else:
        console.info(f"run {run}: the job had already ended ({state}); nothing to cancel")


ssh_command.section = SECTION
logs_command.section = SECTION
commands = [run_command, ssh_command, logs_command, job_group]
