"""Start, watch and stop a job on every worker of a slice (laptop side).

`launch` is idempotent per launch id: retrying it while that launch runs changes nothing (the bootstrap
says "already running"), and a new launch replaces an old one, so a worker never runs twin jobs.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from tpuctl.errors import CloudError

from . import remote
from .bundle import Bundle
from .ssh import Fleet, Target


@dataclass(frozen=True)
class WorkerState:
    index: int
    state: str  # "running" | "exited" | "lost" (started, process gone, no exit code) | "absent" | "unreachable"
    exit_code: int | None = None
    pid: int | None = None

    @property
    def done(self) -> bool:
        return self.state == "exited"


def targets_from_workers(workers: Sequence, *, default_port: int = 22) -> list[Target]:
    """SSH targets from provisioning's `Worker`s (index, ip, port, host key and its alias)."""
    return [Target(index=w.index, host=w.ip, port=w.port or default_port, host_key=w.host_key,
                   host_key_alias=w.host_key_alias) for w in workers]


async def launch(fleet: Fleet, *, run: str, project: str, bucket: str, bundle: Bundle, python: str,
                 launch_id: str | None = None) -> str:
    """Bootstrap every worker concurrently; blocks until each has its job started (detached) or reports
    why not. Returns the launch id. Raises CloudError naming the workers whose bootstrap failed, with their
    last output lines.

    Idempotent per `launch_id`: a worker already running this launch is left alone. A job of another
    launch (an earlier attempt) is stopped first, so a relaunch never leaves two jobs on a worker.
    """
    launch_id = launch_id or uuid.uuid4().hex[:12]

    def command(t: Target) -> str:
        return remote.bootstrap_command(remote.bootstrap_script(
            run=run, worker=t.index, python=python, project=project, bucket=bucket,
            bundle_object=bundle.object_name, bundle_sha=bundle.sha256, launch_id=launch_id,
            storage=bundle.storage))

    results = await fleet.run_all(command, timeout_s=1800)
    failed = [r for r in results if r.exit_status != 0]
    if failed:
        detail = "; ".join(
            f"worker {r.index} exit {r.exit_status}: " + " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
            for r in failed)
        raise CloudError(f"starting the job failed on {len(failed)} worker(s): {detail}",
                         hint=f"see the full output with `tpuctl ssh {run} --worker {failed[0].index}`")
    return launch_id


# Each worker's tpu-env from its metadata server (GCE_METADATA_HOST where set, as google-auth reads it).
TPU_ENV_COMMAND = ("curl -sf -H 'Metadata-Flavor: Google' "
                   "\"http://${GCE_METADATA_HOST:-metadata.google.internal}/computeMetadata/v1/instance/attributes/tpu-env\"")


async def check_slices(fleet: Fleet, slices: int) -> None:
    """Before a multislice job starts: every host must agree on the number of slices and know its own slice,
    as JAX will read them (MEGASCALE_NUM_SLICES, MEGASCALE_SLICE_ID in tpu-env): worker i of H hosts per slice
    is in slice i // H. A host that disagrees would hang every other at `jax.distributed.initialize`, so it
    raises CloudError naming it instead."""
    results = await fleet.run_all(lambda t: TPU_ENV_COMMAND, timeout_s=60)
    per_slice = len(fleet.targets) // slices
    wrong = []
    for r in results:
        env = dict((k.strip(), v.strip().strip("'")) for k, _, v in
                   (line.partition(":") for line in r.stdout.splitlines() if ":" in line))
        seen = (env.get("MEGASCALE_NUM_SLICES"), env.get("MEGASCALE_SLICE_ID"))
        if r.exit_status != 0 or seen != (str(slices), str(r.index // per_slice)):
            wrong.append(f"worker {r.index} says slices={seen[0]} slice={seen[1]} "
                         f"(expected {slices} and {r.index // per_slice})")
    if wrong:
        raise CloudError(f"the hosts disagree on the multislice: {'; '.join(wrong)}",
                         hint="a slice was replaced while the others kept their old view: requeue the run "
                              "(`tpuctl down` then `tpuctl run` again) to rebuild every slice")


def _parse(index: int, line: str) -> WorkerState:
    word, _, rest = line.strip().partition(" ")
    if word == "exited":
        return WorkerState(index, "exited", exit_code=int(rest or 255))
    if word == "running":
        return WorkerState(index, "running", pid=int(rest))
    if word in ("lost", "absent"):
        return WorkerState(index, word)
    raise CloudError(f"worker {index}: unexpected status line {line!r}")


async def poll(fleet: Fleet, run: str) -> list[WorkerState]:
    """Each worker's job state, all workers concurrently. Unreachable workers are reported as such (a
    preempted node's workers stop answering), not raised."""
    async def one(t: Target) -> WorkerState:
        try:
            r = await asyncio.wait_for(fleet.run(t.index, remote.status_command(run, t.index)), timeout=60)
        except Exception:  # noqa: BLE001 - any failure to reach the worker means the same thing here
            return WorkerState(t.index, "unreachable")
        return _parse(t.index, r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "absent")

    return list(await asyncio.gather(*(one(t) for t in fleet.targets)))


async def cancel(fleet: Fleet, run: str, *, indices: Sequence[int] | None = None, grace_s: int = 10) -> None:
    """Stop the job on the given workers (default all): SIGTERM, then SIGKILL after `grace_s`. Idempotent."""
    await fleet.run_all(lambda t: remote.cancel_command(run, t.index, grace_s), indices=indices,
                        timeout_s=grace_s + 30)
