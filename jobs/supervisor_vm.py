"""The supervisor of a detached run: a small Compute Engine VM that runs the run's pipeline when the laptop is gone.

`tpuctl run SPEC --detach` creates it in parallel with the TPU (`create`), labelled like every resource of the run
plus `tpuctl-role=supervisor`, so `status`, `cost`, `down` and `gc` see it as theirs. Once the job is launched the
laptop uploads a wheel of the tpuctl it runs (`build_wheel`) and a hand-off record to the run's bucket
(`hand_over`) and returns when the supervisor's heartbeat says it took over. The VM's startup script
(`startup_script`) installs that wheel and runs `python3 -m tpuctl.jobs.supervisor_vm serve ...` as a service
that restarts when it dies (a systemd unit on Google; a restart loop on the local cloud, whose VMs are processes):
`serve` attaches to the run exactly as `tpuctl run --attach` does (watch, recover, collect, tear down), writes
a heartbeat to the bucket, and deletes its own VM when the run has ended. A supervisor whose heartbeat stopped is
`gc`'s (`stale`).

Bucket objects, under gs://BUCKET/runs/RUN/supervisor/: the wheel, `handoff.json` (what the laptop asks of
the supervisor), `heartbeat.json` (who supervises, and when it last said so).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import os
import shlex
import sys
import threading
import time
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tpuctl import events as ev
from tpuctl.errors import NotFound, TpuctlError

if TYPE_CHECKING:
    from tpuctl.provision import Clients, Plan, Resource

SUFFIX = "-supervisor"
# The packages of the tpuctl distribution (pyproject.toml [tool.setuptools] packages): subpackages ride along.
_PACKAGES = ("tpuctl", "tpuctl.jobs", "tpuctl.provision", "tpuctl.templates", "tpuctl.localcloud")
# Memory of the general-purpose machine types the catalog prices, in GB (cloud.google.com/compute/docs/
# general-purpose-machines: E2 shared-core e2-micro 1 GB, e2-small 2 GB, e2-medium 4 GB; e2-standard 4 GB per
# vCPU; N1 standard 3.75 GB per vCPU; N2 standard 4 GB per vCPU).
MEMORY_GB = {"e2-micro": 1, "e2-small": 2, "e2-medium": 4, "e2-standard-2": 8, "e2-standard-4": 16,
             "e2-standard-8": 32, "e2-standard-16": 64, "n1-standard-1": 3.75, "n1-standard-2": 7.5,
             "n1-standard-4": 15, "n1-standard-8": 30, "n2-standard-2": 8, "n2-standard-4": 16, "n2-standard-8": 32}
# What the supervisor needs (inferred): pip installing the Google clients and a pipeline process that imports
# them (measured here: about 250 MB resident) next to Debian's own services; e2-micro's 1 GB leaves too little.
MIN_MEMORY_GB = 2
DISK_GB = 10  # the smallest boot disk of Google's Debian images
IMAGE = "projects/debian-cloud/global/images/family/debian-12"


def heartbeat_s(local: bool) -> float:
    """How often the supervisor says it is alive (the local cloud's runs last seconds, Google's days)."""
    return 1.0 if local else 30.0


def takeover_deadline_s(local: bool) -> float:
    """How long the laptop waits for the supervisor's first heartbeat: boot, pip install (Google: minutes)."""
    return 120.0 if local else 900.0


def stale_after_s(local: bool) -> float:
    """A heartbeat this old means the supervisor is gone (many missed beats: a restart takes one or two)."""
    return 20 * heartbeat_s(local)


def vm_name(run: str) -> str:
    return f"{run}{SUFFIX}"


def prefix(run: str) -> str:
    return f"runs/{run}/supervisor/"


def machine_type(catalog) -> str:
    """The cheapest machine type the catalog prices that has the memory the supervisor needs."""
    fits = [t for t in catalog.vm_machine_types() if MEMORY_GB.get(t, 0) >= MIN_MEMORY_GB]
    return min(fits, key=lambda t: catalog.vm_price_per_hour(t, "us-central1"))


def check(plan: Plan) -> None:
    """BadInput before anything is created when the supervisor's VM name would not be a valid instance name."""
    from tpuctl.provision import labels

    labels.check_name(vm_name(plan.run), field="name")


def price_per_hour(plan: Plan, catalog) -> float:
    from tpuctl.catalog import region_of

    return catalog.vm_price_per_hour(machine_type(catalog), region_of(plan.zones[0]))


# --- the wheel ------------------------------------------------------------------------------------------

def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _sources() -> dict[str, Path]:
    """Each file of the installed tpuctl by its path in a wheel (an editable install maps the repo's folders
    onto tpuctl.*, a regular one has them nested under tpuctl/ already)."""
    files: dict[str, Path] = {}
    for package in _PACKAGES:
        found = importlib.util.find_spec(package)
        for root in (found.submodule_search_locations or []) if found else []:
            base = Path(root)
            for path in sorted(base.rglob("*")):
                if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                    files.setdefault("/".join((*package.split("."), *path.relative_to(base).parts)), path)
    return files


def build_wheel(directory: Path) -> Path:
    """A py3-none-any wheel of the tpuctl this process runs, its requirements included, in `directory`.
    Deterministic (sorted, fixed times): the same tpuctl makes the same bytes, so it is uploaded once."""
    version = importlib.metadata.version("tpuctl")
    meta = importlib.metadata.metadata("tpuctl")
    dist = f"tpuctl-{version}.dist-info"
    entries = {name: path.read_bytes() for name, path in sorted(_sources().items())}
    entries[f"{dist}/METADATA"] = "".join(
        ["Metadata-Version: 2.1\n", "Name: tpuctl\n", f"Version: {version}\n",
         *(f"Requires-Dist: {r}\n" for r in meta.get_all("Requires-Dist") or [])]).encode()
    entries[f"{dist}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: tpuctl\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    entries[f"{dist}/entry_points.txt"] = b"[console_scripts]\ntpuctl = tpuctl.cli:main\n"
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in entries.items())
    entries[f"{dist}/RECORD"] = (record + f"{dist}/RECORD,,\n").encode()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in entries.items():
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            z.writestr(info, data, zipfile.ZIP_DEFLATED)
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"tpuctl-{version}-py3-none-any.whl"
    wheel.write_bytes(out.getvalue())
    return wheel


# --- the VM ---------------------------------------------------------------------------------------------

# Fetches one object of the run's bucket with the Python standard library only (a fresh Debian image has
# python3 but none of tpuctl's requirements): the VM's service account token from its metadata server
# (compute/docs/access/authenticate-workloads#applications), the object from Cloud Storage's JSON API
# (`alt=media`, storage/docs/json_api/v1/objects/get); GCE_METADATA_HOST and STORAGE_EMULATOR_HOST, the
# variables google-auth and google-cloud-storage honour, point both elsewhere on the local cloud. Waits for the
# object: the VM boots while the TPU is still being made, before the laptop uploads the wheel.
_FETCH = r'''
import json, os, sys, time, urllib.error, urllib.parse, urllib.request
bucket, name, dest, deadline = sys.argv[1], sys.argv[2], sys.argv[3], time.monotonic() + float(sys.argv[4])
meta = os.environ.get("GCE_METADATA_HOST", "metadata.google.internal")
storage = os.environ.get("STORAGE_EMULATOR_HOST", "https://storage.googleapis.com").rstrip("/")
delay = 1.0
while True:
    headers = {}
    try:
        req = urllib.request.Request(f"http://{meta}/computeMetadata/v1/instance/service-accounts/default/token",
                                     headers={"Metadata-Flavor": "Google"})
        headers["Authorization"] = "Bearer " + json.load(urllib.request.urlopen(req, timeout=10))["access_token"]
    except (OSError, ValueError, KeyError):
        pass
    url = f"{storage}/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}?alt=media"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as resp:
            data = resp.read()
        with open(dest, "wb") as f:
            f.write(data)
        sys.exit(0)
    except OSError as exc:
        if time.monotonic() > deadline:
            sys.exit(f"gs://{bucket}/{name}: {exc}")
    time.sleep(delay)
    delay = min(delay * 1.5, 5.0)
'''


def startup_script(*, run: str, bucket: str, zone: str, wheel: str, env: dict[str, str], wait_s: float) -> str:
    """The supervisor VM's startup script: fetch and install the wheel, then run `serve` as a service that is
    restarted when it exits (systemd on Google, `Restart=always`; on the local cloud, whose VMs are processes
    with no init, a loop in this script: the localcloud VM environment names itself with TPUCTL_LOCALCLOUD)."""
    name = vm_name(run)
    q = shlex.quote
    exports = "".join(f"export {k}={q(v)}\n" for k, v in sorted(env.items()))
    serve = f"python3 -m tpuctl.jobs.supervisor_vm serve {q(run)} {q(bucket)} {q(name)} {q(zone)}"
    unit_env = " ".join(f"{k}={v}" for k, v in sorted(env.items()))
    return f"""#!/bin/bash
# tpuctl: the supervisor of run {run} (README "Runs that last days"). Written by `tpuctl run --detach`.
set -u
{exports}D="${{HOME:-/root}}/tpuctl-supervisor"
mkdir -p "$D"
export TPUCTL_HOME="$D/home" PYTHONPATH="$D/site"
WHEEL="$D/{wheel}"
python3 -c {q(_FETCH)} {q(bucket)} {q(prefix(run) + wheel)} "$WHEEL" {wait_s:.0f} || exit 1
python3 -m pip --version >/dev/null 2>&1 || {{ apt-get update -qq && apt-get install -y -qq python3-pip; }}
PIP="python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location --upgrade --target $D/site"
$PIP --no-deps "$WHEEL" || exit 1
# The image's python may carry tpuctl's requirements already (a custom image; the local cloud's interpreter);
# else pip fetches them (egress to PyPI, README).
python3 -m tpuctl.jobs.supervisor_vm check || $PIP "$WHEEL" || exit 1
if [ -z "${{TPUCTL_LOCALCLOUD:-}}" ] && [ -d /run/systemd/system ]; then
  cat > /etc/systemd/system/tpuctl-supervisor.service <<UNIT
[Unit]
Description=tpuctl supervisor of run {run}
After=network-online.target
[Service]
Environment={unit_env} TPUCTL_HOME=$D/home PYTHONPATH=$D/site HOME=$D
ExecStart=/usr/bin/{serve}
Restart=always
RestartSec=5
[Install]
WantedBy=multi-user.target
UNIT
  systemctl daemon-reload && systemctl enable --now tpuctl-supervisor.service
  exit $?
fi
while true; do
  {serve} >> "$D/supervisor.log" 2>&1
  sleep 2
done
"""


def settings_env(clients: Clients) -> dict[str, str]:
    """What the supervisor needs to reach the run's cloud: the project, and the local cloud's endpoint (on
    Google the APIs' own hosts and the VM's service account, from its metadata server)."""
    env = {"TPUCTL_PROJECT": clients.project}
    if clients.local and clients.endpoint:
        env["TPUCTL_API_ENDPOINT"] = clients.endpoint
    else:
        env["TPUCTL_CLOUD"] = "gcp"
    return env


def create(clients: Clients, plan: Plan, zone: str, *, service_account: str, cancel: threading.Event | None = None,
           progress=None, deadline_s: float = 900.0) -> Resource:
    """Create (or adopt) the run's supervisor VM in `zone` (the TPU's region); blocks until RUNNING. Its
    startup script waits for the wheel, so it can boot before the job is launched."""
    from tpuctl import catalog as catalog_mod
    from tpuctl.provision import labels, vm
    from tpuctl.provision.network import Network

    name = vm_name(plan.run)
    wheel = f"tpuctl-{importlib.metadata.version('tpuctl')}-py3-none-any.whl"
    script = startup_script(run=plan.run, bucket=plan.bucket, zone=zone, wheel=wheel, env=settings_env(clients),
                            wait_s=3 * takeover_deadline_s(clients.local) + 3600)
    req = vm.VmRequest(name=name, zone=zone, machine_type=machine_type(catalog_mod.load()), disk_gb=DISK_GB,
                       image=IMAGE, labels={**plan.labels, labels.ROLE: labels.SUPERVISOR}, service_account=service_account,
                       network=Network.of_plan(plan), metadata={"startup-script": script})
    return vm.create(clients, req, deadline_s=deadline_s, cancel=cancel,
                     progress=(lambda state, detail: progress(f"vm/{zone}/{name}", state.value, detail))
                     if progress else None)


# --- the hand-off (laptop) ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Heartbeat:
    vm: str
    zone: str
    at: float  # unix seconds
    state: str  # waiting (for the hand-off) | supervising | ended
    handoff: str | None  # the hand-off it took over
    tpuctl: str  # where the tpuctl it runs was imported from
    pid: int

    @classmethod
    def read(cls, clients: Clients, bucket: str, run: str) -> Heartbeat | None:
        from . import cluster

        doc = cluster.read_json(clients, bucket, prefix(run) + "heartbeat.json")
        return None if doc is None else cls(**{k: doc.get(k) for k in cls.__dataclass_fields__})


def upload_wheel(clients: Clients, run: str, bucket: str) -> str:
    """Put the wheel where the supervisor's startup script waits for it; as soon as the bucket exists, so the VM
    installs it while the job is shipped and launched. Its gs:// URL."""
    from tpuctl import paths

    wheel = build_wheel(paths.home() / "wheels")
    blob = clients.storage.bucket(bucket).blob(prefix(run) + wheel.name)
    blob.upload_from_filename(str(wheel), content_type="application/octet-stream")
    return f"gs://{bucket}/{blob.name}"


def hand_over(clients: Clients, run: str, bucket: str, *, options: dict, on_event: ev.EventSink = ev.ignore,
              cancel: threading.Event | None = None) -> Heartbeat:
    """Write the hand-off record (the wheel is uploaded: `upload_wheel`), then wait (deadline, backoff) for the
    supervisor's heartbeat naming this hand-off. Raises WaitTimeout when it never comes (the caller tears the
    run down)."""
    from tpuctl.provision import waits

    from . import cluster

    handoff = {"id": uuid.uuid4().hex, "at": time.time(), **options}
    cluster.write_json(clients, bucket, prefix(run) + "handoff.json", handoff)
    on_event(ev.Note(f"handing run {run} to its supervisor VM {vm_name(run)}"))

    def seen() -> tuple[bool, Heartbeat | None]:
        beat = Heartbeat.read(clients, bucket, run)
        return beat is not None and beat.handoff == handoff["id"] and beat.state == "supervising", beat

    return waits.until(seen, what=f"the supervisor of run {run} to take over",
                       deadline_s=takeover_deadline_s(clients.local), cancel=cancel)


def stale(clients: Clients, bucket: str, run: str, *, now: float | None = None) -> bool:
    """Whether the run's supervisor stopped beating (gc takes such a run over, or cleans it up). A run with no
    heartbeat at all is not stale: it was never handed over, and its laptop may still be handing it over."""
    try:
        beat = Heartbeat.read(clients, bucket, run)
        at = float(beat.at) if beat is not None else None
    except (TpuctlError, ValueError, TypeError, AttributeError):  # unreadable: it decides nothing (gc goes on)
        return False
    now = time.time() if now is None else now
    return at is not None and now - at > stale_after_s(clients.local)


def live(clients: Clients, run: str) -> tuple[str, Heartbeat] | None:
    """The run's bucket and its supervisor's heartbeat, when a supervisor is watching the run now."""
    from tpuctl import provision

    bucket = next((r.name for r in provision.list_resources(clients, run) if r.kind is provision.Kind.BUCKET), None)
    beat = Heartbeat.read(clients, bucket, run) if bucket else None
    if beat is None or beat.state != "supervising" or stale(clients, bucket, run):
        return None
    return bucket, beat


def follow(clients: Clients, run: str, bucket: str, *, poll_s: float, on_event: ev.EventSink = ev.ignore,
           cancel: threading.Event | None = None):
    """Watch a supervised run from its status record until it ends (the supervisor recovers and tears down;
    watching changes nothing): each new step is a Note. Returns the final status record."""
    from . import cluster

    seen = None
    while cancel is None or not cancel.is_set():
        status = cluster.read_status(clients, bucket, run)
        if status is not None and (status.step, status.recovering) != seen:
            seen = (status.step, status.recovering)
            on_event(ev.Note(f"run {run}: {status.state}" + (f", step {status.step}" if status.step else "")
                             + (", recovering" if status.recovering else "")))
        if status is not None and status.final:
            return status
        time.sleep(poll_s)
    return None


# --- the service (on the VM) ----------------------------------------------------------------------------

class _Beat:
    """Writes heartbeat.json every heartbeat_s from a thread of its own, so a long recovery still beats."""

    def __init__(self, clients: Clients, run: str, bucket: str, vm: str, zone: str) -> None:
        self.clients, self.run, self.bucket = clients, run, bucket
        self.doc = {"vm": vm, "zone": zone, "state": "waiting", "handoff": None, "pid": os.getpid(),
                    "tpuctl": str(Path(sys.modules["tpuctl"].__file__).parent)}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="supervisor-heartbeat", daemon=True)

    def set(self, **fields) -> None:
        self.doc.update(fields)
        self.write()

    def write(self) -> None:
        from . import cluster

        try:
            cluster.write_json(self.clients, self.bucket, prefix(self.run) + "heartbeat.json",
                               {**self.doc, "at": time.time()})
        except TpuctlError as exc:  # the bucket may be gone (--delete-bucket); the next beat tries again
            print(f"heartbeat: {exc}", file=sys.stderr, flush=True)

    def _loop(self) -> None:
        while not self.stop.wait(heartbeat_s(self.clients.local)):
            self.write()


def _log(event: ev.Event) -> None:
    print(json.dumps({"type": event.type, **{k: str(v) for k, v in event.__dict__.items()}}), flush=True)


def serve(run: str, bucket: str, vm: str, zone: str) -> int:
    """The supervisor: wait for the hand-off, attach to the run (the pipeline's watch, recover, collect and
    tear down, sparing this VM), then delete this VM. Run again after a crash, it attaches again; a run that
    has ended is only cleaned up."""
    from tpuctl import config, provision
    from tpuctl.provision import waits
    from tpuctl.provision.plan import from_record

    from . import cluster
    from .pipeline import Pipeline, RunOptions, RunState

    clients = provision.connect(config.settings(on_event=_log))
    beat = _Beat(clients, run, bucket, vm, zone)
    beat.write()
    beat.thread.start()
    handoff = waits.until(lambda: (True, doc) if (doc := cluster.read_json(clients, bucket, prefix(run) + "handoff.json"))
                          else (False, None), what=f"the hand-off of run {run}", deadline_s=3600.0)
    beat.set(state="supervising", handoff=handoff["id"])
    status = cluster.read_status(clients, bucket, run)
    if status is None or not status.final:
        options = RunOptions(attach=run, yes=True, poll_s=float(handoff.get("poll_s", 2.0)),
                             delete_bucket=bool(handoff.get("delete_bucket")), export=tuple(handoff.get("export", ())),
                             spare=(f"{provision.Kind.VM.value}/{zone}/{vm}",))
        # The resolved plan (hand_over): a TPU Google deleted while no supervisor ran is made again from it.
        plan = from_record(handoff["plan"]) if handoff.get("plan") else None
        pipeline = Pipeline(clients, options=options, on_event=_log, plan=plan)
        try:
            pipeline.attach()
        except TpuctlError as exc:
            if pipeline.state is RunState.ATTACH and not isinstance(exc, NotFound):
                raise  # the run's records could not be read (yet): the service starts this again
            # The run's own end (the job failed, recovery gave up (max recoveries, an ended flex-start TPU); torn
            # down), or, from a hand-off without a plan, a run with no TPU left: nothing to supervise any more.
            print(f"run {run}: {exc}", file=sys.stderr, flush=True)
            now = cluster.read_status(clients, bucket, run)
            if now is not None and not now.final:  # a job that failed closed it already, saying how
                cluster.close_status(clients, bucket, run, state="failed", on_event=_log,
                                     ended="supervisor_found_no_tpu" if pipeline.state is RunState.ATTACH
                                     else "supervisor_gave_up")
    beat.stop.set()
    beat.set(state="ended")
    # Last: whatever of the run is left (this VM included). The process dies with its VM.
    provision.down(clients, run, delete_bucket=bool(handoff.get("delete_bucket")))
    return 0


# What the supervisor imports of tpuctl's requirements (pyproject.toml `dependencies`), by module.
_REQUIRED = ("click", "rich", "pydantic", "yaml", "google.cloud.tpu_v2", "google.cloud.compute_v1",
             "google.cloud.storage", "google.cloud.resourcemanager_v3", "google.cloud.billing_v1",
             "google.cloud.oslogin_v1", "google.cloud.service_usage_v1", "asyncssh")


def check_requirements() -> int:
    """Exit 0 when this interpreter has tpuctl's requirements: found, not imported (seconds on a small VM)."""
    missing = []
    for module in _REQUIRED:
        try:
            found = importlib.util.find_spec(module)
        except ImportError:
            found = None
        if found is None:
            missing.append(module)
    if missing:
        print(f"missing: {', '.join(missing)}", file=sys.stderr)
    return 1 if missing else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["check"]:
        return check_requirements()
    if argv[:1] == ["serve"] and len(argv) == 5:
        return serve(*argv[1:])
    print("usage: python -m tpuctl.jobs.supervisor_vm check | serve RUN BUCKET VM ZONE", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
