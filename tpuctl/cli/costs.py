"""`tpuctl catalog`, `tpuctl cost` and `tpuctl gc`: what things cost, what was spent, and the cleanup cron."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from tpuctl import catalog as catalog_mod
from tpuctl import api, config, console, cost, paths
from tpuctl.errors import BadInput, CloudError, NotFound
from tpuctl.config import settings
from tpuctl.ledger import Ledger

# tpuctl.provision loads the Google client libraries (seconds); only the commands that need it import it.
if TYPE_CHECKING:
    from tpuctl.provision import gc

SECTION = "Cost and cleanup"


def _money(usd: float | None) -> str:
    return "-" if usd is None else f"${usd:,.2f}"


@click.group("catalog")
def catalog_group() -> None:
    """TPU types, zones, runtimes and prices.

    The data is embedded (with its date and sources); `catalog refresh` pulls current prices from the Cloud
    Billing Catalog API into a local cache that then wins.
    """


@catalog_group.command("list")
@click.option("--generation", "-g", help="only this generation: v2 v3 v4 v5e v5p v6e tpu7x")
@click.option("--region", "-r", default="us-central1", show_default=True, help="region whose prices to show")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def catalog_list(generation: str | None, region: str, as_json: bool) -> None:
    """Every accelerator type with its shape and $/hour."""
    cat = catalog_mod.load()
    types = [t for t in cat.accelerators() if generation in (None, t.generation)]
    if generation and not types:
        raise BadInput(f"unknown generation {generation!r}", field="generation",
                       hint=f"one of: {', '.join(cat.generations())}")
    if as_json:
        console.emit_json({"as_of": cat.as_of, "prices_from": cat.prices_from, "source": cat.source,
                           "accelerators": [catalog_mod.accelerator_json(t, cat) for t in types]})
        return
    rows = [(t.name, t.api, t.chips, t.cores, t.hosts, t.topology,
             _money(cat.tpu_price_per_hour(t.name, region, spot=False)),
             _money(cat.tpu_price_per_hour(t.name, region, spot=True)), t.default_runtime) for t in types]
    console.table(("type", "api", "chips", "cores", "hosts", "topology", f"$/h {region}", "spot $/h", "default runtime"),
                  rows)
    console.note(f"prices: {cat.prices_from}; regions without a sampled price show the dearest known one")
    if generation:
        console.note(f"{generation} price source: {cat.price_source(generation)}")


@catalog_group.command("show")
@click.argument("accelerator")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def catalog_show(accelerator: str, as_json: bool) -> None:
    """One type: shape, zones, runtimes and prices in every region with a price."""
    cat = catalog_mod.load()
    t = cat.accelerator(accelerator)
    data = catalog_mod.accelerator_json(t, cat)
    if as_json:
        console.emit_json(data)
        return
    accepted_tf = len(t.runtimes) - len(t.usable_runtimes)  # TensorFlow images the API takes where TF cannot run
    console.table(("field", "value"), [
        ("type", t.name), ("generation", t.generation), ("api type", t.api_type),
        ("provisioned by", t.api + (f" (machine type {t.machine_type})" if t.machine_type else "")),
        ("chips / cores / hosts", f"{t.chips} / {t.cores} / {t.hosts}"), ("topology", t.topology),
        ("zones", ", ".join(z + (" (single-tenant only)" if z in t.single_tenant_zones else "") for z in t.zones)),
        ("provisioning", ", ".join(t.provisioning) + (f" (flex-start in {', '.join(data['flex_start_zones'])})"
                                                      if data["flex_start_zones"] else "")),
        ("runtimes", ", ".join(t.usable_runtimes)), ("default runtime", t.default_runtime),
        ("TensorFlow", "yes" if t.tensorflow else "no (Google supports none from v6e on" + (
            f"; its API still accepts {accepted_tf} {catalog_mod.TF_RUNTIME_PREFIX}* images, TensorFlow does not "
            "start on them)" if accepted_tf else ")"))])
    console.table(("region", "on-demand $/h", "spot $/h"),
                  [(r, _money(p["on_demand"]), _money(p["spot"]))
                   for r, p in data["price_per_hour_by_region"].items()])
    console.note(f"prices: {cat.prices_from}")
    console.note(f"price source: {data['price_source']}")


def _clients(project: str | None, cloud: str | None):
    from tpuctl.provision.clients import connect

    return connect(settings(project=project, cloud=cloud, on_event=console.report))


_project = click.option("--project", help="Google Cloud project (default: spec, env, config, gcloud)")
_cloud = click.option("--cloud", type=click.Choice(["gcp", "local"]), help="force the target cloud")


@catalog_group.command("refresh")
@_project
@_cloud
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def catalog_refresh(project: str | None, cloud: str | None, as_json: bool) -> None:
    """Pull current TPU prices from the Cloud Billing Catalog API into the local cache."""
    clients = _clients(project, cloud)
    source = "local cloud Billing Catalog" if clients.local else "Cloud Billing Catalog API"
    result = catalog_mod.refresh(clients.billing_catalog, source=source)
    if as_json:
        console.emit_json({"path": str(result.path), "skus_read": result.skus_read, "prices_set": result.prices_set,
                           "tpu_prices_per_chip_hour": result.prices})
        return
    console.info(f"read {result.skus_read} SKUs, {result.prices_set} TPU prices -> {result.path}")


@click.command("cost")
@click.argument("run", required=False)
@click.option("--since", default="7d", show_default=True, help="window: 24h, 7d, 30d ...")
@click.option("--by", type=click.Choice(cost.GROUPINGS), default="run", show_default=True, help="group rows by")
@_project
@_cloud
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@click.pass_context
def cost_command(ctx: click.Context, run: str | None, since: str, by: str, project: str | None, cloud: str | None,
                 as_json: bool) -> None:
    """What tpuctl runs cost, by run, owner or type; with RUN, that run's dollars by phase.

    Live resources are found by their tpuctl labels; deleted ones come from the local ledger, including
    those an interrupted or failed `up` rolled back. Each counts the time it billed: a TPU while READY, a VM
    or TPU7x VM from RUNNING (nothing for a create that never got there); `resource-hours` are those hours.
    A RUN's phases come from its timeline in its bucket (tpuctl/jobs/timeline.py says what each one is).
    """
    for name in ("since", "by"):
        if run and ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE:
            raise BadInput(f"--{name} does nothing with a RUN: its phases cover its whole life", field=name,
                           hint=f"tpuctl cost {run}, or tpuctl cost --{name} ... for every run")
    window = cost.parse_duration(since, field="since")
    clients = _clients(project, cloud)
    now = time.time()
    entries = api.cost_entries(clients, now=now, on_event=console.report)
    if run:
        _run_phases(clients, run, [e for e in entries if e.run == run], now=now, as_json=as_json)
        return
    rep = cost.report(entries, catalog_mod.load(), since=now - window, now=now, by=by)
    if as_json:
        console.emit_json(rep.to_json())
        return
    console.table((by, "resources", "live", "rolled back", "resource-hours", "cost", "$/h now"),
                  [(r.key, r.resources, r.live,
                    f"{r.rolled_back} ({_money(r.rolled_back_usd)})" if r.rolled_back else "-",
                    f"{r.hours:.2f}", _money(r.usd), _money(r.usd_per_hour_now)) for r in rep.rows])
    console.info(f"total {_money(rep.total_usd)} over the last {since}; live resources bill "
                 f"{_money(rep.usd_per_hour_now)}/h now (prices: {rep.prices_from})")


def _run_phases(clients, run: str, entries, *, now: float, as_json: bool) -> None:
    """`tpuctl cost RUN`: the run's time and dollars by phase, from its timeline and its resources' billing."""
    from tpuctl import provision
    from tpuctl.jobs import timeline
    from tpuctl.provision import Kind

    bucket = next((r.name for r in provision.list_resources(clients, run) if r.kind is Kind.BUCKET), None)
    marks = timeline.load(clients, bucket, run) if bucket else None
    if marks is None:
        raise NotFound(f"run {run} has no timeline" + (f" in gs://{bucket}/{timeline.name(run)}" if bucket else
                                                      " (no bucket carries its labels)"), field="run",
                       hint="runs started by `tpuctl run` keep one in their bucket; `tpuctl cost` lists every run")
    acct = timeline.account(marks, now=now, entries=entries, catalog=catalog_mod.load())
    if as_json:
        console.emit_json({"run": run, **acct.to_json()})
        return
    console.table(("phase", "time", "share", "cost"),
                  [(c, f"{acct.seconds[c]:.0f}s", f"{acct.seconds[c] / acct.wall_s:.0%}" if acct.wall_s else "-",
                    _money(acct.usd[c])) for c in timeline.CATEGORIES if acct.seconds[c]])
    console.info(f"lost to preemption: {_money(acct.lost_to_preemption_usd)} "
                 f"({acct.recoveries} recovery(ies): recomputed steps and TPU time without training)")
    console.info(f"total {_money(sum(acct.usd.values()))} over {acct.wall_s:.0f}s" + ("" if acct.ended else " so far")
                 + f"; goodput {'unknown' if acct.goodput is None else f'{acct.goodput:.0%}'}")


def _outcome_line(o) -> str:
    rec = o.record()
    line = (f"{rec['status']} {rec['kind']} {rec['location']}/{rec['name']} run={rec['run']} owner={rec['owner']}: "
            f"{rec['why']}")
    if rec["error"]:
        line += f" ({rec['error']})"
    elif rec["status"] == "deleted":
        line += f" ({rec['seconds']:.1f}s)"
    return line


_SCHEDULE_ENV = ("TPUCTL_HOME", "TPUCTL_OWNER", "TPUCTL_PROJECT", "TPUCTL_CLOUD", "TPUCTL_API_ENDPOINT",
                 "STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS", "CLOUDSDK_CONFIG", "GCE_METADATA_HOST",
                 "GCE_METADATA_IP")
# gc's own flags that shape the schedule rather than the scheduled gc.
_SCHEDULING = ("schedule", "install", "every", "yes")


def _tpuctl_argv() -> list[str]:
    exe = shutil.which("tpuctl")
    return [exe] if exe else [sys.executable, "-m", "tpuctl"]


def _scheduled_argv(ctx: click.Context, target: str) -> list[str]:
    """The `tpuctl gc ...` a schedule runs: every flag this gc was given (so a --dry-run schedule stays a dry
    run, --timeout and --lock-wait hold), --yes unless it is a dry run (cron and systemd have no terminal, and
    scheduling a deleting gc is the consent), and --cloud pinned to the target resolved now, so a cron job
    whose environment lacks a project or credentials fails instead of cleaning up the embedded local cloud."""
    argv = [*_tpuctl_argv(), "gc"] + ([] if ctx.params["dry_run"] else ["--yes"])
    for param in ctx.command.params:
        value = ctx.params[param.name]
        if param.name in _SCHEDULING or ctx.get_parameter_source(param.name) is click.core.ParameterSource.DEFAULT:
            continue
        flag = max(param.opts, key=len)
        if getattr(param, "is_flag", False):
            argv += [flag] if value else []
        elif value is not None:
            argv += [flag, str(value)]
    if ctx.params["cloud"] is None:
        argv += ["--cloud", target]
    return argv


def _install_schedule(sched: gc.Schedule) -> None:
    from tpuctl.provision import gc

    unit_dir = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "systemd" / "user"
    unit_dir.mkdir(parents=True, exist_ok=True)
    (unit_dir / "tpuctl-gc.service").write_text(sched.service_unit)
    (unit_dir / "tpuctl-gc.timer").write_text(sched.timer_unit)
    console.info(f"wrote {unit_dir / 'tpuctl-gc.service'} and tpuctl-gc.timer; to use systemd instead of cron: "
                 "systemctl --user daemon-reload && systemctl --user enable --now tpuctl-gc.timer")
    if shutil.which("crontab") is None:
        console.warn("no `crontab` command here: the cron line was not installed (use the systemd timer)")
        return
    current = subprocess.run(["crontab", "-l"], capture_output=True, text=True)
    # crontab signals "no table yet" only in its message; any other failure must not make us replace a
    # table we could not read.
    if current.returncode != 0 and "no crontab" not in current.stderr.lower():
        raise CloudError(f"could not read your crontab: {current.stderr.strip()}",
                         hint="add the line printed by `tpuctl gc --schedule` with `crontab -e`")
    existing = current.stdout if current.returncode == 0 else ""
    done = subprocess.run(["crontab", "-"], input=gc.merge_crontab(existing, sched.crontab_line),
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise CloudError(f"crontab refused the new table: {done.stderr.strip()}",
                         hint="add the line printed by `tpuctl gc --schedule` with `crontab -e`")
    console.info("installed the crontab line (marked # tpuctl-gc; re-running --install replaces it)")


@click.command("gc")
@click.option("--dry-run", is_flag=True, help="show what would be deleted; delete nothing")
@click.option("--idle", default="60m", show_default=True,
              help="a running job without a heartbeat for this long is idle ('off' or 'never' disables)")
@click.option("--budget", type=float, help="USD: delete runs whose accrued cost passed this")
@click.option("--budget-per", type=click.Choice(["run", "owner"]), default="run", show_default=True,
              help="apply --budget to each run, or to the sum of an owner's runs")
@click.option("--all-owners", is_flag=True, help="also act on other owners' runs (default: only yours)")
@click.option("--owner", help="act as this owner label (default: $TPUCTL_OWNER, else your user name)")
@click.option("--buckets", is_flag=True, help="also delete buckets whose own TTL passed (they hold models)")
@click.option("--lock-wait", type=float, default=0.0, show_default=True,
              help="seconds to wait for another gc run to finish before skipping this one")
@click.option("--timeout", "timeout", default="15m", show_default=True,
              help="give up on a deletion that has not finished after this long (reported as failed)")
@click.option("--schedule", is_flag=True, help="print a crontab line and systemd units that run this gc")
@click.option("--install", is_flag=True, help="write the systemd units and install the crontab line")
@click.option("--every", default="10m", show_default=True, help="with --schedule/--install: how often gc runs")
@click.option("--yes", "-y", is_flag=True, help="delete without asking (a scheduled gc passes it)")
@_project
@_cloud
@click.option("--json", "as_json", is_flag=True, help="one JSON record per action on stdout")
@click.pass_context
def gc_command(ctx: click.Context, dry_run: bool, idle: str, budget: float | None, budget_per: str,
               all_owners: bool, owner: str | None, buckets: bool, lock_wait: float, timeout: str, schedule: bool, install: bool,
               every: str, yes: bool, project: str | None, cloud: str | None, as_json: bool) -> None:
    """Delete runs that outlived their purpose (the cleanup cron).

    A run goes when its TTL passed, its job finished, failed or was cancelled, it is idle, its TPU was
    preempted and nobody is recovering it, or it is over --budget. Never touches resources without tpuctl
    labels, nor other owners' runs unless --all-owners. Exit 0 all done, 1 some deletions failed, 2 bad input.
    """
    from tpuctl.provision import gc, labels

    idle_s = None if idle.strip().lower() in config.NEVER else cost.parse_duration(idle, field="idle")
    if budget is not None and not (math.isfinite(budget) and budget > 0):  # click's float takes nan and inf
        raise BadInput(f"budget {budget} is not a positive finite amount", field="budget",
                       hint="give USD, e.g. --budget 50")
    if budget is None and ctx.get_parameter_source("budget_per") is not click.core.ParameterSource.DEFAULT:
        raise BadInput(f"--budget-per {budget_per} applies --budget, which was not given", field="budget-per",
                       hint=f"add --budget USD, e.g. --budget 50 --budget-per {budget_per}")
    if all_owners and owner is not None:  # whose runs gc may delete: everyone's, or one owner's, not both
        raise BadInput(f"--owner {owner} acts on {owner}'s runs only, and --all-owners on everyone's",
                       field="owner", hint="give one of --owner and --all-owners")
    timeout_s = cost.parse_duration(timeout, field="timeout")
    if lock_wait < 0:
        raise BadInput("--lock-wait must be >= 0 seconds", field="lock-wait")
    if not (schedule or install) and ctx.get_parameter_source("every") is not click.core.ParameterSource.DEFAULT:
        raise BadInput(f"--every {every} sets how often a scheduled gc runs, and nothing is scheduled",
                       field="every", hint=f"add --schedule (print) or --install, e.g. gc --schedule --every {every}")
    if schedule or install:
        every_s = cost.parse_duration(every, field="every")
        argv = _scheduled_argv(ctx, settings(project=project, cloud=cloud, start_local=False).target)
        env = {k: os.environ[k] for k in _SCHEDULE_ENV if os.environ.get(k)}
        sched = gc.schedule(argv, every_s=every_s, log=paths.logs_dir() / "gc.log", env=env)
        if install:
            _install_schedule(sched)
        else:
            click.echo(f"# crontab (crontab -e):\n{sched.crontab_line}\n")
            click.echo(f"# ~/.config/systemd/user/tpuctl-gc.service\n{sched.service_unit}")
            click.echo(f"# ~/.config/systemd/user/tpuctl-gc.timer\n{sched.timer_unit}")
        return
    if not dry_run:
        console.can_confirm(yes=yes, to="let gc delete")
    clients = _clients(project, cloud)
    policy = gc.Policy(now=time.time(), owner=labels.label_value(owner) if owner else labels.owner(),
                       all_owners=all_owners, idle_s=idle_s, budget_usd=budget, budget_per=budget_per, buckets=buckets)

    def show(o) -> None:
        if as_json:
            console.emit_json_line(o.record())
        else:
            click.echo(_outcome_line(o))

    def ask(going) -> None:  # on a terminal only: --yes passes no callback
        for a in going:
            console.info(f"  {a.resource.kind.value} {a.resource.location}/{a.resource.name} run={a.run}: {a.why}")
        console.confirm(f"delete these {len(going)} resource(s)?", yes=yes, to="let gc delete",
                        nothing="nothing was deleted")

    result = gc.run(clients, policy, dry_run=dry_run, catalog=catalog_mod.load(), ledger=Ledger(),
                    lock=paths.gc_lock(), lock_wait_s=lock_wait, on_outcome=show, deadline_s=timeout_s,
                    confirm=None if yes else ask)
    if result.locked_out:
        console.note(f"gc: another tpuctl gc holds {paths.gc_lock()}; skipped this run")
        return
    api.close_timelines(clients, result, on_event=console.report)
    deleted = sum(1 for o in result.outcomes if o.ok and o.action.verdict == "delete")
    verb = "would delete" if dry_run else "deleted"
    console.info(f"gc: {result.scanned} tpuctl resources scanned, {verb} {deleted}, "
                 f"skipped {sum(1 for o in result.outcomes if o.action.verdict == 'skip')}, "
                 f"failed {len(result.failed)}")
    if result.failed:
        ctx.exit(1)


for _cmd in (catalog_group, cost_command, gc_command):
    _cmd.section = SECTION  # type: ignore[attr-defined]

commands = [catalog_group, cost_command, gc_command]
