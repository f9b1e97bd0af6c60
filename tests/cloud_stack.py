"""One local cloud plus tpuctl's clients and a private TPUCTL_HOME, and real `tpuctl up` / `tpuctl run` processes
and the stand-in job against it: what bench/chaos.py (the seeded chaos runner) and the reliability tests
(test_hostile, test_security, test_concurrency) share. Tests import it as a module of tests/; bench scripts put
tests/ on sys.path first, as bench/backends.py does.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STANDIN = REPO / "tests" / "job_templates" / "standin"
PROJECT = "tpuctl-local"

_SECRET_PATTERNS = (
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    re.compile(r"\bya29\.[0-9A-Za-z_-]{10,}"),  # OAuth2 access tokens
    re.compile(r"\b1//[0-9A-Za-z_-]{20,}"),  # OAuth2 refresh tokens
    re.compile(r'"(private_key|private_key_id|client_secret|refresh_token|access_token)"\s*:'),
    re.compile(r"\bAKIA[0-9A-Z]{16}\b"),
    re.compile(r"\bAIza[0-9A-Za-z_-]{35}\b"),  # Google API keys
    re.compile(r"\b(?:authorization|x-goog-api-key)\s*:\s*\S+", re.IGNORECASE),
)


def secrets_in(text: str, extra: tuple[str, ...] = ()) -> list[str]:
    """Credential-looking fragments of `text` (private keys, OAuth tokens, key files, API keys), plus any of
    the `extra` literal secrets (e.g. the base64 body of the user's private SSH key)."""
    found = [m.group(0)[:40] for p in _SECRET_PATTERNS for m in p.finditer(text)]
    found += [s[:16] + "..." for s in extra if s and s in text]
    return found


# ---------------------------------------------------------------------------------------------- the stack

class Stack:
    """One local cloud (speed high) plus clients and a private TPUCTL_HOME, as a context manager.

    `env` is what a child tpuctl process needs to target this cloud. Nothing here mocks a Google class: the
    official clients talk HTTP to the local cloud.
    """

    def __init__(self, speed: float = 1000.0):
        self.speed = speed
        self.cloud = None
        self.clients = None
        self.home: Path | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._saved_env: dict[str, str | None] = {}

    def __enter__(self) -> "Stack":
        from google.auth.credentials import AnonymousCredentials

        from tpuctl.localcloud.cloud import LocalCloud
        from tpuctl.provision.clients import build

        self._tmp = tempfile.TemporaryDirectory(prefix="tpuctl-chaos-")
        self.home = Path(self._tmp.name) / "home"
        self.cloud = LocalCloud(speed=self.speed, strict=True, worker_python="host").start()
        self.env = {"TPUCTL_HOME": str(self.home), "TPUCTL_API_ENDPOINT": self.cloud.endpoint,
                    "STORAGE_EMULATOR_HOST": self.cloud.storage_host,
                    "TPUCTL_CLOUD": "local", "TPUCTL_PROJECT": PROJECT, "NO_COLOR": "1"}
        for k, v in self.env.items():
            self._saved_env[k] = os.environ.get(k)
            os.environ[k] = v
        self.clients = build(project=PROJECT, credentials=AnonymousCredentials(), endpoint=self.cloud.endpoint,
                             storage_host=self.cloud.storage_host, local=True)
        return self

    def __exit__(self, *exc) -> None:
        if self.cloud is not None:
            self.cloud.stop()
        for k, v in self._saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if self._tmp is not None:
            self._tmp.cleanup()

    # -- the admin API, over HTTP like any other client of the local cloud
    def admin(self, verb: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.cloud.endpoint}/_localcloud/{path}", data=data, method=verb,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return json.load(resp)
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{verb} /_localcloud/{path}: {exc.code} {exc.read().decode()[:300]}") from None

    def status(self) -> dict:
        return self.admin("GET", "status")

    def fault(self, kind: str, **options: Any) -> dict:
        return self.admin("POST", "faults", {"kind": kind, **options})["fault"]

    def clear_faults(self) -> None:
        self.admin("DELETE", "faults")

    def live(self, run: str | None = None, *, status: dict | None = None) -> list[str]:
        """Keys of every live resource carrying a tpuctl run label (of `run`), from the cloud's inventory."""
        res = (status or self.status())["resources"]
        out = []
        for kind in ("nodes", "queued_resources", "instances", "buckets"):
            for r in res.get(kind, []):
                labels = r.get("labels") or {}
                if "tpuctl-run" in labels and (run is None or labels["tpuctl-run"] == run):
                    out.append(f"{kind}/{r['name']}")
        return out


# ---------------------------------------------------------------------------------------------- provisioning

@dataclass(frozen=True)
class UpResult:
    """What a `tpuctl up` process did: its exit code and its stderr on one line."""

    run: str
    exit_code: int
    message: str


def up_command(spec_path: Path) -> list[str]:
    return [sys.executable, "-m", "tpuctl", "up", str(spec_path), "--yes"]


def write_spec(stack: Stack, run: str, accelerator: str, zones: tuple[str, ...], provisioning: str, *,
               ttl: str = "2h", extra: dict | None = None) -> Path:
    path = stack.home / "specs" / f"{run}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    # JSON is YAML: the spec file is written exactly as a user could.
    path.write_text(json.dumps({"name": run, "zone": list(zones), "accelerator": accelerator,
                                "provisioning": provisioning, "ttl": ttl, **(extra or {})}))
    return path


def child_env(stack: Stack, owner: str) -> dict[str, str]:
    # The owner label comes from the login name (getpass), so the child runs as that user.
    return {**os.environ, **stack.env, "TPUCTL_OWNER": owner, "USER": owner, "LOGNAME": owner}


def up(stack: Stack, run: str, accelerator: str, zones: tuple[str, ...], provisioning: str, *, owner: str = "chaos",
       ttl: str = "2h", extra: dict | None = None, timeout_s: float = 300.0) -> UpResult:
    """`tpuctl up SPEC --yes` as its own process against the stack's cloud; blocks until it exits."""
    spec_path = write_spec(stack, run, accelerator, zones, provisioning, ttl=ttl, extra=extra)
    proc = subprocess.run(up_command(spec_path), env=child_env(stack, owner), capture_output=True, text=True,
                          cwd=REPO, timeout=timeout_s)
    return UpResult(run, proc.returncode, error_line(proc.stderr))


def error_line(stderr: str) -> str:
    """The CLI's `error: ...` line (what a user reads), else the end of its stderr."""
    errors = [l for l in stderr.splitlines() if l.startswith("error:")]
    return errors[-1] if errors else " ".join(stderr.split())[-400:]


# ---------------------------------------------------------------------------------------------- the job

class Job:
    """The stand-in job on a run that `tpuctl up` provisioned, driven through the jobs layer directly (for
    tests that inspect the run's resources afterwards, which `tpuctl run` would tear down)."""

    def __init__(self, stack: Stack, run: str, *, max_steps: int = 30, checkpoint_every: int = 5,
                 step_seconds: float = 0.04, args: tuple[str, ...] = (), env: dict[str, str] | None = None):
        from tpuctl import provision
        from tpuctl.jobs import bundle as bundles
        from tpuctl.jobs.keys import ensure_keypair

        found = provision.list_resources(stack.clients, run)
        node = next(r for r in found if r.kind.value == "tpu")
        self.stack, self.run, self.zone = stack, run, node.location
        self.service_account = node.detail.get("service_account")
        self.bucket = next(r.name for r in found if r.kind.value == "bucket")
        self.key = ensure_keypair()
        self.hosts = max(1, len(node.workers))
        config = bundles.job_config({"trainer": {"max_steps": max_steps, "checkpoint_every": checkpoint_every,
                                                 "step_seconds": step_seconds}},
                                    preset=None, bucket=self.bucket, run=self.run, data_url=None)
        desc = bundles.JobDescription(run=self.run, project=PROJECT, bucket=self.bucket, module="standin.train",
                                      config=config, args=tuple(args), env=dict(env or {}),
                                      num_workers=self.hosts, heartbeat_s=0.3,
                                      storage=bundles.worker_storage(stack.clients))
        self.bundle = bundles.build(STANDIN, desc, stack.home / "bundles" / self.run)
        bundles.upload(stack.clients.storage, self.bucket, self.bundle)

    def run_to_end(self, *, timeout_s: float = 120.0) -> list:
        """Add the user's key to the node, launch on every worker and block until all exited; the states."""
        from tpuctl import provision
        from tpuctl.jobs import launch as launching
        from tpuctl.jobs.launch import targets_from_workers
        from tpuctl.jobs.ssh import Fleet

        provision.add_ssh_key(self.stack.clients, self.zone, self.run, self.key.user, self.key.public_key,
                              deadline_s=60)
        targets = targets_from_workers(provision.workers(self.stack.clients, self.zone, self.run))

        async def go():
            async with Fleet(targets, self.key) as fleet:
                await launching.launch(fleet, run=self.run, project=PROJECT, bucket=self.bucket,
                                       bundle=self.bundle, python=sys.executable)
                end = time.monotonic() + timeout_s
                while time.monotonic() < end:
                    states = await launching.poll(fleet, self.run)
                    if all(s.done for s in states):
                        return states
                    await asyncio.sleep(0.15)
                raise TimeoutError(f"job {self.run} not done after {timeout_s} s: {states}")

        return asyncio.run(go())




def cleanup(stack: Stack, run: str, how: str, *, owner: str = "chaos") -> None:
    """`down` (delete everything of the run, bucket included) or one `gc` pass run after the TTL expired."""
    from tpuctl import catalog, paths, provision
    from tpuctl.ledger import Ledger
    from tpuctl.provision import gc

    if how == "down":
        provision.down(stack.clients, run, delete_bucket=True, deadline_s=120)
        return
    policy = gc.Policy(now=time.time() + 3 * 3600, owner=owner, buckets=True)
    gc.run(stack.clients, policy, dry_run=False, catalog=catalog.load(), ledger=Ledger(paths.ledger()),
           lock=paths.gc_lock(), lock_wait_s=30)


def run_command(spec_path: Path) -> list[str]:
    return [sys.executable, "-m", "tpuctl", "run", str(spec_path), "--yes", "--poll", "0.3"]
