"""SSH to every worker of a TPU slice at once, the way `gcloud compute tpus tpu-vm ssh --worker=all` does.

Host keys: a worker whose key the node publishes (guest attributes, carried in `Target.host_key`) must
present exactly that key. A worker with no published key is trusted on first use: its key is recorded in
tpuctl's own known_hosts file (one Warn event says so) and verified on every later connection to the same
machine. The record is keyed by the machine's identity, as gcloud's HostKeyAlias is (`tpu.<node id>-<worker>`,
`compute.<instance id>`), not by its address: a recreated node may reuse an address with a new key.

Connecting retries with backoff until a deadline, because a freshly added `ssh-keys` entry takes a while
to reach the guest (PermissionDenied) and a booting worker refuses connections.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import asyncssh

from tpuctl import paths
from tpuctl.events import EventSink, Warn, ignore
from tpuctl.errors import CloudError, TpuctlError, WaitTimeout

from .keys import KeyPair

CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Target:
    """One worker: its index in the slice, address, the host key the node published (or None), and the
    machine identity a first-use key is recorded under (None: the address, for a machine with no id)."""

    index: int
    host: str
    port: int = 22
    host_key: str | None = None  # "ssh-ed25519 AAAA..." (type + base64) from guest attributes
    host_key_alias: str | None = None

    @property
    def address(self) -> str:
        return self.host if self.port == 22 else f"[{self.host}]:{self.port}"

    @property
    def known_hosts_name(self) -> str:
        return self.host_key_alias or self.address


@dataclass(frozen=True)
class Result:
    index: int
    exit_status: int
    stdout: str
    stderr: str


class HostKeyMismatch(TpuctlError):
    """A worker presented a host key other than the one published or recorded for it."""

    default_hint = "the worker may have been recreated: `tpuctl ssh` re-reads published keys; delete the stale line from ~/.tpuctl/ssh/known_hosts"


def _known_hosts_file() -> Path:
    return paths.ssh_dir() / "known_hosts"


def _recorded_keys(target: Target) -> list[asyncssh.SSHKey]:
    f = _known_hosts_file()
    if not f.exists():
        return []
    keys = []
    for line in f.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] == target.known_hosts_name:
            keys.append(asyncssh.import_public_key(" ".join(parts[1:3])))
    return keys


def _record_key(target: Target, key: asyncssh.SSHKey) -> None:
    line = f"{target.known_hosts_name} {key.export_public_key().decode().strip()}\n"
    with open(_known_hosts_file(), "a") as f:
        f.write(line)


def _forget(target: Target) -> None:
    """A key published later (guest attributes were unreadable at first) supersedes the one recorded for
    the machine on first use."""
    f = _known_hosts_file()
    if f.exists():
        keep = [l for l in f.read_text().splitlines(keepends=True) if l.split()[:1] != [target.known_hosts_name]]
        f.write_text("".join(keep))


async def connect(
    target: Target,
    key: KeyPair,
    *,
    deadline_s: float = 180.0,
    on_retry: Callable[[Target, str], None] | None = None,
    on_event: EventSink = ignore,
) -> asyncssh.SSHClientConnection:
    """An authenticated connection to one worker. Blocks (retrying with backoff) until `deadline_s`.

    Raises WaitTimeout when the worker never accepted the key, HostKeyMismatch when it presents a wrong key.
    """
    private = key.load_private()
    end = time.monotonic() + deadline_s
    delay = 0.2
    last = ""
    while True:
        tofu = False
        if target.host_key:
            trusted = [asyncssh.import_public_key(target.host_key)]
        else:
            trusted = _recorded_keys(target)
            tofu = not trusted
        try:
            conn = await asyncio.wait_for(
                asyncssh.connect(
                    target.host,
                    target.port,
                    username=key.user,
                    client_keys=[private],
                    known_hosts=None if tofu else (trusted, [], []),
                    agent_path=None,
                    config=None,
                ),
                timeout=min(CONNECT_TIMEOUT_S, max(0.5, end - time.monotonic())),
            )
        except asyncssh.HostKeyNotVerifiable as exc:
            raise HostKeyMismatch(f"worker {target.index} ({target.address}) presented an unexpected host key: {exc}") from exc
        except (OSError, asyncio.TimeoutError, asyncssh.Error) as exc:
            last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() + delay > end:
                raise WaitTimeout(
                    f"worker {target.index} ({target.address}) did not accept SSH within {deadline_s:.0f}s ({last})",
                    hint="the ssh-keys metadata may not have propagated yet; retry `tpuctl ssh` in a minute",
                ) from exc
            if on_retry:
                on_retry(target, last)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
            continue
        if target.host_key:
            _forget(target)
        elif tofu:
            server_key = conn.get_server_host_key()
            if server_key is not None:
                _record_key(target, server_key)
                on_event(Warn(
                    f"worker {target.index} ({target.address}) publishes no host key; trusting it on first use "
                    f"and recording it in {_known_hosts_file()}"
                ))
        return conn


class Fleet:
    """Connections to the workers of one slice, opened lazily and reopened when they drop.

    One per event loop; `close()` when done. Methods raise WaitTimeout/HostKeyMismatch from `connect`.
    """

    def __init__(self, targets: Sequence[Target], key: KeyPair, *, deadline_s: float = 180.0,
                 on_retry: Callable[[Target, str], None] | None = None, on_event: EventSink = ignore):
        self.targets = list(targets)
        self.key = key
        self.deadline_s = deadline_s
        self.on_retry = on_retry
        self.on_event = on_event
        self._conns: dict[int, asyncssh.SSHClientConnection] = {}
        self._locks: dict[int, asyncio.Lock] = {}

    def target(self, index: int) -> Target:
        for t in self.targets:
            if t.index == index:
                return t
        raise IndexError(index)

    async def connection(self, index: int, *, fresh: bool = False) -> asyncssh.SSHClientConnection:
        lock = self._locks.setdefault(index, asyncio.Lock())
        async with lock:
            conn = self._conns.get(index)
            if conn is not None and (fresh or conn.is_closed()):
                conn.close()
                conn = None
            if conn is None:
                conn = await connect(self.target(index), self.key, deadline_s=self.deadline_s, on_retry=self.on_retry,
                                     on_event=self.on_event)
                self._conns[index] = conn
            return conn

    async def run(self, index: int, command: str, *, timeout_s: float | None = None) -> Result:
        """Run a shell command line on one worker; a dropped connection is reopened and the command retried
        once, so commands sent here must be idempotent."""
        for attempt in (0, 1):
            conn = await self.connection(index, fresh=attempt > 0)
            try:
                done = await conn.run(command, check=False, timeout=timeout_s)
            except (asyncssh.ConnectionLost, asyncssh.DisconnectError, asyncssh.ChannelOpenError, OSError):
                if attempt:
                    raise
                continue
            status = done.exit_status if done.exit_status is not None else 255
            return Result(index, int(status), str(done.stdout or ""), str(done.stderr or ""))
        raise AssertionError("unreachable")

    async def run_all(self, command_for: Callable[[Target], str], *, indices: Sequence[int] | None = None,
                      timeout_s: float | None = None) -> list[Result]:
        """One command per worker, all concurrently; results in worker order. If a worker cannot be reached
        the first such error is raised after every worker finished."""
        chosen = [t for t in self.targets if indices is None or t.index in indices]
        outcomes = await asyncio.gather(*(self.run(t.index, command_for(t), timeout_s=timeout_s) for t in chosen),
                                        return_exceptions=True)
        for o in outcomes:
            if isinstance(o, BaseException) and not isinstance(o, Exception):
                raise o
        for o in outcomes:
            if isinstance(o, TpuctlError):
                raise o
            if isinstance(o, Exception):
                raise CloudError(f"ssh failed: {type(o).__name__}: {o}") from o
        return list(outcomes)  # type: ignore[arg-type]

    async def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        for conn in self._conns.values():
            await conn.wait_closed()
        self._conns.clear()

    async def __aenter__(self) -> Fleet:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
