"""Jobs layer on a fake 4-worker slice (asyncssh servers on 127.0.0.1) and an emulated bucket."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import time
from dataclasses import replace

import pytest

from test_jobs_harness import PYTHON, STANDIN, make_slice, slice4, storage, tpuctl_home  # noqa: F401
from tpuctl.errors import BadInput
from tpuctl.jobs import bundle as bundles
from tpuctl.jobs import launch as launching
from tpuctl.jobs import logs, remote
from tpuctl.jobs.keys import ensure_keypair
from tpuctl.jobs.ssh import Fleet

HOSTILE = ["it's", 'say "hi"', "$(touch PWNED)", "`touch PWNED2`", "a; touch PWNED3", "line1\nline2", "--x=$HOME", "*"]


def _job(run: str, storage, *, workers: int = 4, trainer: dict | None = None, args=(), env=None):
    config = bundles.job_config({"trainer": {"max_steps": 12, "checkpoint_every": 4, **(trainer or {})}},
                                preset=None, bucket=storage.bucket_name, run=run, data_url=None)
    return bundles.JobDescription(run=run, project="test-project", bucket=storage.bucket_name, module="standin.train",
                                  config=config, args=tuple(args), env=env or {}, num_workers=workers, heartbeat_s=0.5,
                                  storage="mirror")


def _ship(tmp_path, storage, job) -> bundles.Bundle:
    b = bundles.build(STANDIN, job, tmp_path / "bundles")
    bundles.upload(storage.client(), storage.bucket_name, b)
    return b


async def _wait_done(fleet: Fleet, run: str, timeout: float = 60) -> list[launching.WorkerState]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        states = await launching.poll(fleet, run)
        if all(s.done for s in states):
            return states
        await asyncio.sleep(0.2)
    raise AssertionError(f"job not done: {states}")


def _blob_text(storage, name: str) -> str:
    return storage.client().bucket(storage.bucket_name).blob(name).download_as_text()


# ------------------------------------------------------------------------------------------ pure parts

def test_render_quotes_every_value_and_refuses_missing(tmp_path):
    script = remote.render("printf '%s\\n' {{a}} {{b}}", {"a": HOSTILE[2], "b": "x; touch " + str(tmp_path / "bad")})
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=tmp_path, check=True).stdout
    assert out.splitlines() == [HOSTILE[2], "x; touch " + str(tmp_path / "bad")]
    assert not list(tmp_path.iterdir())
    with pytest.raises(KeyError):
        remote.render("{{a}} {{typo}}", {"a": 1})


def test_bootstrap_script_is_valid_bash_for_hostile_values():
    script = remote.bootstrap_script(run="r1", worker=3, python="python3", project="p'; rm -rf /",
                                     bucket="$(reboot)", bundle_object="runs/r1/x\ny", bundle_sha="abc",
                                     launch_id="l1", storage="mirror")
    subprocess.run(["bash", "-n", "-c", script], check=True)
    assert "BUCKET='$(reboot)'" in script



# A metadata server that never answers: the emulator's (mirror) client would ask it for the VM's token and fail.
@pytest.mark.parametrize("kind, metadata", [("gcs", "127.0.0.1:9"), ("mirror", None)])
def test_the_bootstrap_fetches_the_bundle_with_its_storage_kinds_client_not_the_workers_guess(tmp_path, storage,
                                                                                              kind, metadata):
    # The worker's environment names the emulator either way (as a local-cloud VM's does): only the kind rendered
    # from the bundle decides. A gcs bundle's fetch is the Gcs agent's plain client, which asks no metadata server
    # here; guessing "emulator" from STORAGE_EMULATOR_HOST would ask the dead one. A wrong sha stops the script
    # right after the fetch, before anything starts.
    b = _ship(tmp_path, storage, replace(_job("fetch", storage, workers=1), storage=kind))
    assert b.storage == kind
    script = remote.bootstrap_script(run="fetch", worker=0, python=PYTHON, project="test-project",
                                     bucket=storage.bucket_name, bundle_object=b.object_name, bundle_sha="0" * 64,
                                     launch_id="l1", storage=b.storage)
    assert "STORAGE_EMULATOR_HOST" not in script
    env = {k: v for k, v in os.environ.items() if k != "GCE_METADATA_HOST"} | {"HOME": str(tmp_path)}
    if metadata:
        env["GCE_METADATA_HOST"] = metadata
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "did NOT match" in r.stderr, r.stderr
    fetched = tmp_path / remote.workdir("fetch", 0) / "bundle.tar.gz"
    assert fetched.read_bytes() == b.path.read_bytes()
    with pytest.raises(BadInput) as e:
        remote.bootstrap_script(run="fetch", worker=0, python=PYTHON, project="p", bucket="b", bundle_object="o",
                                bundle_sha="0", launch_id="l1", storage="emulator")
    assert e.value.field == "job.storage"


def test_a_worker_without_the_storage_client_installs_it_held_to_the_images_versions_then_fetches(tmp_path, storage):
    # The bootstrap's one interpreter lists the image's versions, checks for google-cloud-storage and fetches; here
    # the worker's Python lacks the client until pip installs it, so the first attempt exits 3 having fetched
    # nothing, pip runs constrained to the versions listed before it, and the second attempt fetches.
    b = _ship(tmp_path, storage, _job("no-client", storage, workers=1))
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(
        "import sys\n"
        "class NoClient:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'google.cloud.storage':\n"
        "            raise ImportError('no google-cloud-storage on this image')\n"
        "sys.meta_path.insert(0, NoClient())\n")
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/bash
if [ "$1 $2 $3" = "-m pip install" ]; then
  echo "$*" >> {tmp_path}/pip.log; cp image-constraints.txt {tmp_path}/constraints-at-install; touch {tmp_path}/installed
  exit 0
fi
[ -f {tmp_path}/installed ] || export PYTHONPATH={block}
echo "$1" >> {tmp_path}/starts.log
exec {PYTHON} "$@"
""")
    fake.chmod(0o755)
    script = remote.bootstrap_script(run="no-client", worker=0, python=str(fake), project="test-project",
                                     bucket=storage.bucket_name, bundle_object=b.object_name, bundle_sha="0" * 64,
                                     launch_id="l1", storage=b.storage)
    env = {k: v for k, v in os.environ.items() if k != "GCE_METADATA_HOST"} | {"HOME": str(tmp_path)}
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "did NOT match" in r.stderr, r.stderr
    pip = (tmp_path / "pip.log").read_text().split()
    assert pip[-3:] == ["-c", "image-constraints.txt", "google-cloud-storage"], pip
    assert "keras==" in (tmp_path / "constraints-at-install").read_text()  # the image's packages, listed before
    assert (tmp_path / "starts.log").read_text().split() == ["-", "-"]  # an interpreter an attempt, no more
    assert (tmp_path / remote.workdir("no-client", 0) / "bundle.tar.gz").read_bytes() == b.path.read_bytes()


@pytest.mark.parametrize("name", ["Bad", "a b", "x;y", "$(id)", "../up", "", "a" * 64, "-a"])
def test_hostile_run_names_are_refused(name):
    with pytest.raises(BadInput) as e:
        remote.workdir(name, 0)
    assert e.value.field == "name"


def test_keypair_created_once_private(tpuctl_home):
    a = ensure_keypair()
    b = ensure_keypair()
    assert a == b
    assert stat.S_IMODE(a.private_path.stat().st_mode) == 0o600
    assert a.metadata_line().startswith(f"{a.user}:ssh-ed25519 ")
    os.chmod(a.private_path, 0o644)
    with pytest.raises(BadInput):
        ensure_keypair()


def test_concurrent_first_runs_share_one_whole_keypair(tmp_path):
    """Parallel `tpuctl run`s on a fresh machine race to create the key; every one must get the same one."""
    keys, go = tmp_path / "keys", tmp_path / "go"
    keys.mkdir()
    code = ("import sys, time; from pathlib import Path; from tpuctl.jobs.keys import ensure_keypair\n"
            "while not Path(sys.argv[2]).exists(): time.sleep(0.001)\n"  # all start together, after the imports
            "print(ensure_keypair(Path(sys.argv[1])).public_key)")
    procs = [subprocess.Popen([PYTHON, "-c", code, str(keys), str(go)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(8)]
    time.sleep(3)
    go.touch()
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 8, [err for _, err in results]
    assert len({out for out, _ in results}) == 1
    private = keys / "tpuctl_ed25519"
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert sorted(p.name for p in keys.iterdir()) == ["tpuctl_ed25519", "tpuctl_ed25519.pub"]
    assert (keys / "tpuctl_ed25519.pub").read_text().split()[:2] == results[0][0].split()[:2]


def test_bundle_is_content_addressed(tmp_path):
    job = bundles.JobDescription(run="r1", project="p", bucket="b", module="standin.train", config={"x": 1})
    a = bundles.build(STANDIN, job, tmp_path / "a")
    b = bundles.build(STANDIN, job, tmp_path / "b")
    assert a.sha256 == b.sha256 and a.path.read_bytes() == b.path.read_bytes()
    c = bundles.build(STANDIN, bundles.JobDescription(**{**job.__dict__, "config": {"x": 2}}), tmp_path / "c")
    assert c.sha256 != a.sha256
    assert a.object_name == f"runs/r1/bundle-{a.sha256[:16]}.tar.gz"


def test_unknown_template_names_the_field():
    with pytest.raises(BadInput) as e:
        bundles.resolve_template("no-such-template")
    assert e.value.field == "job.template"


def test_a_local_template_copy_checks_its_config_with_its_own_schema(tmp_path):
    """A template directory outside tpuctl is loaded as its own package to run the check its template.json
    names; a template that names none (the stand-in) ships its config unchecked."""
    import shutil

    local = tmp_path / "mybert"
    shutil.copytree(bundles.resolve_template("bert"), local, ignore=shutil.ignore_patterns("__pycache__"))
    meta = local / "template.json"  # the copy's program is its own package's (the bundle ships it as mybert/)
    meta.write_text(meta.read_text().replace('"entry_module": "bert.train"', '"entry_module": "mybert.train"'))
    bundles.check_config(local, {"preset": "bert-tiny", "trainer": {"max_steps": 20}})
    with pytest.raises(BadInput) as e:
        bundles.check_config(local, {"preset": "bert-tiny", "runtime": {"replica": 2}})
    assert str(e.value) == "job.config.runtime.replica: unknown field; did you mean replicas?"
    bundles.check_config(STANDIN, {"trainer": {"anything": 1}})


# ------------------------------------------------------------------------------------------ on a slice

def test_job_runs_on_all_four_workers_with_logs_status_and_checkpoints(tmp_path, slice4, storage):
    run = "four"
    job = _job(run, storage)
    b = _ship(tmp_path, storage, job)
    assert not bundles.upload(storage.client(), storage.bucket_name, b), "unchanged bundle is not re-uploaded"
    lines: list[tuple[int, str]] = []

    async def go():
        async with Fleet(slice4.targets(), ensure_keypair()) as fleet:
            lid = await launching.launch(fleet, run=run, project="test-project", bucket=storage.bucket_name,
                                         bundle=b, python=PYTHON)
            pids = [s.pid for s in await launching.poll(fleet, run)]
            # Retrying the same launch is a no-op while it runs.
            await launching.launch(fleet, run=run, project="test-project", bucket=storage.bucket_name, bundle=b,
                                   python=PYTHON, launch_id=lid)
            assert [s.pid for s in await launching.poll(fleet, run)] == pids
            await logs.follow(fleet, run, lambda w, line: lines.append((w, line)))
            return await _wait_done(fleet, run)

    states = asyncio.run(go())
    assert [s.exit_code for s in states] == [0, 0, 0, 0]
    for w in range(4):
        mine = [line for i, line in lines if i == w]
        # Every worker of the stand-in writes checkpoints to the one shared model dir, so a worker that starts
        # after another published one (a loaded machine) rightly resumes from it: it then trains the rest.
        start = next((int(line.split("=")[1]) for line in mine if line.startswith("restored step=")), 0)
        assert [int(line.split()[0].split("=")[1]) for line in mine if line.startswith("step=")] == \
            list(range(start + 1, 13)), mine
        assert f"step=12" in _blob_text(storage, f"runs/{run}/logs/worker-{w}.log")
    status = json.loads(_blob_text(storage, f"runs/{run}/status.json"))
    assert status["state"] == "succeeded" and status["exit_code"] == 0 and status["step"] == 12
    # The laptop's field (`tpuctl run` recovering a node): the agents write the whole record (jobs/agent/status.py)
    # but only carry over what they read, so it stays at its default.
    assert status["recovering"] is False
    assert _blob_text(storage, f"runs/{run}/model/checkpoint") == "ckpt-12.json"
    assert json.loads(_blob_text(storage, f"runs/{run}/model/export/final.json")) == {"step": 12}


def test_hostile_args_and_env_arrive_verbatim_and_execute_nothing(tmp_path, tpuctl_home, storage):
    s = make_slice(tmp_path, storage, 1)
    try:
        run = "hostile"
        env = {"TPUCTL_TEST_V": HOSTILE[2] + "\n" + HOSTILE[4]}
        b = _ship(tmp_path, storage, _job(run, storage, workers=1, args=HOSTILE, env=env))

        async def go():
            async with Fleet(s.targets(), ensure_keypair()) as fleet:
                await launching.launch(fleet, run=run, project="test-project", bucket=storage.bucket_name,
                                       bundle=b, python=PYTHON)
                return await _wait_done(fleet, run)

        assert asyncio.run(go())[0].exit_code == 0
        log = (s.workdir(run, 0) / "job.log").read_text().splitlines()
        assert json.loads(log[0][len("args="):]) == HOSTILE
        assert json.loads(log[1][len("env="):]) == env
        assert not [p for p in tmp_path.rglob("PWNED*")]
    finally:
        s.close()


def test_failing_worker_is_reported_and_others_can_be_cancelled(tmp_path, slice4, storage):
    run = "fails"
    b = _ship(tmp_path, storage, _job(run, storage, trainer={"max_steps": 400, "fail_at_step": 3, "fail_worker": 2}))

    async def go():
        async with Fleet(slice4.targets(), ensure_keypair()) as fleet:
            await launching.launch(fleet, run=run, project="test-project", bucket=storage.bucket_name, bundle=b,
                                   python=PYTHON)
            end = time.monotonic() + 30
            while time.monotonic() < end:
                states = await launching.poll(fleet, run)
                if states[2].done:
                    break
                await asyncio.sleep(0.2)
            assert states[2].exit_code == 3
            assert all(s.state == "running" for i, s in enumerate(states) if i != 2)
            await launching.cancel(fleet, run)
            return await _wait_done(fleet, run, timeout=30)

    states = asyncio.run(go())
    assert states[2].exit_code == 3
    assert {s.exit_code for i, s in enumerate(states) if i != 2} == {143}
    status = json.loads(_blob_text(storage, f"runs/{run}/status.json"))
    assert status["state"] == "failed" and status["exit_code"] == 3, status
    assert "boom at step 3" in _blob_text(storage, f"runs/{run}/logs/worker-2.log")


def test_a_cancel_while_the_agents_start_ends_every_worker_with_an_exit_code(tmp_path, slice4, storage):
    """A cancel lands while the agents still import their storage client and stage the job (a slow worker, a
    failure elsewhere right after launch): each agent records SIGTERM's exit and starts no program, instead of
    dying silently ("lost", read as a lost node) or ignoring the cancel until its grace runs out."""
    run = "early-cancel"
    b = _ship(tmp_path, storage, _job(run, storage, trainer={"max_steps": 400}))

    async def go():
        async with Fleet(slice4.targets(), ensure_keypair()) as fleet:
            await launching.launch(fleet, run=run, project="test-project", bucket=storage.bucket_name, bundle=b,
                                   python=PYTHON)
            started = time.monotonic()
            await launching.cancel(fleet, run, grace_s=60)
            return time.monotonic() - started, await launching.poll(fleet, run)

    took, states = asyncio.run(go())
    assert [s.state for s in states] == ["exited"] * 4, states
    # Whether a worker's cancel landed before its program started depends on the machine's load (CI once saw
    # one start first, SIGTERMed a few steps in); either way the job ends 143, promptly, never "lost".
    assert {s.exit_code for s in states} == {143}
    assert took < 30, f"the cancel waited {took:.0f} s: a SIGTERM was not acted on"


def test_an_agent_cancelled_before_its_program_starts_records_143_and_starts_nothing(tmp_path, storage):
    """The deterministic half of the test above: the cancel's marker is there when the agent starts (it came
    while SIGTERM was still ignored), so the agent runs no program, and records and publishes 143."""
    import tarfile

    run = "pre-cancel"
    b = _ship(tmp_path, storage, _job(run, storage, workers=1))
    home = tmp_path / "w0"
    with tarfile.open(b.path) as tar:
        tar.extractall(home / "bundle", filter="data")
    (home / "cancelled").touch()
    proc = subprocess.run([PYTHON, "-m", bundles.AGENT_PACKAGE, "run", "--bundle", str(home / "bundle"),
                           "--worker", "0"], env={**os.environ, "STORAGE_EMULATOR_HOST": storage.host,
                                                  "PYTHONPATH": str(home / "bundle")},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 143, proc.stderr
    assert (home / "exit_code").read_text().strip() == "143"
    log = (home / "job.log").read_text()
    assert "tpuctl agent: cancelled before the program started" in log and "args=" not in log, log
    status = json.loads(_blob_text(storage, f"runs/{run}/status.json"))
    assert status["state"] == "failed" and status["exit_code"] == 143, status


def test_a_sigterm_no_cancel_asked_for_is_the_machine_going_down_not_the_job_ending(tmp_path, storage):
    """Google stops a TPU VM's OS for maintenance or a preemption, which signals every process: the job did not
    fail there, so the agent records no exit code and the worker reads `lost` (recovered from), not `exited 143`
    (a failed job, torn down)."""
    import tarfile

    run = "guest-down"
    b = _ship(tmp_path, storage, _job(run, storage, workers=1, trainer={"max_steps": 2000, "step_seconds": 0.05}))
    home = tmp_path / "w0"
    with tarfile.open(b.path) as tar:
        tar.extractall(home / "bundle", filter="data")
    proc = subprocess.Popen([PYTHON, "-m", bundles.AGENT_PACKAGE, "run", "--bundle", str(home / "bundle"),
                             "--worker", "0"], env={**os.environ, "STORAGE_EMULATOR_HOST": storage.host,
                                                    "PYTHONPATH": str(home / "bundle")}, cwd=home,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while "step=3 " not in ((home / "job.log").read_text() if (home / "job.log").exists() else ""):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() is not None else ""
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    assert not (home / "exit_code").exists()
    log = (home / "job.log").read_text()
    assert "the machine is shutting down; the job did not end here" in log and "checkpoint step=" in log, log
    status = json.loads(_blob_text(storage, f"runs/{run}/status.json"))
    assert status["state"] == "running" and status["exit_code"] is None, status


def test_a_log_line_cut_off_by_a_cancel_is_read_again_whole():
    """The cursor counts whole lines: a stream cancelled mid-line (the watch stops its streams when the job ends)
    leaves the line's start to the next read, which delivers it whole, once."""
    log = b"one\ntwo\nthree\n"

    class Proc:
        def __init__(self, data: bytes, stall: bool):
            self.chunks, self.stall = [data], stall

        async def read(self, _n):
            if self.chunks:
                return self.chunks.pop()
            if self.stall:  # a follower waiting for more
                await asyncio.Event().wait()
            return b""

        async def wait(self):
            return None

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

        @property
        def stdout(self):
            return self

    class Conn:
        def create_process(self, command, encoding=None):
            start = int(re.search(r"tail -c \+(\d+)", command).group(1)) - 1
            following = "--pid" in command
            return Proc(log[start:len("one\ntwo\nthr")] if following else log[start:], stall=following)

    class Fleet1:
        targets = [type("T", (), {"index": 0})()]

        async def connection(self, index, *, fresh=False):
            return Conn()

    lines, cursor = [], logs.Cursor()

    async def go():
        follower = asyncio.create_task(logs.follow(Fleet1(), "r", lambda w, line: lines.append(line), cursor=cursor))
        while len(lines) < 2:
            await asyncio.sleep(0.01)
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        assert cursor.offsets == {0: len("one\ntwo\n")}
        await logs.follow(Fleet1(), "r", lambda w, line: lines.append(line), follow=False, cursor=cursor)

    asyncio.run(go())
    assert lines == ["one", "two", "three"] and cursor.offsets == {0: len(log)}


def test_logs_follow_resumes_at_offset_after_ssh_drop(tmp_path, slice4, storage):
    run = "drops"
    # No checkpoint before the end: worker 0's agent uploads the model dir every heartbeat and each agent
    # downloads it when it stages, so a stand-in that starts late would restore worker 0's step-8 checkpoint
    # and log from step 9 (seen once in a full run on 2 cores; real workers start together and then sync).
    b = _ship(tmp_path, storage, _job(run, storage, trainer={"max_steps": 40, "step_seconds": 0.05,
                                                               "checkpoint_every": 1000}))
    lines: list[tuple[int, str]] = []

    async def go():
        async with Fleet(slice4.targets(), ensure_keypair()) as fleet:
            await launching.launch(fleet, run=run, project="test-project", bucket=storage.bucket_name, bundle=b,
                                   python=PYTHON)
            cursor = logs.Cursor()
            task = asyncio.create_task(logs.follow(fleet, run, lambda w, l: lines.append((w, l)), cursor=cursor))
            while sum(1 for _, l in lines if l.startswith("step=")) < 8:
                await asyncio.sleep(0.05)
            assert slice4.drop_connections() > 0
            await task
            return cursor

    cursor = asyncio.run(go())
    assert cursor.reconnects >= 1
    for w in range(4):
        steps = [line.rsplit(" time=", 1)[0] for i, line in lines if i == w and line.startswith("step=")]
        assert steps == [f"step={n} loss={10.0 / n:.3f} examples_per_sec=100.0" for n in range(1, 41)]


def test_unpublished_host_key_is_trusted_on_first_use_then_verified(tmp_path, tpuctl_home, storage):
    from tpuctl import events

    warnings: list[str] = []
    s = make_slice(tmp_path, storage, 1)
    try:
        from tpuctl.jobs.ssh import HostKeyMismatch

        def heard(event: events.Event) -> None:
            if isinstance(event, events.Warn):
                warnings.append(event.message)

        async def hello(target):
            async with Fleet([target], ensure_keypair(), deadline_s=5, on_event=heard) as fleet:
                return (await fleet.run(0, "echo hi")).stdout

        t = replace(s.targets(publish_host_keys=False)[0], host_key_alias="tpu.1001-0")
        assert asyncio.run(hello(t)) == "hi\n"
        assert asyncio.run(hello(t)) == "hi\n"
        assert len(warnings) == 1 and "trusting it on first use" in warnings[0]
        other = ensure_keypair().load_private().export_public_key().decode().strip()
        with pytest.raises(HostKeyMismatch):
            asyncio.run(hello(replace(t, host_key=other)))

        # The node is deleted and a new one gets the same address and port (GCP reuses internal IPs) with a
        # new key: it is a new machine (a new node id), trusted on its own first use, not refused for the old
        # one's key, while the old machine's identity still refuses the new key.
        s.recreate(0)
        with pytest.raises(HostKeyMismatch):
            asyncio.run(hello(t))
        assert asyncio.run(hello(replace(t, host_key_alias="tpu.1002-0"))) == "hi\n"
        assert len(warnings) == 2
    finally:
        s.close()


@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the OpenSSH client")
def test_interactive_ssh_verifies_the_key_recorded_under_the_machine_identity(tmp_path, tpuctl_home, storage,
                                                                              monkeypatch):
    """`tpuctl ssh RUN` hands over to OpenSSH; it must find the key tpuctl trusted on first use (recorded under
    the machine's id, on a port other than 22) and refuse a new machine's key at the same address."""
    from tpuctl.cli.jobs import _interactive

    s = make_slice(tmp_path, storage, 1)
    try:
        key = ensure_keypair()
        t = replace(s.targets(publish_host_keys=False)[0], host_key_alias="tpu.2001-0")

        async def hello():
            async with Fleet([t], key, deadline_s=5) as fleet:
                return (await fleet.run(0, "echo hi")).stdout

        assert asyncio.run(hello()) == "hi\n"  # recorded on first use

        def openssh(target) -> subprocess.CompletedProcess:
            argv: list[str] = []
            monkeypatch.setattr(os, "execv", lambda _exe, a: argv.extend(a))
            _interactive(key, target)
            # Non-interactive for the test: no prompt, no terminal; the same host-key options.
            return subprocess.run([*argv[:-1], "-o", "BatchMode=yes", argv[-1], "echo", "shell"],
                                  capture_output=True, text=True, timeout=60)

        done = openssh(t)
        assert (done.returncode, done.stdout) == (0, "shell\n"), done.stderr
        s.recreate(0)
        refused = openssh(t)
        assert refused.returncode == 255 and "HOST IDENTIFICATION HAS CHANGED" in refused.stderr
    finally:
        s.close()


def test_detached_job_survives_the_launching_process(tmp_path, tpuctl_home, storage):
    s = make_slice(tmp_path, storage, 2)
    try:
        run = "detached"
        b = _ship(tmp_path, storage, _job(run, storage, workers=2, trainer={"max_steps": 30, "step_seconds": 0.05}))
        targets = [(t.index, t.host, t.port, t.host_key) for t in s.targets()]
        code = f"""
import asyncio, sys
from tpuctl.jobs.ssh import Fleet, Target
from tpuctl.jobs.keys import ensure_keypair
from tpuctl.jobs.bundle import Bundle
from tpuctl.jobs import launch
from pathlib import Path
async def go():
    async with Fleet([Target(*t) for t in {targets!r}], ensure_keypair()) as f:
        await launch.launch(f, run={run!r}, project="test-project", bucket={storage.bucket_name!r},
                            bundle=Bundle(Path({str(b.path)!r}), {b.sha256!r}, {run!r}), python={PYTHON!r})
        print("launched", flush=True)
        await asyncio.sleep(600)
asyncio.run(go())
"""
        proc = subprocess.Popen([PYTHON, "-c", code], stdout=subprocess.PIPE, text=True, env=os.environ.copy())
        assert proc.stdout.readline().strip() == "launched"
        proc.kill()
        proc.wait()

        async def wait():
            async with Fleet(s.targets(), ensure_keypair()) as fleet:
                return await _wait_done(fleet, run)

        assert [st.exit_code for st in asyncio.run(wait())] == [0, 0]
        assert "step=30" in (s.workdir(run, 1) / "job.log").read_text()
    finally:
        s.close()



@pytest.mark.slow  # fast tier: a launch: test_detached_job_survives_the_launching_process
def test_a_new_launch_replaces_the_running_one(tmp_path, tpuctl_home, storage):
    s = make_slice(tmp_path, storage, 1)
    try:
        run = "relaunch"
        b = _ship(tmp_path, storage, _job(run, storage, workers=1, trainer={"max_steps": 60, "step_seconds": 0.05}))

        async def go():
            async with Fleet(s.targets(), ensure_keypair()) as fleet:
                await launching.launch(fleet, run=run, project="test-project", bucket=storage.bucket_name,
                                       bundle=b, python=PYTHON)
                first = (await launching.poll(fleet, run))[0].pid
                log = s.workdir(run, 0) / "job.log"
                while "step=5 " not in (log.read_text() if log.exists() else ""):
                    await asyncio.sleep(0.05)
                await launching.launch(fleet, run=run, project="test-project", bucket=storage.bucket_name,
                                       bundle=b, python=PYTHON)
                second = (await launching.poll(fleet, run))[0].pid
                assert first != second
                return first, await _wait_done(fleet, run)

        first, states = asyncio.run(go())
        assert states[0].exit_code == 0
        with pytest.raises(ProcessLookupError):
            os.kill(first, 0)
        assert "restored step=" in (s.workdir(run, 0) / "job.log").read_text()
    finally:
        s.close()


def test_agent_prepare_skips_installed_requirements_and_caches(tmp_path, monkeypatch):
    from tpuctl.jobs.agent import install

    bundle = tmp_path / "bundle"
    (bundle / "tpl").mkdir(parents=True)
    (bundle / "tpl" / "requirements.txt").write_text("# already here\npytest>=7\nasyncssh ; python_version >= '3'\n")
    (bundle / "job.json").write_text(json.dumps({"requirements": "tpl/requirements.txt"}))
    calls = []
    monkeypatch.setattr(install.subprocess, "run", lambda *a, **k: calls.append(a))
    assert install.prepare(bundle, tmp_path / "cache") == 0
    assert calls == [] and len(list((tmp_path / "cache").iterdir())) == 1
    (bundle / "tpl" / "requirements.txt").write_text("pytest<1\n")
    monkeypatch.setattr(install.subprocess, "run", lambda argv, **k: calls.append(argv) or subprocess.CompletedProcess(argv, 0))
    assert install.prepare(bundle, tmp_path / "cache") == 0
    assert calls and calls[0][-1] == "pytest<1", "an installed version outside the specifier is installed"


@pytest.mark.parametrize("name", ["A;B", "$(id)", "X=Y", "1X", "a b", "L\nM"])
def test_hostile_env_names_are_refused(tmp_path, name):
    job = bundles.JobDescription(run="r1", project="p", bucket="b", module="standin.train", config={},
                                 env={name: "v"})
    with pytest.raises(BadInput) as e:
        bundles.build(STANDIN, job, tmp_path)
    assert e.value.field == "job.env"


# ---------------------------------------------------------------------------- checkpoints reach the bucket whole

class _Killed(Exception):
    """The agent dies here (SIGKILL after a cancel's grace): the upload in flight never happens."""


class _TfCheckpointWriter:
    """Writes checkpoints the way tf.train.CheckpointManager does, one filesystem operation per `advance()`:
    shards into ckpt-N_temp/, then the data files and the index, then the `checkpoint` pointer (an atomic
    NAME.tmp<hex> + rename), then deletes checkpoints beyond `keep`."""

    def __init__(self, d, every: int = 10, keep: int = 2, shards: int = 2):
        self.d, self.every, self.keep, self.shards = d, every, keep, shards
        self.kept: list[str] = []
        self.ops = self._ops()
        d.mkdir(parents=True, exist_ok=True)

    def _ops(self):
        step = 0
        while True:
            step += self.every
            name, temp = f"ckpt-{step}", self.d / f"ckpt-{step}_temp"
            yield lambda: temp.mkdir()
            for i in range(self.shards):
                yield lambda i=i: (temp / f"part-{i:05d}.data").write_text(f"{step}:{i}")
            for i in range(self.shards):
                yield lambda i=i: (self.d / f"{name}.data-{i:05d}-of-{self.shards:05d}").write_text(f"{step}:{i}")
                yield lambda i=i: (temp / f"part-{i:05d}.data").unlink()
            yield lambda: temp.rmdir()
            yield lambda: (self.d / f"{name}.index").write_text(str(step))
            self.kept = [*self.kept, name]
            proto = f'model_checkpoint_path: "{name}"\n' + "".join(
                f'all_model_checkpoint_paths: "{k}"\n' for k in self.kept[-self.keep:])
            tmp = self.d / "checkpoint.tmp3f2a9c"
            yield lambda: tmp.write_text(proto)
            yield lambda: tmp.replace(self.d / "checkpoint")
            for old in self.kept[:-self.keep]:
                for f in sorted(self.d.glob(f"{old}.*")):
                    yield lambda f=f: f.unlink()
            self.kept = self.kept[-self.keep:]

    def advance(self, n: int) -> None:
        for _ in range(n):
            next(self.ops)()


def _restorable(bucket, prefix: str, shards: int = 2) -> int | None:
    """The step a fresh worker would restore from the bucket (None: no checkpoint yet). Fails if the pointer
    names a checkpoint that is not wholly there, or a checkpoint older than it is half there."""
    objects = {b.name[len(prefix) + 1:]: b for b in bucket.list_blobs(prefix=prefix + "/")}
    assert not [n for n in objects if "_temp" in n or ".tmp" in n], sorted(objects)
    if "checkpoint" not in objects:
        assert not objects, f"checkpoint files without a pointer: {sorted(objects)}"
        return None
    names = re.findall(r'"(ckpt-\d+)"', objects["checkpoint"].download_as_text())
    newest = int(names[0].split("-")[1])
    for name in names:
        step = name.split("-")[1]
        assert objects[f"{name}.index"].download_as_text() == step, (name, sorted(objects))
        for i in range(shards):
            assert objects[f"{name}.data-{i:05d}-of-{shards:05d}"].download_as_text() == f"{step}:{i}"
    for n in objects:  # anything else is newer: an upload that a kill interrupted before its pointer
        m = re.match(r"ckpt-(\d+)\.", n)
        assert not m or f"ckpt-{m.group(1)}" in names or int(m.group(1)) > newest, (n, names)
    return newest


# Seed 0 in the fast tier; the other five (2-8 s each) draw other interleavings in the whole suite.
@pytest.mark.parametrize("seed", [0, *(pytest.param(seed, marks=pytest.mark.slow) for seed in range(1, 6))])
def test_cancel_at_random_moments_of_checkpoint_writes_leaves_a_restorable_checkpoint(tmp_path, storage,
                                                                                       monkeypatch, seed):
    """The agent syncs a model directory to the bucket while the program writes checkpoints; uploads
    interleave with the program's writes at random (seeded) points, and a cancel stops the program at a random
    operation, after which the final sync may itself be killed mid-way. After every sync the bucket's
    pointer names a complete checkpoint, and it never goes back to an older one."""
    import random

    from google.cloud.storage import Blob

    from tpuctl.jobs.agent.mirror import Mirror

    rng = random.Random(seed)
    job = {"project": "test-project", "bucket": storage.bucket_name, "prefix": "runs/r1"}
    store = Mirror(job, 0, tmp_path / "mirror")
    url = f"gs://{storage.bucket_name}/runs/r1/model/checkpoints"
    writer = _TfCheckpointWriter(store.local(url))
    state = {"writing": True, "kill_after": None}

    def interleaved(real):
        def call(self, *args, **kwargs):
            if state["writing"]:
                writer.advance(rng.randint(0, 4))  # the program goes on while the agent uploads
            if state["kill_after"] is not None:
                if state["kill_after"] == 0:
                    raise _Killed()
                state["kill_after"] -= 1
            return real(self, *args, **kwargs)
        return call

    for method in ("upload_from_filename", "upload_from_string", "delete"):
        monkeypatch.setattr(Blob, method, interleaved(getattr(Blob, method)))
    bucket = storage.client().bucket(storage.bucket_name)
    prefix = "runs/r1/model/checkpoints"
    seen = None
    for _ in range(rng.randint(3, 12)):  # heartbeats while training
        writer.advance(rng.randint(1, 15))
        store.upload_dir(url)
        now = _restorable(bucket, prefix)
        assert seen is None or (now is not None and now >= seen), (seen, now)
        seen = now
    writer.advance(rng.randint(0, 20))  # the cancel lands mid-write
    state["writing"] = False
    state["kill_after"] = rng.choice([None, rng.randint(0, 6)])
    try:
        store.upload_dir(url)  # the agent's final sync
    except _Killed:
        pass
    final = _restorable(bucket, prefix)
    assert seen is None or (final is not None and final >= seen), (seen, final)
    if state["kill_after"] is None:  # a final sync that finished publishes the program's last checkpoint
        local = re.findall(r'model_checkpoint_path: "ckpt-(\d+)"', (writer.d / "checkpoint").read_text()) \
            if (writer.d / "checkpoint").exists() else []
        assert final == (int(local[0]) if local else None)


def test_a_restore_replaces_a_stale_pointer_of_the_same_size(tmp_path, storage):
    """After a preemption a worker's disk may still hold its own older checkpoint pointer: the bucket's newer
    one has the same size (ckpt-10.json vs ckpt-30.json) and must still win, or the worker resumes from 10."""
    from tpuctl.jobs.agent.mirror import Mirror

    store = Mirror({"project": "test-project", "bucket": storage.bucket_name, "prefix": "runs/r1"}, 1,
                        tmp_path / "mirror")
    url = f"gs://{storage.bucket_name}/runs/r1/model"
    bucket = storage.client().bucket(storage.bucket_name)
    for name, text in (("checkpoint", "ckpt-30.json"), ("ckpt-30.json", '{"step": 30}'),
                       ("ckpt-10.json", '{"step": 10}')):
        bucket.blob(f"runs/r1/model/{name}").upload_from_string(text)
    local = store.local(url)
    local.mkdir(parents=True)
    (local / "checkpoint").write_text("ckpt-10.json")
    (local / "ckpt-10.json").write_text('{"step": 10}')
    assert store.download_prefix(url) == 2  # the pointer and ckpt-30; ckpt-10 is already the same
    assert (local / "checkpoint").read_text() == "ckpt-30.json"


def test_the_laptops_verdict_outlives_a_stopping_agent_and_the_next_launch_starts_a_new_account(storage, tmp_path):
    """status.json has two writers. When the laptop has said how the run ended (here: Google ended the TPU at
    its max run duration), an agent still stopping must not overwrite it (the CI failure: its last beat landed
    after the verdict and dropped `ended`); `recovering` is the laptop's alone; the next launch opens a fresh
    account that the new agents write to."""
    from types import SimpleNamespace

    from tpuctl.jobs import cluster
    from tpuctl.jobs.agent.mirror import Mirror

    laptop, bucket = SimpleNamespace(storage=storage.client()), storage.bucket_name
    store = Mirror({"project": "test-project", "bucket": bucket, "prefix": "runs/r1"}, 0, tmp_path)

    def read():
        return cluster.read_status(laptop, bucket, "r1")

    cluster.open_status(laptop, bucket, "r1", recovering=False)
    store.merge_status({"state": "running", "step": 40, "exit_code": None})
    cluster.update_status(laptop, bucket, "r1", state="running", recovering=True)
    store.merge_status({"state": "failed", "step": 45, "exit_code": 143})  # the old job's last beat
    assert read().recovering is True and read().step == 45
    # The laptop (or a supervisor that attached as the job ended) saw no step: the agents' step stays.
    cluster.close_status(laptop, bucket, "r1", state="failed", ended="max_run_duration", step=None)
    store.merge_status({"state": "failed", "step": 46, "exit_code": 143})  # lands after the verdict
    doc = read()
    assert doc.state == "failed" and doc.ended == "max_run_duration" and doc.final is True, doc
    assert doc.step == 45 and doc.recovering is False, doc

    cluster.open_status(laptop, bucket, "r1", recovering=False)  # `tpuctl run --name r1` resumes
    store.merge_status({"state": "running", "step": 50, "exit_code": None})
    doc = read()
    assert doc.state == "running" and doc.step == 50 and not doc.final and doc.ended is None, doc
