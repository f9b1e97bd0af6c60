"""`tpuctl local ...`: start, inspect, break and stop the embedded local cloud.

The daemon runs at speed 20 by default: operations take 1/20 of their real latency (a TPU create ~9 s
instead of ~3 min) while the billing meter counts wall-clock seconds.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import click

from tpuctl import config, console, paths
from tpuctl.errors import BadInput, LocalCloudError
from tpuctl.local import DEFAULT_SPEED
from tpuctl.localcloud import daemon
from tpuctl.localcloud.core import FAULT_KINDS

SECTION = "Local cloud"

_state_dir_option = click.option(
    "--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
    help="where the local cloud keeps its state [default: $TPUCTL_HOME/localcloud]")


def _dir(state_dir: Path | None) -> Path:
    return state_dir if state_dir is not None else paths.localcloud_dir()


def _running(state_dir: Path) -> dict:
    info = daemon.status(state_dir)
    if info is None:
        raise LocalCloudError(f"no local cloud is running for {state_dir}", hint="start one with `tpuctl local start`")
    return info


def _admin(info: dict, method: str, path: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"{info['endpoint']}/_localcloud/{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        detail = json.loads(exc.read() or b"{}").get("error", exc.reason)
        if exc.code == 400:
            raise BadInput(str(detail), hint="see `tpuctl local fault --help`") from None
        raise LocalCloudError(f"the local cloud answered {exc.code}: {detail}") from None
    except OSError as exc:
        raise LocalCloudError(f"cannot reach the local cloud at {info['endpoint']}: {exc}") from None


def _idle_text(info: dict) -> str:
    from tpuctl.spec import format_duration

    idle = info.get("idle_stop_s") or 0
    return f"stops after {format_duration(idle)} idle" if idle else "never stops by itself"


@click.group("local")
def local_group() -> None:
    """The embedded local cloud (TPU, Compute, Storage emulation on 127.0.0.1).

    It runs operations 20x faster than Google Cloud by default (a TPU create takes ~9 s, not ~3 min);
    the billing meter still counts wall-clock seconds. See localcloud/README.md.
    """


@local_group.command("start")
@click.option("--speed", type=click.FloatRange(min=0, min_open=True), default=DEFAULT_SPEED, show_default=True,
              help="operations run this many times faster than on Google Cloud")
@click.option("--port", type=click.IntRange(0, 65535), default=0, help="API port [default: any free port]")
@click.option("--idle-stop", metavar="DURATION", default=None,
              help=f"stop after this long with no request and nothing billed; never (or off) to keep it "
                   f"[env TPUCTL_LOCAL_IDLE; default {config.LOCAL_IDLE_DEFAULT}]")
@click.option("--worker-python", type=click.Choice(["runtime", "host"]), default=None,
              help="what TPU workers run jobs with: the runtime image's TensorFlow and Keras, in a venv built once "
                   "per image (runtime, the default), or this interpreter (host)")
@_state_dir_option
def start_command(speed: float, port: int, idle_stop: str | None, worker_python: str | None,
                  state_dir: Path | None) -> None:
    """Start the local cloud in the background and print `export` lines for it."""
    sd = _dir(state_dir)
    idle_stop_s = config.local_idle_stop_s(idle_stop)
    try:
        info = daemon.start(sd, speed, port=port, idle_stop_s=idle_stop_s, worker_python=worker_python)
    except daemon.AlreadyRunning as exc:
        raise LocalCloudError(f"{exc}: `tpuctl local env` prints its settings", hint="") from None
    except daemon.DaemonError as exc:
        raise LocalCloudError(str(exc), hint="") from None
    console.info(f"local cloud running at {info['endpoint']} (storage {info['storage_host']}, speed {speed:g}x, "
                 f"state in {sd}, {_idle_text(info)})")
    for line in daemon.env_lines(info):
        click.echo(line)


@local_group.command("env")
@_state_dir_option
def env_command(state_dir: Path | None) -> None:
    """Print `export` lines that point tpuctl and the Google clients at the local cloud."""
    for line in daemon.env_lines(_running(_dir(state_dir))):
        click.echo(line)


@local_group.command("status")
@click.option("--json", "as_json", is_flag=True, help="print the full status as JSON")
@_state_dir_option
def status_command(as_json: bool, state_dir: Path | None) -> None:
    """Every live resource (with worker SSH endpoints) and the billing meter."""
    info = _running(_dir(state_dir))
    status = _admin(info, "GET", "status")
    if as_json:
        console.emit_json(status)
        return
    res = status["resources"]
    rows = []
    for n in res["nodes"]:
        ports = ",".join(str(w["port"]) for w in n["workers"])
        rows.append(("tpu", n["name"].rsplit("/", 1)[-1], n["zone"], n["state"], n["accelerator"], ports))
    for q in res["queued_resources"]:
        rows.append(("queued-resource", q["name"].rsplit("/", 1)[-1], q["zone"], q["state"], "", ""))
    for i in res["instances"]:
        ports = ",".join(str(w["port"]) for w in i["workers"])
        rows.append(("vm", i["name"], i["zone"], i["status"], i["machine_type"], ports))
    for m in res.get("instance_group_managers", []):
        rows.append(("instance-group", m["name"], m["location"], "", f"{len(m['instances'])}/{m['target_size']} vms", ""))
    for kind, key in (("instance-template", "instance_templates"), ("resource-policy", "resource_policies")):
        rows.extend((kind, r["name"], r["location"], "", "", "") for r in res.get(key, []))
    for b in res["buckets"]:
        rows.append(("bucket", b["name"], b.get("location", ""), "", f"{b.get('bytes', 0)} bytes", ""))
    console.info(f"local cloud at {status['endpoint']} (storage {status['storage_host']}, speed {status['speed']:g}x, "
                 f"{_idle_text(info)})")
    console.table(("kind", "name", "location", "state", "type", "ssh ports"), rows)
    console.info(f"metered so far: ${status['meter']['total_usd']:.4f} over {len(status['meter']['resources'])} resource(s)")
    if status["faults"]:
        console.info(f"active faults: {', '.join(f['kind'] + '(' + f['id'] + ')' for f in status['faults'])}")


@local_group.command("fault")
@click.argument("kind", type=click.Choice([*FAULT_KINDS, "list", "clear"]))
@click.option("--service", type=click.Choice(["tpu", "compute", "cloudresourcemanager", "cloudbilling"]),
              help="only calls to this API")
@click.option("--method", help="only these methods (glob), e.g. nodes.create, instances.*")
@click.option("--zone", help="only this zone")
@click.option("--count", type=click.IntRange(min=1), help="fire this many times, then disappear")
@click.option("--probability", type=click.FloatRange(0, 1), help="fire with this probability per matching call")
@click.option("--seed", type=int, help="seed for --probability")
@click.option("--quota", help="quota name a quota fault reports")
@click.option("--code", type=click.Choice(["8", "9", "13"]),
              help="capacity: the create operation's error code (8 no capacity, 9 reservation, 13 internal)")
@click.option("--details/--no-details", default=None, help="quota (TPU): send google.rpc.QuotaFailure details")
@click.option("--in-operation", is_flag=True, default=None, help="quota (Compute): fail the insert operation, not the request")
@click.option("--state", type=click.Choice(["REPAIRING", "RESTARTING"]), help="repair: the state the node passes through")
@click.option("--seconds", type=click.FloatRange(min=0), help="repair: simulated seconds under maintenance [default: 120]")
@click.option("--node", help="preempt / kill-worker / drop-ssh: the TPU node or VM name")
@click.option("--worker", type=click.IntRange(min=0), help="kill-worker: the worker index")
@click.option("--after", type=click.FloatRange(min=0), help="preempt: seconds from now")
@click.option("--field", help="odd-response: the response field to leave out (dotted, e.g. networkEndpoints)")
@click.option("--empty", is_flag=True, default=None, help="odd-response: answer the field as an empty list instead")
@_state_dir_option
def fault_command(kind: str, state_dir: Path | None, after: float | None, **options) -> None:
    """Inject a fault (capacity, quota, unavailable, stuck, preempt, kill-worker, drop-ssh, repair,
    no-guest-attributes, preempt-creating, odd-response); `list`; `clear`."""
    info = _running(_dir(state_dir))
    if kind == "list":
        console.emit_json(_admin(info, "GET", "faults")["faults"])
        return
    if kind == "clear":
        cleared = _admin(info, "DELETE", "faults")["cleared"]
        console.info(f"cleared {cleared} fault(s)")
        return
    body = {k: v for k, v in options.items() if v is not None}
    if "code" in body:
        body["code"] = int(body["code"])
    if kind in ("preempt", "kill-worker", "drop-ssh", "repair") and not body.get("node"):
        raise BadInput(f"fault {kind} needs the node it acts on", field="node", hint=f"tpuctl local fault {kind} --node NAME")
    if kind == "preempt":
        result = _admin(info, "POST", "preempt", {"node": body["node"], "after": after})
        console.info(f"preempting {body['node']}" + (f" in {after:g} s" if after else " now"))
        console.emit_json(result)
        return
    result = _admin(info, "POST", "faults", {"kind": kind, **body})
    console.emit_json(result["fault"])


@local_group.command("stop")
@_state_dir_option
def stop_command(state_dir: Path | None) -> None:
    """Stop the local cloud (its state stays in the state dir for the next start). Idempotent."""
    sd = _dir(state_dir)
    try:
        info = daemon.stop(sd)
    except daemon.NotRunning as exc:
        console.info(f"{exc}: nothing to stop")
        return
    console.info(f"stopped the local cloud at {info['endpoint']} (pid {info['pid']})")


local_group.section = SECTION  # type: ignore[attr-defined]
commands = [local_group]
