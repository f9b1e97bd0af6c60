"""Seeded chaos runner: random run shapes and fault schedules against ONE local cloud, then the invariants.

    .venv/bin/python bench/chaos.py --scenarios 200 --seed 1
    .venv/bin/python bench/chaos.py --each-fault-once --shape v3-8 --seed 3 --without detached   # CI's slice

Each scenario picks a shape (single/multi-host, on-demand/spot/queued) and one fault schedule (capacity in
some zones, 429 storms, 503s, operations that never finish, preemption mid-job, worker death, SSH drops,
SIGINT/SIGTERM/kill -9 of `tpuctl up` or `tpuctl run` at a random phase; Google's own shapes: stockouts as
code 9 and 13, a bare TPU 429 and Compute's 403 quota, host maintenance mid-job, guest attributes empty or
failing, a teammate's metadata update in flight (409), OS Login projects, a project with no TPU quota), and
answers tpuctl does not expect (localcloud's `odd-response`: a create whose operation has no name, a node
with an empty endpoint list), and detached runs (`tpuctl run --detach`: the supervisor VM killed mid-run, the spot
TPU preempted; the run must end by itself), then cleans up with `down` or `gc`.
Afterwards it checks, from the local cloud's own inventory (`/_localcloud/status`):

- leaked: a tpuctl resource of the scenario's run still present after the scenario's cleanup, or (after an
  exit 130, or a `tpuctl up` that failed) a resource the command promised to remove before any cleanup ran;
- lost checkpoints: a checkpoint object seen in the bucket during the job missing at the end, or a resumed
  job restoring a step below the last checkpoint it had written (the step count went backwards);
- wrong exit codes: the exit code (0 ok/recovered, 1 an unexpected answer, 2 refused by the preflight, 3
  capacity or quota, 130 interrupted, -9 killed) or the error line does not match the injected fault. A create that never finishes, or a queued resource waiting for
  capacity, is the user pressing Ctrl-C 1-3 s in (exit 130).

The last four lines are `leaked: N`, `lost checkpoints: N`, `wrong exit codes: N`, `scenarios: N`; before them,
when a job was preempted, `steps lost per preemption: median M, worst W`: the preempted job's periodic
checkpoints lie beyond its end, so it resumes from the notice's save, and a step it trained before the
preemption that the resumed job trains again is lost (each preempt-mid-job line shows its `steps_lost=N`).
A checkpoint the agent rotated away once a newer one was in the bucket is not a lost checkpoint.

Provisioning is always a real `tpuctl up SPEC --yes` process and every job scenario a real `tpuctl run SPEC
--yes` process (exit codes and error lines are the CLI's own; recovery from preemption, worker death and SSH
drops is `tpuctl run`'s). Cleanup is `provision.down` or one `gc.run` pass with the TTL passed.
The job is the fast stand-in from tests/job_templates/standin, not BERT.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
# The local-cloud stack, `tpuctl up` / `tpuctl run` processes and the stand-in job, shared with the tests.
from cloud_stack import (PROJECT, STANDIN, Stack, child_env, cleanup, error_line, run_command, up,  # noqa: E402
                         up_command, write_spec)

# Exit codes as the README documents them; -9 is the kill itself.
EXIT = {"ok": 0, "failure": 1, "bad-input": 2, "capacity": 3, "interrupted": 130, "killed": -signal.SIGKILL}

# Shapes: (accelerator, zones in failover order, hosts). Zones come from the catalog's offerings.
SHAPES = (
    ("v3-8", ("us-central1-a", "us-central1-b"), 1),
    ("v2-8", ("us-central1-b", "us-central1-c"), 1),
    ("v4-16", ("us-central2-b",), 2),
    ("v5litepod-16", ("us-east5-a", "us-east5-b"), 2),
)
PROVISIONING = ("on-demand", "spot", "queued")
FAULTS = ("none", "capacity-first-zone", "capacity-all-zones", "429-storm", "503s", "stuck-create",
          "preempt-mid-job", "kill-worker", "drop-ssh", "sigint", "sigterm", "kill9",
          # Google's own shapes (localcloud/README.md "Faults"): stockouts as code 9 and 13, a bare 429 and
          # Compute's 403 quota, host maintenance mid-job, guest attributes answering nothing or failing.
          "stockout-9", "stockout-13", "quota-429-bare", "quota-403", "repair-mid-job", "guest-attrs",
          # Another writer's metadata update in flight when `tpuctl run` adds its SSH key (409), and projects
          # with OS Login on: usable (the job logs in as the OS Login user) or with 2FA (refused before `up`).
          "metadata-409", "oslogin", "oslogin-2fa",
          # A project whose TPU quota is 0 in every zone: the preflight refuses before creating anything.
          "tpu-quota",
          # A Spot create whose capacity is reclaimed while CREATING (code 3): failed over as a stockout.
          "preempt-creating",
          # Well-formed answers tpuctl does not expect (localcloud's test device `odd-response`).
          "odd-response",
          # `tpuctl run --detach`: the laptop's process exits, the supervisor VM is killed mid-run (its service
          # restarts it) and the spot TPU is preempted; the run must still end and leave nothing running.
          "detached")
# Faults that need a running job (and, for preemption, a spot node).
JOB_FAULTS = ("none", "preempt-mid-job", "kill-worker", "drop-ssh", "repair-mid-job", "guest-attrs",
              "metadata-409", "oslogin")
STOCKOUT_CODES = {"stockout-9": 9, "stockout-13": 13}
SIGNALS = {"sigint": signal.SIGINT, "sigterm": signal.SIGTERM, "kill9": signal.SIGKILL}


# ---------------------------------------------------------------------------------------------- the job

@dataclass
class JobRecord:
    """What a scenario observed of its job: checkpoints seen in the bucket, steps restored after a fault."""

    checkpoints_seen: set[str] = field(default_factory=set)
    last_checkpoint_step: int = 0
    restored: list[tuple[int, int]] = field(default_factory=list)  # (last checkpoint step before, step restored)
    # The last step worker 0 trained before the fault, from its log in the bucket (the agent syncs it at the
    # preemption notice), until the resumed job's log replaces it.
    reached: int = 0

    @property
    def steps_lost(self) -> int | None:
        """Steps trained before the fault that the resumed job trains again (None: it did not resume, or the
        preempted job's log was never seen)."""
        return max(0, self.reached - self.restored[0][1]) if self.restored and self.reached else None


def _ckpt_step(name: str) -> int | None:
    m = re.search(r"ckpt-(\d+)\.json$", name)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------------------------------------- scenarios

@dataclass
class Outcome:
    index: int
    shape: str
    provisioning: str
    fault: str
    cleanup: str
    exit_code: int | None
    expected: tuple[int, ...]
    message: str = ""
    message_ok: bool = True
    leaked: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    seconds: float = 0.0
    steps_lost: int | None = None  # preempt-mid-job: steps the preemption cost (JobRecord.steps_lost)

    @property
    def wrong_exit(self) -> bool:
        return self.exit_code not in self.expected or not self.message_ok

    def line(self) -> str:
        flags = []
        if self.leaked:
            flags.append(f"LEAKED {self.leaked}")
        if self.lost:
            flags.append(f"LOST {self.lost}")
        if self.wrong_exit:
            flags.append(f"WRONG EXIT {self.exit_code} (expected {self.expected}) {self.message[:160]!r}")
        lost = "" if self.steps_lost is None else f"steps_lost={self.steps_lost} "
        return (f"#{self.index:03d} {self.shape:6s} {self.provisioning:9s} {self.fault:19s} cleanup={self.cleanup:4s} "
                f"exit={self.exit_code} {self.seconds:5.1f}s {lost}" + ("; ".join(flags) or "ok"))


@dataclass(frozen=True)
class Scenario:
    index: int
    accelerator: str
    zones: tuple[str, ...]
    hosts: int
    provisioning: str
    fault: str
    cleanup: str  # "down" | "gc"
    phase: float  # signal faults: seconds after start, or a fraction of the job for job faults
    storm: int  # 429/503 count
    command: str = "up"  # which process a signal hits: "up", or "run" (any phase: creating, training, teardown)

    @property
    def waits_forever(self) -> bool:
        """A create that never finishes, or a queued resource waiting for capacity that never comes (queued
        resources wait rather than fail over): the user gives up with Ctrl-C."""
        return self.fault == "stuck-create" or (self.provisioning == "queued" and self.fault.startswith("capacity"))

    @property
    def uses_run(self) -> bool:
        """Job faults, and half the signal faults, exercise a whole `tpuctl run` rather than `tpuctl up`."""
        return self.fault in JOB_FAULTS or (self.fault in SIGNALS and self.command == "run")

    @property
    def odd_create(self) -> bool:
        """odd-response: the create is answered without its operation's name (else a node's endpoints are an
        empty list once)."""
        return self.phase < 0.5

    @property
    def run(self) -> str:
        return f"chaos-{self.index:03d}-{self.fault.split('-')[0][:5]}"


def pick(rng: random.Random, index: int, faults: tuple[str, ...] = FAULTS, shapes: tuple = SHAPES) -> Scenario:
    accelerator, zones, hosts = rng.choice(shapes)
    fault = rng.choice(faults)
    provisioning = rng.choice(PROVISIONING)
    if fault in ("preempt-mid-job", "preempt-creating", "detached"):
        provisioning = "spot"  # only spot/preemptible nodes are preempted (a queued one here is on-demand)
    if fault == "capacity-first-zone" and len(zones) == 1:
        fault = "capacity-all-zones"
    if fault in STOCKOUT_CODES or fault.startswith("quota-"):
        provisioning = rng.choice(("on-demand", "spot"))  # a queued resource waits for capacity instead
    return Scenario(index=index, accelerator=accelerator, zones=zones, hosts=hosts, provisioning=provisioning,
                    fault=fault, cleanup=rng.choice(("down", "gc")), phase=rng.random(), storm=rng.randint(1, 4),
                    command=rng.choice(("up", "run")))


def expected_exit(s: Scenario) -> tuple[int, ...]:
    if s.waits_forever:
        return (EXIT["interrupted"],)
    if s.fault == "capacity-all-zones" or s.fault.startswith("quota-"):
        return (EXIT["capacity"],)
    if (s.fault in STOCKOUT_CODES or s.fault == "preempt-creating") and len(s.zones) == 1:
        return (EXIT["capacity"],)
    if s.fault == "429-storm" and s.storm >= _quota_attempts():
        # The local cloud's 429 names the quota it hit; tpuctl's contract retries such a 429 a fixed number of
        # times and then reports the quota (exit 3) instead of waiting out a limit that will not lift.
        return (EXIT["capacity"],)
    if s.fault in ("sigint", "sigterm"):
        # A signal landing after the child finished its work lets it exit 0; one landing before the child
        # installed its handler is the plain signal. Both are legitimate for a random phase.
        return (EXIT["interrupted"], EXIT["ok"])
    if s.fault == "kill9":
        return (EXIT["killed"], EXIT["ok"])
    if s.fault == "oslogin-2fa":
        return (EXIT["bad-input"],)  # the preflight refuses before creating anything
    if s.fault == "tpu-quota":
        return (EXIT["capacity"],)  # the preflight refuses (quota, exit 3) before creating anything
    if s.fault == "odd-response" and s.odd_create:
        return (EXIT["failure"],)  # the client's operation poll raises; `up` rolls back and says so in one line
    return (EXIT["ok"],)


def _quota_attempts() -> int:
    from tpuctl.provision.waits import QUOTA_ATTEMPTS

    return QUOTA_ATTEMPTS


_MESSAGES = {
    "429-storm": re.compile(r"quota", re.IGNORECASE),
    "capacity-all-zones": re.compile(r"capacity", re.IGNORECASE),
    "stockout-9": re.compile(r"capacity", re.IGNORECASE),
    "stockout-13": re.compile(r"capacity", re.IGNORECASE),
    "preempt-creating": re.compile(r"capacity", re.IGNORECASE),
    "quota-429-bare": re.compile(r"quota", re.IGNORECASE),
    "quota-403": re.compile(r"quota", re.IGNORECASE),
    "oslogin-2fa": re.compile(r"enable-oslogin-2fa"),
    "tpu-quota": re.compile(r"tpu-quota: .* needs \d+ of quota TPU\w+ForTPUAPI"),
    "odd-response": re.compile(r"^error: unexpected \w+: .*removed what this run created"),
    "sigint": re.compile(r"interrupt", re.IGNORECASE),
    "sigterm": re.compile(r"interrupt", re.IGNORECASE),
}


def _settle(stack: Stack, run: str, timeout_s: float = 20.0) -> list[str]:
    """The run's live resources once deletions settled (a deletion in flight is not a leak yet)."""
    end = time.monotonic() + timeout_s
    while True:
        live = stack.live(run)
        if not live or time.monotonic() > end:
            return live
        time.sleep(0.2)


def run_scenario(stack: Stack, s: Scenario) -> Outcome:
    from tpuctl.errors import TpuctlError

    t0 = time.monotonic()
    label = f"{s.fault}@{s.command}" if s.fault in SIGNALS else s.fault
    out = Outcome(s.index, s.accelerator, s.provisioning, label, s.cleanup, None, expected_exit(s))
    stack.clear_faults()
    oslogin = {"oslogin": {"enable-oslogin": "TRUE"},
               "oslogin-2fa": {"enable-oslogin": "TRUE", "enable-oslogin-2fa": "TRUE"}}.get(s.fault, {})
    try:
        set_project_metadata(stack, oslogin)
        if s.fault == "tpu-quota":
            from tpuctl.localcloud import quotas

            stack.admin("POST", f"projects/{PROJECT}", {"tpu_quotas": {q: 0 for q in quotas.known_ids()}})
        if s.fault == "detached":
            out.exit_code, out.message, out.lost, out.leaked = _detached_run(stack, s)
        elif s.uses_run:
            _arm_request_faults(stack, s)
            out.exit_code, out.message, record, out.lost = _tpuctl_run_with_fault(stack, s)
            if s.fault == "preempt-mid-job":
                out.steps_lost = record.steps_lost
            if out.exit_code == EXIT["interrupted"]:
                # `tpuctl run` tears its TPU down even on Ctrl-C/SIGTERM; the bucket stays (it holds checkpoints).
                out.leaked += [f"after interrupted run: {k}" for k in _settle(stack, s.run) if not k.startswith("buckets/")]
        elif s.fault in ("oslogin-2fa", "tpu-quota"):
            result = up(stack, s.run, s.accelerator, s.zones, s.provisioning)
            out.exit_code, out.message = result.exit_code, result.message
            # Refused by the preflight: nothing may exist before any cleanup ran.
            out.leaked += [f"after refusal: {k}" for k in stack.live(s.run)]
        elif s.fault in SIGNALS or s.waits_forever:
            _arm_request_faults(stack, s)
            out.exit_code, out.message = _signalled_up(stack, s)
            if out.exit_code == EXIT["interrupted"] and "resources are kept" not in out.message:
                # Exit 130 promises that what this invocation created was removed (before any down/gc),
                # unless it says the run was READY and is kept (Ctrl-C while `up` recorded and printed).
                out.leaked += [f"after rollback: {k}" for k in _settle(stack, s.run)]
        else:
            _arm_request_faults(stack, s)
            vms = {"vms": [{"name": "d"}]} if s.fault == "quota-403" else None  # Compute quota needs a VM
            result = up(stack, s.run, s.accelerator, s.zones, s.provisioning, extra=vms)
            out.exit_code, out.message = result.exit_code, result.message
            if out.exit_code in (EXIT["failure"], EXIT["capacity"]):
                # A failed `up` removed what it created before it exited: nothing may be left for the cleanup.
                out.leaked += [f"after failed up: {k}" for k in _settle(stack, s.run)]
        pattern = _MESSAGES["sigint"] if s.waits_forever else _MESSAGES.get(s.fault)
        if pattern is not None and out.exit_code not in (EXIT["ok"], EXIT["killed"]):
            out.message_ok = bool(pattern.search(out.message))
    finally:
        stack.clear_faults()
        if oslogin:
            set_project_metadata(stack, {})
        if s.fault == "tpu-quota":
            stack.admin("POST", f"projects/{PROJECT}", {})  # fully set up again
        try:
            cleanup(stack, s.run, s.cleanup)
        except TpuctlError as exc:
            out.message += f" | cleanup failed: {exc}"
        out.leaked += _settle(stack, s.run)
        out.seconds = time.monotonic() - t0
    return out


def set_project_metadata(stack: Stack, items: dict[str, str]) -> None:
    """Replace the project's common instance metadata (where `enable-oslogin` lives), as gcloud's
    `compute project-info add-metadata` does: read the fingerprint, then set."""
    from google.cloud import compute_v1

    projects = stack.clients.compute_projects
    current = projects.get(project=PROJECT).common_instance_metadata
    if {i.key: i.value for i in current.items} == items:
        return
    projects.set_common_instance_metadata(project=PROJECT, metadata_resource=compute_v1.Metadata(
        fingerprint=current.fingerprint, items=[compute_v1.Items(key=k, value=v) for k, v in items.items()])
    ).result(timeout=30)


class MetadataRace:
    """Another writer (a teammate's `gcloud ... tpu-vm ssh`) updates the node's metadata as soon as the node is
    READY, and its update stays in flight 1-5 s (localcloud's update takes 5 simulated seconds; Google's own
    is not documented): `tpuctl run`'s key update meets Google's 409 meanwhile and must keep both keys."""

    KEY = "teammate:ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIChaosTeammateKey teammate@box"

    def __init__(self, stack: Stack, s: Scenario):
        self.stack, self.s = stack, s
        self.op: str | None = None
        self.node: str | None = None
        self.metadata: dict[str, str] = {}
        self.release_at = 0.0

    def step(self) -> None:
        """Called from the scenario's poll loop: start the update once READY, finish it when its time is up."""
        if self.op is None:
            nodes = [n for n in self.stack.status()["resources"]["nodes"]
                     if (n.get("labels") or {}).get("tpuctl-run") == self.s.run and n["state"] == "READY"]
            if nodes:
                self._start(nodes[0]["name"])
        elif self.release_at and time.monotonic() >= self.release_at:
            self.release()

    def _start(self, name: str) -> None:
        from google.cloud import tpu_v2
        from google.protobuf import field_mask_pb2

        tpu = self.stack.clients.tpu
        node = tpu.get_node(name=name)
        keys = [k for k in node.metadata.get("ssh-keys", "").splitlines() if k.strip()]
        self.metadata = {**dict(node.metadata), "ssh-keys": "\n".join([*keys, self.KEY])}
        self.stack.fault("stuck", service="tpu", method="nodes.patch", count=1)
        op = tpu.update_node(node=tpu_v2.Node(name=name, metadata=self.metadata),
                             update_mask=field_mask_pb2.FieldMask(paths=["metadata"]))
        self.node, self.op = name, op.operation.name
        self.release_at = time.monotonic() + 1 + 4 * self.s.phase

    def release(self) -> None:
        """The other update completes, as localcloud's own scheduled transition would have without the fault."""
        if self.op is not None and self.release_at:
            self.release_at = 0.0
            self.stack.cloud.world.later(0, "tpu.update_done", node=self.node, op=self.op, changes={"metadata": self.metadata})


def _arm_request_faults(stack: Stack, s: Scenario) -> None:
    create = "queuedResources.create" if s.provisioning == "queued" else "nodes.create"
    if s.fault == "capacity-first-zone":
        stack.fault("capacity", service="tpu", method=create, zone=s.zones[0])
    elif s.fault == "capacity-all-zones":
        for z in s.zones:
            stack.fault("capacity", service="tpu", method=create, zone=z)
    elif s.fault == "429-storm":
        stack.fault("quota", service="tpu", method=create, count=s.storm)
        stack.fault("quota", service="tpu", method="operations.get", count=s.storm)
    elif s.fault == "503s":
        stack.fault("unavailable", method="*", count=s.storm)
    elif s.fault == "stuck-create":
        stack.fault("stuck", service="tpu", method=create)
    elif s.fault in STOCKOUT_CODES:
        stack.fault("capacity", service="tpu", method=create, zone=s.zones[0], code=STOCKOUT_CODES[s.fault])
    elif s.fault == "preempt-creating":
        stack.fault("preempt-creating", service="tpu", method="nodes.create", zone=s.zones[0])
    elif s.fault == "quota-429-bare":
        stack.fault("quota", service="tpu", method=create, details=False, quota="TPUV3sPerProjectPerZoneForTPUAPI")
    elif s.fault == "quota-403":
        stack.fault("quota", service="compute", method="instances.insert", quota="CPUS", in_operation=s.phase < 0.5)
    elif s.fault == "odd-response" and s.odd_create:
        stack.fault("odd-response", service="tpu", method=create, field="name", count=1)
    elif s.fault == "odd-response":
        stack.fault("odd-response", service="tpu", method="nodes.get", field="networkEndpoints", empty=True, count=1)
    elif s.fault == "guest-attrs":
        if s.phase < 0.5:
            stack.fault("no-guest-attributes", service="tpu")
        else:
            stack.fault("unavailable", service="tpu", method="nodes.getGuestAttributes")

def _tpuctl_run_with_fault(stack: Stack, s: Scenario) -> tuple[int, str, JobRecord, list[str]]:
    """A real `tpuctl run` of the stand-in job; once the bucket holds a checkpoint at or past a random step the
    fault strikes, and `tpuctl run` must recover by itself. Returns (exit code, error line, what was observed,
    checkpoint problems)."""
    from tpuctl.provision.labels import auto_bucket

    # A preemption strikes a job whose periodic checkpoints are beyond its end: whatever it resumes from is the
    # preemption notice's save (templates/README.md "Save on notice"), and the steps it trains again are lost.
    trainer = {"max_steps": 30, "checkpoint_every": 5, "step_seconds": 0.05}
    if s.fault == "preempt-mid-job":
        trainer.update(checkpoint_every=1000, step_seconds=0.2)
    spec_path = write_spec(stack, s.run, s.accelerator, s.zones, s.provisioning, extra={"job": {
        "template": str(STANDIN), "max_recoveries": 3, "config": {"trainer": trainer}}})
    bucket = auto_bucket(PROJECT, s.run)
    record = JobRecord()
    proc = subprocess.Popen(run_command(spec_path), env=child_env(stack, "chaos"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)

    def observe() -> None:
        try:
            names = [b.name for b in stack.clients.storage.list_blobs(bucket, prefix=f"runs/{s.run}/model/")]
        except Exception:  # noqa: BLE001 - the bucket may not exist yet
            return
        ckpts = [n for n in names if _ckpt_step(n) is not None]
        record.checkpoints_seen.update(ckpts)
        record.last_checkpoint_step = max([record.last_checkpoint_step, *(_ckpt_step(n) for n in ckpts)])
        if s.fault == "preempt-mid-job":
            try:
                log = stack.clients.storage.bucket(bucket).blob(f"runs/{s.run}/logs/worker-0.log").download_as_text()
            except Exception:  # noqa: BLE001 - not there (yet, or any more)
                return
            if "restored step=" not in log:  # the preempted job's log, not yet the resumed one's
                steps = [int(m.group(1)) for m in re.finditer(r"^(?:checkpoint )?step=(\d+)", log, re.M)]
                record.reached = max([record.reached, *steps])

    at_step = 5 + 5 * int(s.phase * 4)  # 5, 10, 15 or 20 of 30
    before = 0
    end = time.monotonic() + 240
    struck = s.fault == "none"
    first_seen: float | None = None
    race = MetadataRace(stack, s) if s.fault == "metadata-409" else None
    while proc.poll() is None and time.monotonic() < end:
        observe()
        if race is not None:
            race.step()
        if s.fault in SIGNALS:
            # A whole run takes ~6-10 s here: 0-6 s after its first resource appears spans up, upload,
            # training and teardown.
            if first_seen is None and stack.live(s.run):
                first_seen = time.monotonic()
            if not struck and first_seen is not None and time.monotonic() - first_seen >= s.phase * 6:
                proc.send_signal(SIGNALS[s.fault])
                struck = True
        elif not struck and (record.reached if s.fault == "preempt-mid-job" else record.last_checkpoint_step) >= at_step:
            before = record.last_checkpoint_step
            if s.fault == "preempt-mid-job":
                stack.admin("POST", "preempt", {"node": s.run})
            elif s.fault == "kill-worker":
                stack.fault("kill-worker", node=s.run, worker=int(s.phase * 7) % s.hosts)
            elif s.fault == "drop-ssh":
                stack.fault("drop-ssh", node=s.run)
            elif s.fault == "repair-mid-job":
                # Long enough (2-4 s here) that `tpuctl run` sees the node under maintenance and waits.
                stack.fault("repair", node=s.run, state="RESTARTING" if s.phase < 0.3 else "REPAIRING",
                            seconds=2000 + 2000 * s.phase)
            struck = True
        time.sleep(0.1)
    if proc.poll() is None and not struck:
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    if race is not None:
        race.release()
    code = proc.returncode
    if s.fault in ("sigint", "sigterm") and code == -SIGNALS[s.fault] and re.search(rf"run {s.run}: \w+", err):
        code = EXIT["ok"]  # it had finished and printed its summary: the signal met interpreter exit (see below)
    observe()
    problems: list[str] = []
    try:
        now = {b.name for b in stack.clients.storage.list_blobs(bucket, prefix=f"runs/{s.run}/model/")}
    except Exception as exc:  # noqa: BLE001 - a vanished bucket loses every checkpoint it held
        now = set()
        if record.checkpoints_seen:
            problems.append(f"bucket unreadable: {type(exc).__name__}")
    # Lost: seen, gone, and nothing newer in its place (the agent rotates older checkpoints away once a newer
    # one is complete, which a job slow enough to be seen at several checkpoints shows).
    newest = max([0, *(_ckpt_step(n) or 0 for n in now)])
    problems += sorted(n for n in record.checkpoints_seen - now if _ckpt_step(n) > newest)
    for w in range(s.hosts):
        try:
            log = stack.clients.storage.bucket(bucket).blob(f"runs/{s.run}/logs/worker-{w}.log").download_as_text()
        except Exception:  # noqa: BLE001 - no log, no restore to check
            continue
        for m in re.finditer(r"restored step=(\d+)", log):
            record.restored.append((before, int(m.group(1))))
            if int(m.group(1)) < before:
                problems.append(f"worker {w} restored step {m.group(1)} < checkpoint {before}")
    if s.fault in ("preempt-mid-job", "kill-worker", "repair-mid-job") and struck and not record.restored and before < 30:
        problems.append(f"the job did not resume from checkpoint {before} after {s.fault}")
    return code, error_line(err), record, problems


def _detached_run(stack: Stack, s: Scenario) -> tuple[int, str, list[str], list[str]]:
    """`tpuctl run --detach` (the laptop's part exits once the supervisor VM took over); then the supervisor
    process is killed and the spot TPU preempted, at steps the phase picks. Returns (the detach's exit code, its
    error line, problems with the run's end, what is still running once the run says it ended)."""
    from tpuctl.jobs import cluster, supervisor_vm
    from tpuctl.provision.labels import auto_bucket

    spec_path = write_spec(stack, s.run, s.accelerator, s.zones, s.provisioning, extra={"job": {
        "template": str(STANDIN), "max_recoveries": 3,
        "config": {"trainer": {"max_steps": 60, "checkpoint_every": 5, "step_seconds": 0.1}}}})
    detach = subprocess.run([*run_command(spec_path), "--detach"], env=child_env(stack, "chaos"),
                            capture_output=True, text=True, cwd=REPO, timeout=300, stdin=subprocess.DEVNULL)
    if detach.returncode != 0:
        return detach.returncode, error_line(detach.stderr), [], []
    bucket, problems = auto_bucket(PROJECT, s.run), []

    def step() -> int:
        status = cluster.read_status(stack.clients, bucket, s.run)
        return (status.step or 0) if status else 0

    kill_at, preempt_at = 5 + int(s.phase * 20), 10 + int(s.phase * 30)  # of 60 steps
    killed = preempted = False
    end = time.monotonic() + 400
    while time.monotonic() < end:
        status = cluster.read_status(stack.clients, bucket, s.run)
        if status is not None and status.final and status.state != "running":
            break
        reached = (status.step or 0) if status else 0
        if not killed and reached >= kill_at:
            beat = supervisor_vm.Heartbeat.read(stack.clients, bucket, s.run)
            if beat is not None and beat.pid:
                try:
                    os.kill(beat.pid, signal.SIGKILL)  # the supervisor crashes; its service starts it again
                except ProcessLookupError:
                    pass
            killed = True
        if not preempted and reached >= preempt_at and _tpu_ready(stack, s.run):
            stack.admin("POST", "preempt", {"node": s.run})
            preempted = True
        time.sleep(0.2)
    else:
        problems.append(f"the supervised run did not end in 400 s (step {step()})")
    status = cluster.read_status(stack.clients, bucket, s.run)
    if status is not None and status.final and (status.state, status.step) != ("succeeded", 60):
        problems.append(f"the supervised run ended {status.state} at step {status.step}")
    # The supervisor tears the run down and deletes itself; the bucket stays (it holds the checkpoints).
    left = [k for k in _settle(stack, s.run, timeout_s=60) if not k.startswith("buckets/")]
    return 0, "", problems, [f"after the supervised run ended: {k}" for k in left]


def _signalled_up(stack: Stack, s: Scenario) -> tuple[int, str]:
    """Start a provisioning process, signal it at a random phase, return (exit code, its stderr)."""
    spec_path = write_spec(stack, s.run, s.accelerator, s.zones, s.provisioning)
    proc = subprocess.Popen(up_command(spec_path), env=child_env(stack, "chaos"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    # The phase is measured from the moment the cloud shows the run's first resource (so interpreter start-up
    # on a loaded machine does not decide it): 0-0.3 s later spans creating, READY and after at speed 1000.
    # A create that never finishes (or a queue that never gets capacity) is given up on 1-3 s in.
    end = time.monotonic() + 60
    while proc.poll() is None and not stack.live(s.run) and time.monotonic() < end:
        time.sleep(0.02)
    delay = 1 + 2 * s.phase if s.waits_forever else s.phase * 0.3
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        proc.send_signal(SIGNALS.get(s.fault, signal.SIGINT))
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        return 124, "did not exit within 120 s of the signal: " + err[-300:]
    code, message = proc.returncode, error_line(err)
    if s.fault in ("sigint", "sigterm") and code == -SIGNALS[s.fault] and _tpu_ready(stack, s.run):
        # The signal met a process that had finished (READY) and was exiting: CPython restores the default
        # handlers during finalization, so the signal kills it. Its work was complete; count it as exit 0.
        return EXIT["ok"], message + " (signal arrived during interpreter exit, after READY)"
    return code, message


def _tpu_ready(stack: Stack, run: str) -> bool:
    nodes = stack.status()["resources"]["nodes"]
    return any((n.get("labels") or {}).get("tpuctl-run") == run and n["state"] == "READY" for n in nodes)


# ---------------------------------------------------------------------------------------------- the runner

@dataclass
class Totals:
    leaked: int = 0
    lost: int = 0
    wrong: int = 0
    scenarios: int = 0
    outcomes: list[Outcome] = field(default_factory=list)

    def add(self, o: Outcome) -> None:
        self.outcomes.append(o)
        self.scenarios += 1
        self.leaked += len(o.leaked)
        self.lost += len(o.lost)
        self.wrong += int(o.wrong_exit)

    def summary(self) -> list[str]:
        lost = sorted(o.steps_lost for o in self.outcomes if o.steps_lost is not None)
        steps = [f"steps lost per preemption: median {statistics.median(lost)}, worst {lost[-1]} "
                 f"({len(lost)} preemptions)"] if lost else []
        return [*steps, f"leaked: {self.leaked}", f"lost checkpoints: {self.lost}",
                f"wrong exit codes: {self.wrong}", f"scenarios: {self.scenarios}"]


def scenarios(n: int, seed: int, faults: tuple[str, ...] = FAULTS, shapes: tuple = SHAPES) -> Iterator[Scenario]:
    """The first len(faults) scenarios take every fault once (in a seeded order), so even a short slice
    covers each kind; the rest draw faults at random."""
    rng = random.Random(seed)
    first = list(faults)
    rng.shuffle(first)
    for i in range(n):
        yield pick(rng, i, (first[i],) if i < len(first) else faults, shapes)


def run_all(n: int, seed: int, *, speed: float = 1000.0, faults: tuple[str, ...] = FAULTS, shapes: tuple = SHAPES,
            say: Callable[[str], None] = print) -> Totals:
    totals = Totals()
    with Stack(speed=speed) as stack:
        for s in scenarios(n, seed, faults, shapes):
            o = run_scenario(stack, s)
            totals.add(o)
            say(o.line())
        stray = stack.live()
        if stray:
            say(f"left in the cloud at the end: {stray}")
    return totals


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", type=int, default=20)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--speed", type=float, default=1000.0)
    p.add_argument("--faults", help=f"comma-separated subset of: {', '.join(FAULTS)} (default: all)")
    p.add_argument("--without", default="", help="comma-separated faults left out of --faults")
    # CI's slice runs every fault once on the cheapest shape (one host); the shapes are what a long run varies.
    p.add_argument("--shape", choices=[s[0] for s in SHAPES], help="only this accelerator (default: all shapes)")
    p.add_argument("--each-fault-once", action="store_true", help="one scenario per fault (overrides --scenarios)")
    a = p.parse_args(argv)
    faults = tuple(f for f in (a.faults.split(",") if a.faults else FAULTS) if f not in a.without.split(","))
    unknown = (set(faults) | set(filter(None, a.without.split(",")))) - set(FAULTS)
    if unknown:
        p.error(f"unknown fault(s) {', '.join(sorted(unknown))}")
    # SIGTERM (a CI timeout) takes the KeyboardInterrupt path so the local cloud stops and kills its workers.
    signal.signal(signal.SIGTERM, _interrupt)
    t0 = time.monotonic()
    shapes = tuple(s for s in SHAPES if a.shape in (None, s[0]))
    n = len(faults) if a.each_fault_once else a.scenarios
    totals = run_all(n, a.seed, speed=a.speed, faults=faults, shapes=shapes, say=lambda line: print(line, flush=True))
    print(f"seed {a.seed}, {time.monotonic() - t0:.0f} s on {os.cpu_count()} cores")
    for line in totals.summary():
        print(line)
    return 0 if (totals.leaked, totals.lost, totals.wrong) == (0, 0, 0) else 1


if __name__ == "__main__":
    sys.exit(main())
