"""Stand-in TPU workers and VMs: one real SSH server (asyncssh) per worker on 127.0.0.1.

Each worker behaves like a freshly booted VM as far as tpuctl can tell over SSH: its own port and
ed25519 host key, key-only auth from GCP `ssh-keys` metadata lines, `bash` for exec requests and shells,
a per-worker directory as cwd and HOME, and processes that outlive the SSH session when they detach.

Every process a worker starts carries ``LOCALCLOUD_WORKER=<worker dir>`` (percent-encoded) in its
environment. Descendants inherit it even after ``setsid``/``nohup``/double-fork, so stopping a worker finds
them all by scanning ``/proc/*/environ`` (``ps e`` where there is no /proc, e.g. macOS) instead of trusting
process groups that detached code escapes on purpose. A process that rewrites its own environment
(``env -i``) escapes this net; nothing tpuctl ships does that.

Each worker also gets its own Compute Engine metadata server endpoint (`metadata.py`) when the caller gives
the pool a metadata tree: the worker's environment points `GCE_METADATA_HOST`/`GCE_METADATA_IP` at it, which is
how google-auth and JAX on a worker find "the" metadata server. Nothing else about the node's identity is put
in the environment: real TPU VMs set no `TPU_WORKER_ID` (that is GKE's), workers read it from metadata.

The pool runs its own asyncio loop in one background thread because its callers (the threaded API server)
are synchronous. Public methods are thread-safe, serialised by one lock, and block until done.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import asyncssh

from .metadata import MetadataServer, Tree

MARKER_VAR = "LOCALCLOUD_WORKER"
ANY_USER = "*"
LOOPBACK = "127.0.0.1"

_PROC = Path("/proc")

# Long enough for a training script to flush a checkpoint on SIGTERM, short enough for tests at speed 1000.
TERM_GRACE_S = 2.0
_KILL_DEADLINE_S = 5.0
_CALL_TIMEOUT_S = 60.0
_CHUNK = 1 << 16
# After a pty session's command exits, how long to forward what it left in the terminal before closing;
# background jobs still holding the terminal do not keep the session open (they get SIGHUP instead).
_PTY_DRAIN_S = 1.0
_KEY_RE = re.compile(r"[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*")
# Host key and port live in a hidden folder so a user's `rm -rf *` in HOME does not change the VM identity.
_STATE_DIR = ".localcloud"


@dataclass(frozen=True)
class WorkerEndpoint:
    """Where one worker listens and the public host key it presents ("ssh-ed25519 AAAA...")."""

    host: str
    port: int
    host_key: str


def _public_key(text: str) -> asyncssh.SSHKey | None:
    try:
        return asyncssh.import_public_key(text.strip())
    except (asyncssh.KeyImportError, ValueError):
        return None


def parse_ssh_keys(lines: Iterable[str]) -> dict[str, frozenset[bytes]]:
    """GCP `ssh-keys` metadata lines (``USER:KEYTYPE KEY [COMMENT]``) -> public key blobs per user.

    A line that is a bare ``KEYTYPE KEY [COMMENT]`` (authorized_keys style) admits that key for any
    user name, under ``ANY_USER``. Malformed lines are skipped, as the guest agent skips them, so one bad
    entry cannot lock everyone out.
    """
    keys: dict[str, set[bytes]] = {}
    for line in "\n".join(lines).splitlines():
        key = _public_key(line)
        user = ANY_USER
        if key is None:
            user, sep, key_text = line.strip().partition(":")
            key = _public_key(key_text) if sep and user else None
        if key is not None:
            keys.setdefault(user, set()).add(key.public_data)
    return {user: frozenset(blobs) for user, blobs in keys.items()}


def marker(directory: Path) -> str:
    """The ``LOCALCLOUD_WORKER`` value of a worker dir: percent-encoded, so it never contains a space."""
    return quote(str(directory))


def _environments() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, environment entries) of every process this user may inspect, except this one.

    Linux: /proc/PID/environ (a zombie's reads empty). Elsewhere: BSD ``ps e`` appends each process's
    environment to its command line, space-separated, which is why markers contain no spaces.
    """
    own = os.getpid()
    if _PROC.is_dir():
        for entry in os.scandir(_PROC):
            if entry.name.isdigit() and int(entry.name) != own:
                try:
                    environ = Path(entry.path, "environ").read_bytes()
                except OSError:
                    continue
                yield int(entry.name), environ.split(b"\0")
        return
    listing = subprocess.run(["ps", "axeww", "-o", "pid=,command="], capture_output=True, check=True).stdout
    for line in listing.splitlines():
        pid, _, rest = line.strip().partition(b" ")
        if pid.isdigit() and int(pid) != own:
            yield int(pid), rest.split(b" ")


def _marked_pids(owned: Callable[[bytes], bool]) -> list[int]:
    """Pids of live processes whose ``LOCALCLOUD_WORKER`` value is ``owned``."""
    prefix = f"{MARKER_VAR}=".encode()
    return [pid for pid, environ in _environments()
            if any(var.startswith(prefix) and owned(var[len(prefix):]) for var in environ)]


def _signal_all(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _kill_marked(owned: Callable[[bytes], bool]) -> None:
    """Kill every process whose marker is ``owned``: SIGTERM, a grace period, then SIGKILL.

    Blocks until none is left. Repeats the scan because a process may fork while being killed.
    """
    pids = _marked_pids(owned)
    _signal_all(pids, signal.SIGTERM)
    grace_end = time.monotonic() + TERM_GRACE_S
    while pids and time.monotonic() < grace_end:
        time.sleep(0.05)
        pids = _marked_pids(owned)
    kill_end = time.monotonic() + _KILL_DEADLINE_S
    while pids:
        if time.monotonic() > kill_end:
            raise RuntimeError(f"worker processes survived SIGKILL: {pids}")
        _signal_all(pids, signal.SIGKILL)
        time.sleep(0.02)
        pids = _marked_pids(owned)


def _kill_workers(worker_dirs: Iterable[Path]) -> None:
    """Kill every process the given workers started, detached ones included."""
    _kill_marked(frozenset(marker(d).encode() for d in worker_dirs).__contains__)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


class _Worker:
    """One worker's SSH server and the state it needs; touched only from the pool's loop thread."""

    def __init__(self, directory: Path, env: dict[str, str]) -> None:
        self.dir = directory
        self.env = env
        self.keys: dict[str, frozenset[bytes]] = {}
        self.acceptor: asyncssh.SSHAcceptor | None = None
        self.endpoint: WorkerEndpoint | None = None
        self.conns: set[asyncssh.SSHServerConnection] = set()
        self.reapers: set[asyncio.Task] = set()

    @property
    def running(self) -> bool:
        return self.acceptor is not None

    def _host_key(self) -> asyncssh.SSHKey:
        path = self.dir / _STATE_DIR / "ssh_host_ed25519_key"
        if path.exists():
            return asyncssh.read_private_key(path)
        key = asyncssh.generate_private_key("ssh-ed25519")
        path.parent.mkdir(parents=True, exist_ok=True)
        key.write_private_key(path)
        return key

    async def boot(self, startup_script: str | None) -> WorkerEndpoint:
        """Listen (on the port this worker had before, when it is free) and run the startup script."""
        self.dir.mkdir(parents=True, exist_ok=True)
        host_key = self._host_key()
        port_file = self.dir / _STATE_DIR / "port"
        previous = int(port_file.read_text()) if port_file.exists() else 0
        options = dict(
            server_host_keys=[host_key],
            process_factory=self._serve,
            encoding=None,
            # A requested pty is a real one (below), which echoes and edits lines itself.
            line_editor=False,
            sftp_factory=lambda chan: asyncssh.SFTPServer(chan, chroot=os.fsencode(self.dir)),
            allow_scp=True,
        )
        try:
            self.acceptor = await asyncssh.create_server(lambda: _Session(self), LOOPBACK, previous, **options)
        except OSError:
            # The old port is taken by something else now: a re-created VM gets a new address too.
            self.acceptor = await asyncssh.create_server(lambda: _Session(self), LOOPBACK, 0, **options)
        port = self.acceptor.get_port()
        port_file.write_text(str(port))
        public = host_key.export_public_key("openssh").decode().split()
        self.endpoint = WorkerEndpoint(LOOPBACK, port, " ".join(public[:2]))
        if startup_script is not None:
            await self._run_startup_script(startup_script)
        return self.endpoint

    async def _run_startup_script(self, script: str) -> None:
        path = self.dir / _STATE_DIR / "startup-script"
        path.write_text(script)
        with open(self.dir / "startup-script.log", "ab") as log:
            proc = await asyncio.create_subprocess_exec(
                "bash", str(path), stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
                cwd=self.dir, env=self.env, start_new_session=True, preexec_fn=_session_preexec(),
            )
        reaper = asyncio.ensure_future(proc.wait())
        self.reapers.add(reaper)
        reaper.add_done_callback(self.reapers.discard)

    async def shutdown(self) -> None:
        """Stop listening and drop every session; the processes are killed by the caller."""
        if self.acceptor is not None:
            self.acceptor.close()
            await self.acceptor.wait_closed()
            self.acceptor = None
        self.drop_connections()

    def drop_connections(self) -> None:
        for conn in list(self.conns):
            conn.abort()

    async def _serve(self, process: asyncssh.SSHServerProcess) -> None:
        """Run one exec request (``bash -c CMD``) or shell as a local process, streaming I/O.

        Without a pty a shell is ``bash -s`` on pipes; with one (``ssh -t``) it is ``bash -i`` on a real
        pseudo-terminal that becomes the session's controlling terminal, so ^C and window size work.
        """
        user = process.get_extra_info("username")
        env = {**self.env, "USER": user, "LOGNAME": user}
        term = process.get_terminal_type()
        shell = ["bash", "-s"] if term is None else ["bash", "-i"]
        argv = ["bash", "-c", process.command] if process.command is not None else shell
        if term is None:
            await _run_on_pipes(process, argv, self.dir, env)
        else:
            await _run_on_pty(process, argv, self.dir, {**env, "TERM": term})


async def _run_on_pipes(process: asyncssh.SSHServerProcess, argv: list[str], cwd: Path,
                        env: dict[str, str]) -> None:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        cwd=cwd, env=env, start_new_session=True, preexec_fn=_session_preexec(),
    )

    async def write(data: bytes) -> None:
        proc.stdin.write(data)
        await proc.stdin.drain()

    outputs = [
        asyncio.ensure_future(_pump_out(proc.stdout, process.stdout)),
        asyncio.ensure_future(_pump_out(proc.stderr, process.stderr)),
    ]
    feeder = asyncio.ensure_future(_pump_in(process, proc.pid, write, proc.stdin.close))
    hangup = asyncio.ensure_future(_hang_up_on_close(process, proc))
    returncode = await proc.wait()
    # Like sshd, the session ends when the output pipes close, not when bash exits: a background job
    # that still holds stdout keeps the session open.
    await asyncio.gather(*outputs)
    feeder.cancel()
    hangup.cancel()
    _exit(process, returncode)


# What sshd's per-connection child sets back to the default before any session starts (OpenSSH sshd.c: "We
# will not restart on SIGHUP", then SIG_DFL for ALRM, HUP, TERM, QUIT, CHLD, INT), plus SIGPIPE, which
# session.c's do_child restores for the user's command. A guest command's signals are the VM's, never
# whatever the host process ignores (a `nohup tpuctl`, a test runner under nohup): an ignored SIGHUP would
# keep a hung-up command alive, an ignored SIGINT would make ^C do nothing.
_SESSION_DEFAULT_SIGNALS = (signal.SIGALRM, signal.SIGHUP, signal.SIGTERM, signal.SIGQUIT, signal.SIGCHLD,
                            signal.SIGINT, signal.SIGPIPE)


def _session_signals() -> None:
    """In the child, before exec: the signal dispositions an sshd session starts with."""
    for sig in _SESSION_DEFAULT_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


def _session_preexec() -> Callable[[], None] | None:
    """`_session_signals` where a child needs it, else None. exec itself resets every signal this process
    catches, and `subprocess` restores SIGPIPE; only a signal this process ignores (under `nohup`) stays ignored
    across exec. A preexec function forces a fork() of this whole process (~17 ms of CPU from a test process
    with TensorFlow loaded, ~40 ms wall) where subprocess otherwise uses vfork (~1 ms), for every command a
    guest runs."""
    ignored = any(signal.getsignal(sig) == signal.SIG_IGN for sig in _SESSION_DEFAULT_SIGNALS if sig != signal.SIGPIPE)
    return _session_signals if ignored else None


def _adopt_terminal() -> None:
    """In the child, after setsid: sshd's signal defaults, then stdin (the pty) becomes the controlling
    terminal of the new session."""
    _session_signals()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _set_window(fd: int, size: tuple[int, int, int, int]) -> None:
    cols, rows, width, height = size
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, width, height))


async def _run_on_pty(process: asyncssh.SSHServerProcess, argv: list[str], cwd: Path,
                      env: dict[str, str]) -> None:
    master, slave = os.openpty()
    _set_window(master, process.get_terminal_size())
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env, start_new_session=True,
            preexec_fn=_adopt_terminal,
        )
    finally:
        os.close(slave)
    # The read transport owns `master` and closes it on EIO; writes go through a duplicate we close, so
    # a recycled descriptor number can never receive keystrokes.
    writer_fd = os.dup(master)
    os.set_blocking(writer_fd, False)
    reader = asyncio.StreamReader()
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(master, "rb", buffering=0))

    async def write(data: bytes) -> None:
        while data:
            try:
                data = data[os.write(writer_fd, data):]
            except BlockingIOError:
                await asyncio.sleep(0.01)  # the terminal's input queue is full until the program reads

    output = asyncio.ensure_future(_pump_out(reader, process.stdout))
    feeder = asyncio.ensure_future(_pump_in(process, proc.pid, write, lambda: None,
                                            lambda size: _set_window(writer_fd, size)))
    hangup = asyncio.ensure_future(_hang_up_on_close(process, proc))
    returncode = await proc.wait()
    await asyncio.wait([output], timeout=_PTY_DRAIN_S)
    for task in (output, feeder, hangup):
        task.cancel()
    transport.close()
    os.close(writer_fd)
    _exit(process, returncode)


def _exit(process: asyncssh.SSHServerProcess, returncode: int) -> None:
    with contextlib.suppress(OSError, asyncssh.Error):
        if returncode < 0:
            process.exit_with_signal(signal.Signals(-returncode).name.removeprefix("SIG"))
        else:
            process.exit(returncode)


async def _pump_out(source: asyncio.StreamReader, sink: asyncssh.SSHWriter) -> None:
    """Copy process output to the channel; once the channel is gone, keep draining so the process never blocks."""
    connected = True
    while True:
        try:
            chunk = await source.read(_CHUNK)
        except OSError:
            break  # EIO: the last holder of the pty's terminal side closed it
        if not chunk:
            break
        if not connected:
            continue
        try:
            sink.write(chunk)
            await sink.drain()
        except (OSError, asyncssh.Error):
            connected = False


async def _pump_in(process: asyncssh.SSHServerProcess, pgid: int, write: Callable[[bytes], Awaitable[None]],
                   at_eof: Callable[[], None],
                   resize: Callable[[tuple[int, int, int, int]], None] | None = None) -> None:
    """Copy channel input to the process, delivering SSH signal requests to its process group."""
    try:
        while True:
            try:
                data = await process.stdin.read(_CHUNK)
            except asyncssh.SignalReceived as exc:
                sig = getattr(signal, f"SIG{exc.signal}", None)
                if sig is not None:
                    _signal_group(pgid, sig)
                continue
            except asyncssh.TerminalSizeChanged as exc:
                if resize is not None:
                    resize((exc.width, exc.height, exc.pixwidth, exc.pixheight))
                continue
            except asyncssh.BreakReceived:
                continue
            if not data:
                break
            await write(data)
    except (OSError, asyncssh.Error):
        pass  # the process closed its input or the connection dropped: EOF either way
    finally:
        at_eof()


async def _hang_up_on_close(process: asyncssh.SSHServerProcess, proc: asyncio.subprocess.Process) -> None:
    """A session that drops while its command runs hangs the command up, as losing a login does on a VM.

    Detached work (nohup ignores SIGHUP, setsid leaves the group) survives; a foreground job does not.
    """
    await process.channel.wait_closed()
    if proc.returncode is None:
        _signal_group(proc.pid, signal.SIGHUP)


async def _cancel_other_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class _Session(asyncssh.SSHServer):
    """Key-only authentication against the worker's current ``ssh-keys``, and connection bookkeeping."""

    def __init__(self, worker: _Worker) -> None:
        self._worker = worker
        self._conn: asyncssh.SSHServerConnection | None = None

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self._conn = conn
        self._worker.conns.add(conn)

    def connection_lost(self, exc: Exception | None) -> None:
        self._worker.conns.discard(self._conn)

    def begin_auth(self, username: str) -> bool:
        return True

    def public_key_auth_supported(self) -> bool:
        return True

    def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        keys = self._worker.keys
        return key.public_data in keys.get(username, frozenset()) | keys.get(ANY_USER, frozenset())


class WorkerPool:
    """Every worker of every node, keyed by a node key chosen by the caller (e.g. "project/zone/name").

    Worker ``i`` of node ``key`` lives in ``root_dir/key/i/``; its host key and port persist there, so a
    pool restarted on the same root gives the node the same identities and (when free) the same ports.
    """

    def __init__(self, root_dir: Path, python_bin: Callable[[Path, str | None], Path] | None = None) -> None:
        """`python_bin(worker dir, runtime)` is the bin dir put first on a worker's PATH, so `python` there
        is the runtime image's interpreter; without it (and for VMs, runtime None) it is this process's."""
        self._root = Path(root_dir).absolute()
        self._python_bin = python_bin
        self._root.mkdir(parents=True, exist_ok=True)
        # The pool owns root_dir: whatever a previous pool there left running (it crashed, or was killed)
        # dies now, so every worker this pool boots is a fresh VM.
        root = marker(self._root).encode() + b"/"
        _kill_marked(lambda value: value.startswith(root))
        self._nodes: dict[str, list[_Worker]] = {}
        self._metadata = MetadataServer()
        self._lock = threading.Lock()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="localcloud-workers", daemon=True)
        self._thread.start()

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(_CALL_TIMEOUT_S)

    def _worker_dir(self, key: str, index: int) -> Path:
        if not _KEY_RE.fullmatch(key) or ".." in key.split("/"):
            raise ValueError(f"worker pool key {key!r} must be path-safe: letters, digits, '._-' and '/'")
        return self._root / key / str(index)

    def _environment(self, directory: Path, env: dict[str, str], metadata_host: str | None,
                     runtime: str | None) -> dict[str, str]:
        # A VM starts with a clean environment, not the daemon's; PATH leads with the bin dir of the
        # interpreter its image carries (a TPU runtime's venv, or this process's for VMs and host mode).
        path = env.get("PATH", os.environ.get("PATH", os.defpath))
        bin_dir = self._python_bin(directory, runtime) if self._python_bin else Path(sys.executable).parent
        # google-auth reads GCE_METADATA_HOST for requests and GCE_METADATA_IP for its ping; JAX reads
        # GCE_METADATA_IP. Both accept HOST:PORT.
        guest = {"GCE_METADATA_HOST": metadata_host, "GCE_METADATA_IP": metadata_host} if metadata_host else {}
        return {
            "SHELL": "/bin/bash",
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            **env,
            **guest,
            "PATH": os.pathsep.join([str(bin_dir), path]),
            "HOME": str(directory),
            MARKER_VAR: marker(directory),
        }

    def start_node(self, key: str, count: int, env: dict[str, str], authorized_keys: list[str],
                   startup_script: str | None, runtime: str | None = None,
                   metadata: Callable[[int], Tree | None] | None = None) -> list[WorkerEndpoint]:
        """Boot every worker of ``key`` that is not running; blocks until all of them listen.

        ``runtime`` is the node's runtime version (None for a VM): it picks the workers' interpreter.
        ``metadata(i)`` is what worker i's metadata server answers (called at each request; None: nothing).
        Idempotent: running workers are left alone (their keys are updated), so calling it again after
        ``kill_worker`` revives only the dead worker.
        """
        keys = parse_ssh_keys(authorized_keys)
        with self._lock:
            self._check_open()
            dirs = [self._worker_dir(key, index) for index in range(count)]
            workers = self._nodes.setdefault(key, [])
            if workers and len(workers) != count:
                raise ValueError(f"node {key!r} has {len(workers)} workers, not {count}")
            hosts = self._metadata.attach(key, count, metadata) if metadata is not None else [None] * count
            for index in range(len(workers), count):
                workers.append(_Worker(dirs[index], self._environment(dirs[index], env, hosts[index], runtime)))
            to_boot = [w for w in workers if not w.running]

            async def boot() -> list[WorkerEndpoint]:
                for worker in workers:
                    worker.keys = keys
                await asyncio.gather(*(w.boot(startup_script) for w in to_boot))
                return [w.endpoint for w in workers]

            return self._call(boot())

    def update_keys(self, key: str, authorized_keys: list[str]) -> None:
        """Replace the accepted keys of every worker of ``key``; new connections see them at once."""
        keys = parse_ssh_keys(authorized_keys)
        with self._lock:
            workers = self._node(key)

            async def update() -> None:
                for worker in workers:
                    worker.keys = keys

            self._call(update())

    def kill_worker(self, key: str, index: int) -> None:
        """Fault: worker ``index`` dies — its server stops, its sessions drop, all its processes are killed."""
        with self._lock:
            worker = self._node(key)[index]
            self._call(worker.shutdown())
            _kill_workers([worker.dir])

    def drop_connections(self, key: str) -> None:
        """Fault: abort every live SSH connection to ``key``'s workers; the servers keep listening."""
        with self._lock:
            workers = self._node(key)

            async def drop() -> None:
                for worker in workers:
                    worker.drop_connections()

            self._call(drop())

    def shut_down_guests(self, key: str) -> None:
        """The guests of ``key`` begin an OS shutdown (ACPI G2 Soft Off): their SSH servers stop and every
        process the workers started gets SIGTERM, as systemd sends it, and runs on until ``stop_node`` (the
        power off) kills what is left. Nothing happens for a node that is not running."""
        with self._lock:
            workers = self._nodes.get(key, [])

            async def shutdown() -> None:
                await asyncio.gather(*(w.shutdown() for w in workers))

            self._call(shutdown())
            owned = frozenset(marker(w.dir).encode() for w in workers)
            _signal_all(_marked_pids(owned.__contains__), signal.SIGTERM)

    def stop_node(self, key: str) -> None:
        """Stop every worker of ``key`` and kill every process it started, detached ones too. Idempotent."""
        with self._lock:
            self._stop(key)

    def _stop(self, key: str) -> None:
        self._metadata.detach(key)
        workers = self._nodes.pop(key, [])
        if not workers:
            return

        async def shutdown() -> None:
            await asyncio.gather(*(w.shutdown() for w in workers))

        self._call(shutdown())
        _kill_workers(w.dir for w in workers)

    def close(self) -> None:
        """Stop every node and the loop thread. Idempotent; no worker process outlives it."""
        with self._lock:
            if self._closed:
                return
            for key in list(self._nodes):
                self._stop(key)
            self._metadata.close()
            self._closed = True
        # Sessions whose processes were just killed are still finishing; let them end before the loop does.
        self._call(_cancel_other_tasks())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def _node(self, key: str) -> list[_Worker]:
        self._check_open()
        try:
            return self._nodes[key]
        except KeyError:
            raise KeyError(f"no node {key!r} in the worker pool") from None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("worker pool is closed")
