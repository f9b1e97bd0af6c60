"""Shared fixtures: one strict local cloud per test session, and the OFFICIAL Google clients pointed at it.

    def test_something(clients):                # a fresh project id per test, so tests never collide
        op = clients.tpu.create_node(parent=clients.parent("europe-west4-a"), node_id="n1", node=...)
        node = op.result(polling=FAST_POLLING, timeout=30)

`localcloud` is the session's `LocalCloud(speed=1000, strict=True)` (a TPU create takes ~0.2 s);
`cloud` is the same object with its faults cleared after the test; `clients` carries every official
client (REST, AnonymousCredentials, ClientOptions(api_endpoint=...); storage via STORAGE_EMULATOR_HOST,
which the session fixture sets while the cloud lives). Build more with `official_clients(cloud, project)`.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from google.api_core.client_options import ClientOptions
from google.api_core.future import polling
from google.auth.credentials import AnonymousCredentials

from tpuctl.localcloud.cloud import LocalCloud

# Every local cloud the tests start (in process, or a daemon in a subprocess) runs TPU jobs on this
# interpreter: building each runtime image's TensorFlow venv would cost minutes and ~1.5 GB per image. The one
# test that runs the default runtime's own TensorFlow asks for worker_python="runtime" explicitly
# (test_runtime_images.py); TPUCTL_RUNTIME_CACHE, when set, keeps its image venv across sessions.
os.environ["TPUCTL_WORKER_PYTHON"] = "host"
# With the TPU compiler installed (the test extra brings libtpu), a JAX that may pick its platform tries the
# TPU first and logs libtpu's complaints about the missing chips on stderr; the tests' JAX runs on the CPU
# (tpuctl fit compiles for TPU topologies without a TPU backend).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# tpuctl probes the metadata server (GCE_METADATA_IP) once a Google project is named, as google.auth does. Off
# Google Cloud nothing answers there, and tests send traffic to loopback only: any probe a test does not aim itself
# lands on a closed local port (the metadata-server tests set their own address). GCE_METADATA_HOST stays unset:
# the template's guest code takes it to mean "on a TPU VM".
os.environ.setdefault("GCE_METADATA_IP", "127.0.0.1:9")

# Operation futures poll every 10-50 ms instead of the library's 1-20 s.
FAST_POLLING = polling.DEFAULT_POLLING.with_delay(initial=0.01, maximum=0.05).with_timeout(60)


@dataclass(frozen=True)
class OfficialClients:
    """Google's own clients against a LocalCloud, plus the project they act in."""

    project: str
    tpu: object
    instances: object
    zone_operations: object
    zones: object
    machine_types: object
    projects: object
    billing: object
    storage: object

    def parent(self, zone: str) -> str:
        return f"projects/{self.project}/locations/{zone}"

    def wait_compute(self, zone: str, op, timeout: float = 30.0):
        """Wait for a Compute zone operation with ZoneOperationsClient.wait (bounded); returns it DONE."""
        from google.cloud import compute_v1

        deadline = time.monotonic() + timeout
        while True:
            op = self.zone_operations.wait(project=self.project, zone=zone, operation=op.name)
            if op.status == compute_v1.Operation.Status.DONE:
                return op
            if time.monotonic() > deadline:
                raise TimeoutError(f"operation {op.name} not done after {timeout} s")


def on_jax(module: str, check: str, timeout: float = 150) -> str:
    """`in_fresh_interpreter` with KERAS_BACKEND=jax: Keras fixes its backend at import, once per process."""
    return in_fresh_interpreter(module, check, backend="jax", timeout=timeout)


def in_fresh_interpreter(module: str, check: str, *, backend: str, timeout: float = 150) -> str:
    """Run `module.check()` (a test module's function that raises on failure and returns the backend it ran on)
    in a fresh interpreter with KERAS_BACKEND=`backend` (also for what must precede TensorFlow's initialisation,
    such as splitting the CPU into logical devices). Returns what it returned; fails the test with its stderr."""
    return _fresh(f"import {module} as t; print(t.{check}())", backend, timeout).split()[-1]


def on_jax_each(module: str, checks: tuple[str, ...], timeout: float = 300) -> dict[str, str]:
    """Several of `module`'s checks in ONE fresh interpreter with KERAS_BACKEND=jax (starting one with JAX and
    Keras costs ~10 s on 2 cores): check -> the backend it returned, or the traceback it raised."""
    code = (f"import json, traceback, {module} as t\nout = {{}}\nfor c in {checks!r}:\n    try:\n"
            f"        out[c] = getattr(t, c)()\n    except Exception:\n        out[c] = traceback.format_exc()\n"
            f"print(json.dumps(out))")
    return json.loads(_fresh(code, "jax", timeout).splitlines()[-1])


def _fresh(code: str, backend: str, timeout: float) -> str:
    """stdout of `python -c code` in tests/ with KERAS_BACKEND=`backend`; fails the test with its stderr."""
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(__file__), env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def process_alive(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has). /proc's entry can vanish between opening and
    reading it (ESRCH, when the parent reaps the process in between), which is dead too."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def official_clients(cloud: LocalCloud, project: str) -> OfficialClients:
    from google.cloud import billing_v1, compute_v1, resourcemanager_v3, storage, tpu_v2

    opts = ClientOptions(api_endpoint=cloud.endpoint)
    cred = AnonymousCredentials()
    kw = {"transport": "rest", "client_options": opts, "credentials": cred}
    return OfficialClients(
        project=project,
        tpu=tpu_v2.TpuClient(**kw),
        instances=compute_v1.InstancesClient(**kw),
        zone_operations=compute_v1.ZoneOperationsClient(**kw),
        zones=compute_v1.ZonesClient(**kw),
        machine_types=compute_v1.MachineTypesClient(**kw),
        projects=resourcemanager_v3.ProjectsClient(**kw),
        billing=billing_v1.CloudCatalogClient(**kw),
        storage=storage.Client(project=project, credentials=cred),
    )


def new_project() -> str:
    return f"lc-test-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def localcloud():
    """The session's strict local cloud at speed 1000; STORAGE_EMULATOR_HOST points at it meanwhile."""
    previous = os.environ.get("STORAGE_EMULATOR_HOST")
    with LocalCloud(speed=1000, strict=True, worker_python="host") as cloud:
        os.environ["STORAGE_EMULATOR_HOST"] = cloud.storage_host
        try:
            yield cloud
        finally:
            if previous is None:
                os.environ.pop("STORAGE_EMULATOR_HOST", None)
            else:
                os.environ["STORAGE_EMULATOR_HOST"] = previous


def cli_env(cloud, home: Path, project: str | None = None) -> dict:
    """The environment of a `tpuctl` subprocess against `cloud`: none of the caller's tpuctl, gcloud or Google
    settings, `home` as HOME (tpuctl's own under home/home), `project` (a fresh one by default), no colours."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("TPUCTL_", "CLOUDSDK_", "GOOGLE_"))}
    e.update(TPUCTL_API_ENDPOINT=cloud.endpoint, STORAGE_EMULATOR_HOST=cloud.storage_host,
             TPUCTL_PROJECT=project or new_project(), TPUCTL_HOME=str(home / "home"), HOME=str(home), NO_COLOR="1",
             PYTHONUNBUFFERED="1")
    return e


def tpuctl(env: dict, *args: str, timeout: float = 120, cwd=None) -> subprocess.CompletedProcess:
    """`python -m tpuctl ARGS` in `env`, stdin closed (no terminal, so it never asks), output captured."""
    return subprocess.run([sys.executable, "-m", "tpuctl", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, cwd=cwd)


def tpuctl_here(env: dict, *args: str, cwd=None) -> subprocess.CompletedProcess:
    """`tpuctl(env, *args)` in this process: a `tpuctl` subprocess spends ~2.5 s on 2 cores importing Google's
    clients before it parses a flag. For refusals, dry runs and read-only commands; keep at least one real
    subprocess per command (`tpuctl`), which also tests the entry point, its signals and its exit codes.
    os.environ is exactly `env` meanwhile (as for the process), stdin is no terminal, the cwd is `cwd`."""
    import contextlib
    import io

    from tpuctl import console
    from tpuctl.cli import cli

    out, err = io.StringIO(), io.StringIO()
    saved = dict(os.environ), (console.out.file, console.err.file), os.getcwd(), sys.stdin
    os.environ.clear()
    os.environ.update(env)
    console.out.file, console.err.file = out, err  # rich's consoles keep the streams they found at import
    sys.stdin = io.StringIO("")
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli.main(args=list(args), prog_name="tpuctl")
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.environ.clear()
        os.environ.update(saved[0])
        console.out.file, console.err.file = saved[1]
        os.chdir(saved[2])
        sys.stdin = saved[3]
    return subprocess.CompletedProcess(["tpuctl", *args], code, out.getvalue(), err.getvalue())


@pytest.fixture
def env(cloud, tmp_path) -> dict:
    """A `tpuctl` subprocess environment (cli_env) in a fresh project."""
    return cli_env(cloud, tmp_path)


@pytest.fixture
def pc(cloud, env):
    """tpuctl's own clients (provision.clients.build) for `env`'s project."""
    from tpuctl.provision.clients import build

    return build(project=env["TPUCTL_PROJECT"], credentials=AnonymousCredentials(), endpoint=cloud.endpoint,
                 storage_host=cloud.storage_host, local=True)


@pytest.fixture(scope="session")
def runtime_cache(tmp_path_factory) -> Path:
    """Where runtime image venvs are built: `$TPUCTL_RUNTIME_CACHE` (kept across sessions), else one dir for
    the session, so an image is built at most once per session."""
    if os.environ.get("TPUCTL_RUNTIME_CACHE"):
        return Path(os.environ["TPUCTL_RUNTIME_CACHE"])
    return tmp_path_factory.mktemp("runtimes")


@pytest.fixture
def cloud(localcloud):
    """The session cloud; faults injected by the test are cleared afterwards, and a scheduled transition
    that crashed meanwhile (a localcloud bug) fails the test."""
    yield localcloud
    localcloud.faults.clear()
    errors, localcloud.world.errors[:] = list(localcloud.world.errors), []
    if errors:
        pytest.fail("localcloud transitions failed: " + "; ".join(errors))


@pytest.fixture
def clients(cloud) -> OfficialClients:
    """Official clients in a fresh project (resources of other tests are invisible to list calls)."""
    return official_clients(cloud, new_project())


@pytest.fixture
def metadata_server():
    """A Compute Engine metadata server stand-in on 127.0.0.1, as Cloud Run, Compute Engine and GKE give one:
    it answers google.auth's detection probe (`GET /` with `Metadata-Flavor: Google` -> 200 with that header,
    google/auth/compute_engine/_metadata.py `ping`). Yields the environment that points Google's libraries at
    it: GCE_METADATA_IP (where google.auth probes) and GCE_METADATA_HOST (where it asks for tokens)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.headers.get("Metadata-Flavor") == "Google"
            self.send_response(200 if ok else 403)
            self.send_header("Metadata-Flavor", "Google")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host = f"127.0.0.1:{server.server_address[1]}"
    try:
        yield {"GCE_METADATA_IP": host, "GCE_METADATA_HOST": host}
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def no_metadata_server() -> dict:
    """The environment of a machine off Google Cloud: google.auth's metadata probe meets a closed port on
    127.0.0.1 (refused at once, where 169.254.169.254 could hang or, on a Google VM, answer)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"GCE_METADATA_IP": f"127.0.0.1:{port}", "GCE_METADATA_HOST": f"127.0.0.1:{port}"}


@pytest.fixture
def cli_stderr(monkeypatch):
    """What an in-process CLI (click's CliRunner) writes to stderr: tpuctl's console keeps the stream it found
    at import, which CliRunner does not replace."""
    import io

    from tpuctl import console

    buf = io.StringIO()
    monkeypatch.setattr(console.err, "file", buf)
    return buf


@pytest.fixture(autouse=True)
def keras_dtype_policy_unchanged():
    """Keras' dtype policy is process-global: a test that leaves it changed (mixed_bfloat16 after an in-process
    train.run) silently changes the numerics of every test after it (issue 33). The leaking test errors here and
    the policy is put back, so the failure points at the leak, not at whichever test happens to run next."""
    def policy():
        keras = sys.modules.get("keras")  # never imports Keras: it fixes its backend at import
        return keras.config.dtype_policy().name if keras else None

    before = policy()
    yield
    after = policy()
    if before is None and after is not None:
        before = sys.modules["keras"].config.floatx()  # Keras' default policy, before anything set one
    if after != before:
        sys.modules["keras"].config.set_dtype_policy(before)
        pytest.fail(f"the test left Keras' global dtype policy at {after} (it was {before}); restore it")


def pytest_addoption(parser):
    parser.addoption("--order", default="", metavar="reverse|random:SEED",
                     help="run the tests in another order, to show that none depends on what ran before it: "
                          "reverse (the last test first) or random:SEED (the files in a seeded random order)")


@pytest.hookimpl(trylast=True)  # after pytest's own grouping of tests by parametrized fixture: both orders keep it
def pytest_collection_modifyitems(config, items):
    order = config.getoption("order")
    if order == "reverse":
        items.reverse()
    elif order.startswith("random:") and order[7:].isdigit():
        files = list(dict.fromkeys(item.path for item in items))
        random.Random(int(order[7:])).shuffle(files)
        rank = {path: i for i, path in enumerate(files)}
        items.sort(key=lambda item: rank[item.path])  # stable: a file's tests keep their order and module fixtures
    elif order:
        raise pytest.UsageError(f"--order: {order!r} is not reverse or random:SEED (e.g. random:7)")


def pytest_report_header(config):
    if config.getoption("order"):
        return f"test order: {config.getoption('order')} (rerun with the same --order to reproduce)"
