"""`tpuctl up / down / status / list`: plan and create a run's resources, tear them down, look at them.

`tpuctl.provision` (and with it the Google client libraries, seconds to import) is imported inside the
commands that talk to a cloud, so `tpuctl --help` and the other commands start fast.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from tpuctl import catalog as catalog_mod
from tpuctl import api, config, console, cost, ledger
from tpuctl import spec as spec_mod
from tpuctl.cli.spec_flags import SpecFlags, spec_options
from tpuctl.events import EventSink

if TYPE_CHECKING:
    from tpuctl import provision as prov
    from tpuctl.provision import inventory

SECTION = "Provision and inspect"


def _money(usd: float) -> str:
    return f"${usd:,.2f}"


def _cloud_options(f):
    f = click.option("--cloud", type=click.Choice(config.TARGETS), help="force the target (default: auto)")(f)
    f = click.option("--project", help="Google Cloud project [env TPUCTL_PROJECT]")(f)
    return f


def _price(cat: catalog_mod.Catalog):
    def price(r: prov.Resource) -> float:
        return cost.hourly(ledger.entry_of(r), cat)

    return price


def resolve(spec_path: str | None, spec_flags: SpecFlags, *, cloud: str | None, migrate: bool,
            partial: bool = False, on_event: EventSink = console.report,
            **fields: Any) -> tuple[spec_mod.RunSpec, config.Settings]:
    """Flags (`spec_flags` and the command's own spec-field `fields`, e.g. name, project) > TPUCTL_* env >
    spec file > user config > gcloud config > defaults, then the target. `up`, `run` and `doctor` read a spec
    through here; `partial`: see spec.from_mapping.

    Starts nothing: validation and dry runs must not spin up the embedded cloud (see ensure_endpoint)."""
    spec, sources = resolve_spec(spec_path, spec_flags, migrate=migrate, partial=partial, on_event=on_event,
                                 **fields)
    return spec, config.settings(project=spec.project, cloud=cloud, sources=sources, start_local=False)


def resolve_spec(spec_path: str | None, spec_flags: SpecFlags, *, migrate: bool = False, partial: bool = False,
                 on_event: EventSink = console.report, **fields: Any) -> tuple[spec_mod.RunSpec, dict[str, str]]:
    """The spec alone, layered as `resolve` layers it, with each field's source; needs no cloud or credentials
    (`fit` reads a spec this way)."""
    raw = spec_mod.read_file(spec_path) if spec_path else {}
    merged, sources = config.layered({**spec_flags.fields, **fields}, raw)
    spec = spec_mod.from_mapping(merged, migrate=migrate, on_event=on_event, partial=partial)
    return spec_mod.with_sharding(spec_mod.with_framework(spec, spec_flags.framework), spec_flags.sharding), sources


def print_plan(plan: prov.Plan, spec: spec_mod.RunSpec, settings: config.Settings) -> None:
    console.table(("step", "kind", "name", "where", "after", "$/h", "detail"),
                  [(s.key, s.kind.value, s.name, s.location, ",".join(s.after) or "-",
                    _money(s.price_per_hour) if s.price_per_hour else "-", s.detail) for s in plan.steps],
                  title=f"plan for run {plan.run} in project {plan.project} ({settings.target})")
    est = cost.estimate_spec(spec.model_copy(update={"zones": plan.zones}), catalog_mod.load())
    bound = f", at most {_money(est.total_usd)} over {est.bound}" if est.total_usd is not None else ""
    console.info(f"estimated {_money(plan.price_per_hour)}/hour{bound} (prices: {est.prices_from})")
    for n in plan.notes:
        console.warn(n)


@click.command("up")
@click.argument("spec_file", required=False, type=click.Path(dir_okay=False))
@click.option("--name", help="run name (default: spec name, else OWNER-ACCELERATOR)")
@_cloud_options
@spec_options
@click.option("--migrate", is_flag=True, help="turn a legacy TPU Node request into the equivalent TPU VM")
@click.option("--dry-run", is_flag=True, help="print the plan and stop")
@click.option("--no-fit-check", "no_fit_check", is_flag=True,
              help="skip compiling the job's step for the TPU first (`tpuctl fit`)")
@click.option("--keep-on-failure", is_flag=True, help="leave what was created when up fails")
@click.option("--yes", "-y", is_flag=True, help="do not ask")
@click.option("--json", "as_json", is_flag=True,
              help="print the plan (--dry-run), or each event then the result, as one JSON object per line")
def up(spec_file, name, cloud, project, spec_flags: SpecFlags, migrate, dry_run, no_fit_check, keep_on_failure,
       yes, as_json) -> None:
    """Create a run's TPU, VMs, bucket and bucket IAM (idempotent: re-running adopts what exists)."""
    from tpuctl import provision as prov

    spec, settings = resolve(spec_file, spec_flags, cloud=cloud, migrate=migrate, name=name, project=project)
    plan = prov.plan(spec, project=settings.project)
    fitted = None
    if spec.job is not None and not no_fit_check:
        from tpuctl import fitting

        fitted = fitting.check(spec, spec_dir=Path(spec_file).resolve().parent if spec_file else None,
                               on_event=console.report)
        if fitted is not None:
            console.report(fitting.note(fitted))
    if dry_run:
        _dry_run_checks(settings, plan, named_bucket=spec.bucket != "auto")
    else:  # a script without --yes hears only this, before the plan
        console.can_confirm(yes=yes, to=f"create run {plan.run}")
    lines = console.JsonLines() if as_json else None
    fit_json = fitted.to_json() if fitted is not None else None
    if lines is not None and dry_run:
        lines.summary({"plan": plan.to_json(), "target": settings.target, "fit": fit_json})
        return
    if not as_json:
        print_plan(plan, spec, settings)
    if dry_run:
        return
    console.confirm(f"create run {plan.run} at about {_money(plan.price_per_hour)}/hour?", yes=yes,
                    to=f"create run {plan.run}")
    started = time.monotonic()
    result = None
    try:
        with console.Board(f"tpuctl up {plan.run}") as board:
            on_event = console.tee(board, lines)
            clients = prov.connect(config.ensure_endpoint(settings, on_event=on_event))
            result = api.apply_plan(clients, plan, on_event=on_event, keep_on_failure=keep_on_failure)
        _report_up(plan, settings, result, started, lines, fit_json)
    except KeyboardInterrupt:
        if result is None:  # apply rolled back what it created and said so
            raise
        raise api.kept_after_ready(plan.run) from None  # while the result printed


def _report_up(plan: prov.Plan, settings: config.Settings, result, started: float,
               lines: console.JsonLines | None, fit_json: dict | None) -> None:
    from tpuctl import provision as prov
    from tpuctl.provision import inventory

    tpu_r = result.get(prov.Kind.TPU)
    if lines is not None:
        lines.summary({"plan": plan.to_json(), "target": settings.target, "fit": fit_json, "zone": result.zone,
                       "created": list(result.created), "adopted": list(result.adopted),
                       "service_account": result.service_account,
                       "resources": [inventory.resource_json(r) for r in result.resources]})
        return
    workers = ", ".join(f"{w.ip}:{w.port}" for w in tpu_r.workers) if tpu_r else "-"
    console.info(f"run {plan.run} is ready in {result.zone} after {time.monotonic() - started:.0f}s "
                 f"({len(result.created)} created, {len(result.adopted)} adopted); workers: {workers}")
    console.info(f"bucket gs://{plan.bucket}; when done: tpuctl down {plan.run}")


def _dry_run_checks(settings: config.Settings, plan: prov.Plan, *, named_bucket: bool) -> None:
    """What `up` would refuse after reading the cloud, refused by the dry run too, when the cloud answers
    without being started (a dry run starts and creates nothing)."""
    from tpuctl import provision as prov

    target = config.reachable(settings)
    if target is not None:
        prov.check_bucket(prov.connect(target), plan)
    elif named_bucket:
        console.note(f"not checked: where bucket {plan.bucket} is (the local cloud is not running)")


@click.command("down")
@click.argument("run")
@_cloud_options
@click.option("--delete-bucket", is_flag=True, help="also delete the bucket and everything in it")
@click.option("--dry-run", is_flag=True, help="show what would be deleted; delete nothing")
@click.option("--yes", "-y", is_flag=True, help="do not ask")
@click.option("--json", "as_json", is_flag=True,
              help="print each event, then what was deleted, as one JSON object per line")
def down(run, cloud, project, delete_bucket, dry_run, yes, as_json) -> None:
    """Delete every resource of RUN in parallel, then verify nothing with its label remains."""
    from tpuctl import provision as prov
    from tpuctl.provision import inventory, labels

    labels.check_name(run, field="run")  # no resource can carry an invalid name: a typo, not an empty run
    if not dry_run:
        console.can_confirm(yes=yes, to=f"delete run {run}")
    lines = console.JsonLines() if as_json else None
    settings = config.settings(project=project, cloud=cloud, on_event=console.tee(console.report, lines))
    clients = prov.connect(settings)
    found = prov.list_resources(clients, run, include_iam=True)
    api.check_owner(run, found)
    if not found:
        # Idempotent (a second `down` is not an error), but a mistyped name must not pass for a clean one.
        if (missing := api.unknown_run(clients, run)) is not None:
            raise missing
        if lines is not None:
            lines.summary({"run": run, "deleted": [], "kept": []})
        else:
            console.info(f"run {run}: already deleted; nothing carries its label in project {settings.project}")
        return
    going = [r for r in found if delete_bucket or r.kind not in (prov.Kind.BUCKET, prov.Kind.IAM)]
    if dry_run and lines is not None:
        lines.summary({"run": run, "would_delete": [inventory.resource_json(r) for r in going],
                       "kept": [inventory.resource_json(r) for r in found if r not in going]})
        return
    if not as_json:
        console.table(("kind", "name", "where", "state"), [(r.kind.value, r.name, r.location, r.state.value)
                                                            for r in going],
                      title=f"{'would delete (dry run)' if dry_run else 'to delete'} for run {run}")
    if dry_run:
        return
    if delete_bucket:
        for b in [r for r in found if r.kind is prov.Kind.BUCKET]:
            c = prov.bucket_contents(clients, b.name)
            console.warn(f"gs://{b.name} holds {c.objects} objects ({c.bytes / 1e6:,.1f} MB)"
                         + (f", e.g. {', '.join(c.sample[:5])}" if c.sample else "") + "; they will be deleted")
    console.confirm(f"delete {len(going)} resource(s) of run {run}?", yes=yes, to=f"delete run {run}",
                    nothing="nothing was deleted")
    with console.Board(f"tpuctl down {run}") as board:
        result = api.delete_run(clients, run, delete_bucket=delete_bucket, on_event=console.tee(board, lines))
    if lines is not None:
        lines.summary({"run": run, "deleted": [inventory.resource_json(r) for r in result.deleted],
                       "kept": [inventory.resource_json(r) for r in result.kept]})
        return
    console.info(f"run {run}: deleted {len(result.deleted)} resource(s); verified none remain")
    for b in [r for r in result.kept if r.kind is prov.Kind.BUCKET]:
        console.note(f"kept gs://{b.name} (checkpoints); delete it with `tpuctl down {run} --delete-bucket`")


def _runs_table(runs: list[inventory.RunStatus]) -> None:
    from tpuctl.provision import inventory

    now = time.time()
    console.table(("run", "owner", "state", "zone", "accelerator", "workers", "age", "expires in", "$/h", "accrued"),
                  [(s.run, s.owner or "-", s.state_text, s.zone or "-",
                    next((r.accelerator for r in s.resources if r.accelerator), "-"), s.workers,
                    inventory.age_text(s.age_s),
                    inventory.age_text(s.expires - now) if s.expires and s.expires > now else
                    ("expired" if s.expires else "-"),
                    _money(s.price_per_hour), _money(s.accrued)) for s in runs])


@click.command("status")
@click.argument("run", required=False)
@_cloud_options
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def status(run, cloud, project, as_json) -> None:
    """One run's resources (or every run): state, zone, age, workers, accrued cost."""
    from tpuctl import provision as prov
    from tpuctl.provision import inventory

    settings = config.settings(project=project, cloud=cloud, on_event=console.report)
    clients = prov.connect(settings)
    runs = prov.status(clients, run, price=_price(catalog_mod.load()))
    if as_json:
        console.emit_json(runs[0].to_json() if run else {"runs": [s.to_json() for s in runs]})
        return
    if run is None:
        _runs_table(runs)
        return
    s = runs[0]
    console.table(("kind", "name", "where", "state", "age", "workers", "detail"),
                  [(r.kind.value, r.name, r.location, r.state.value.upper() if r.state is prov.State.PREEMPTED
                    else r.state.value, inventory.age_text(time.time() - r.created.timestamp()) if r.created else "-",
                    " ".join(f"{w.ip}:{w.port}" for w in r.workers) or "-",
                    ", ".join(f"{k}={v}" for k, v in r.detail.items())) for r in s.resources],
                  title=f"run {s.run} ({s.state_text})")
    if s.bucket_kept:
        bucket = next(r.name for r in s.resources if r.kind is prov.Kind.BUCKET)
        console.info(f"the TPU and VMs are gone; bucket gs://{bucket} kept until {inventory.utc(s.expires)} (its TTL); "
                     f"`tpuctl down {s.run} --delete-bucket` deletes it now")
        return
    console.info(f"{_money(s.price_per_hour)}/hour, {_money(s.accrued)} so far; expires "
                 f"{inventory.utc(s.expires)}")
    if any(r.state is prov.State.PREEMPTED for r in s.resources):
        console.warn(f"run {s.run} was preempted: `tpuctl run` recovers it, `tpuctl down {s.run}` deletes it")


@click.command("list")
@_cloud_options
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def list_runs(cloud, project, as_json) -> None:
    """Every run in the project, found by its labels."""
    from tpuctl import provision as prov

    settings = config.settings(project=project, cloud=cloud, on_event=console.report)
    runs = prov.status(prov.connect(settings), price=_price(catalog_mod.load()))
    if as_json:
        console.emit_json({"runs": [s.to_json() for s in runs]})
    elif not runs:
        console.info(f"no tpuctl runs in project {settings.project}")
    else:
        _runs_table(runs)


commands = [up, down, status, list_runs]
for _c in commands:
    _c.section = SECTION
