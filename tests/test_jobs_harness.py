"""Test doubles for the jobs tests (no tests here): localcloud's Cloud Storage and a slice of SSH workers.

`FakeSlice` starts one asyncssh server per worker on 127.0.0.1, each accepting only the test's key and
running commands with bash in its own directory, with the environment a localcloud TPU worker has. Jobs
started there are real detached processes; the fixture kills their process groups at teardown.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import threading
from pathlib import Path

import asyncssh
import pytest

from tpuctl.jobs.keys import ensure_keypair
from tpuctl.jobs.ssh import Target

STANDIN = Path(__file__).parent / "job_templates" / "standin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StorageEmulator:
    """A bucket on localcloud's Cloud Storage (generations, preconditions and object locks as GCS has them; the
    raw engine under it ignores preconditions, so the status protocol's ifGenerationMatch would go untested)."""

    def __init__(self, bucket: str):
        from tpuctl.localcloud.storage import StorageServer

        self.server = StorageServer(None)
        self.host = self.server.start()
        self.bucket_name = bucket
        self.client().create_bucket(bucket, location="us-central1")

    def client(self):
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(project="test-project", credentials=AnonymousCredentials(),
                              client_options={"api_endpoint": self.host})

    def stop(self) -> None:
        self.server.stop()


class FakeSlice:
    def __init__(self, root: Path, workers: int, authorized: str, env: dict[str, str]):
        self.root = root
        self.n = workers
        self.env = env
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.host_keys = [asyncssh.generate_private_key("ssh-ed25519") for _ in range(workers)]
        self.ports = [free_port() for _ in range(workers)]
        self.dirs = [root / f"worker-{i}" for i in range(workers)]
        self.authorized = asyncssh.import_authorized_keys(authorized)
        self.servers = [self._call(self._start(i)) for i in range(workers)]
        self.connections: list[asyncssh.SSHServerConnection] = []
        self.commands: list[str] = []

    def _call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, i: int):
        self.dirs[i].mkdir(parents=True, exist_ok=True)
        slice_ = self

        class Server(asyncssh.SSHServer):
            def connection_made(self, conn):
                slice_.connections.append(conn)

        async def handle(process: asyncssh.SSHServerProcess) -> None:
            slice_.commands.append(process.command or "")
            env = {**os.environ, **self.env}
            proc = await asyncio.create_subprocess_exec(
                "bash", "-c", process.command or "bash", cwd=self.dirs[i], env=env, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
            async def pump(src, dst):
                while chunk := await src.read(65536):
                    dst.write(chunk)

            async def feed():
                try:
                    while chunk := await process.stdin.read(65536):
                        proc.stdin.write(chunk)
                except (asyncssh.BreakReceived, asyncssh.TerminalSizeChanged):
                    pass
                proc.stdin.close()

            feeder = asyncio.ensure_future(feed())
            try:
                # Like sshd: the session ends when the command's output pipes close, not merely when it exits.
                await asyncio.gather(pump(proc.stdout, process.stdout), pump(proc.stderr, process.stderr))
                process.exit(await proc.wait())
            finally:
                feeder.cancel()
                if proc.returncode is None:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass

        return await asyncssh.create_server(
            Server, "127.0.0.1", self.ports[i], server_host_keys=[self.host_keys[i]],
            authorized_client_keys=self.authorized, process_factory=handle, encoding=None)

    def recreate(self, i: int) -> None:
        """Worker i comes back as a new machine at the same address and port, with a new host key."""
        async def restart():
            self.servers[i].close()
            await self.servers[i].wait_closed()
            self.host_keys[i] = asyncssh.generate_private_key("ssh-ed25519")
            self.servers[i] = await self._start(i)

        self._call(restart())

    def targets(self, publish_host_keys: bool = True) -> list[Target]:
        return [Target(index=i, host="127.0.0.1", port=self.ports[i],
                       host_key=self.host_keys[i].export_public_key().decode().strip() if publish_host_keys else None)
                for i in range(self.n)]

    def drop_connections(self) -> int:
        """Abort every open SSH connection (an injected network drop)."""
        live = [c for c in self.connections if not c.is_closed()]

        async def drop():
            for c in live:
                c.abort()

        self._call(drop())
        return len(live)

    def workdir(self, run: str, i: int) -> Path:
        return self.dirs[i] / ".tpuctl" / "runs" / run / f"w{i}"

    def kill_jobs(self, sig: int = signal.SIGKILL) -> None:
        """Kill every detached job on the slice (what deleting or preempting the node does)."""
        for pid_file in self.root.rglob("agent.pid"):
            try:
                os.killpg(int(pid_file.read_text()), sig)
            except (ProcessLookupError, ValueError, PermissionError):
                pass

    def close(self) -> None:
        self.kill_jobs()

        async def stop():
            for s in self.servers:
                s.close()
                await s.wait_closed()

        self._call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def tpuctl_home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("TPUCTL_HOME", str(home))
    return home


@pytest.fixture
def storage(monkeypatch):
    emu = StorageEmulator("job-bucket")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emu.host)
    yield emu
    emu.stop()


def make_slice(tmp_path: Path, storage: StorageEmulator, workers: int) -> FakeSlice:
    key = ensure_keypair()
    return FakeSlice(tmp_path / "slice", workers, key.public_key, {"STORAGE_EMULATOR_HOST": storage.host})


@pytest.fixture
def slice4(tmp_path, tpuctl_home, storage):
    s = make_slice(tmp_path, storage, 4)
    yield s
    s.close()


PYTHON = sys.executable
