"""Streaming the job's log from every worker, worker-prefixed, resuming at the byte offset after a drop.

Each worker's stream counts the bytes of the lines it delivered, whole; when the SSH connection drops it
reconnects (with the connect deadline and backoff of `ssh.connect`) and asks for the log from that byte on, as a
later `follow` with the same cursor does after a cancel, so no line is lost, cut or printed twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import asyncssh

from . import remote
from .ssh import Fleet

Sink = Callable[[int, str], None]


@dataclass
class Cursor:
    """Per-worker byte offsets; shared with the caller so a later `follow` continues where one stopped."""

    offsets: dict[int, int] = field(default_factory=dict)
    reconnects: int = 0


async def _stream(fleet: Fleet, index: int, run: str, sink: Sink, cursor: Cursor, follow: bool) -> None:
    while True:
        # The cursor counts the lines delivered, whole: a line cut off by a drop, or by a cancel, is read again.
        pending = b""
        offset = cursor.offsets.get(index, 0)
        try:
            conn = await fleet.connection(index)
            async with conn.create_process(remote.tail_command(run, index, offset, follow), encoding=None) as proc:
                while True:
                    chunk = await proc.stdout.read(65536)
                    if not chunk:
                        break
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        cursor.offsets[index] = cursor.offsets.get(index, 0) + len(line) + 1
                        sink(index, line.decode("utf-8", "replace"))
                await proc.wait()
        except (asyncssh.ConnectionLost, asyncssh.DisconnectError, asyncssh.ChannelOpenError, OSError):
            cursor.reconnects += 1
            await fleet.connection(index, fresh=True)
            continue
        if pending:
            cursor.offsets[index] = cursor.offsets.get(index, 0) + len(pending)
            sink(index, pending.decode("utf-8", "replace"))
        return


async def follow(fleet: Fleet, run: str, sink: Sink, *, follow: bool = True, workers: list[int] | None = None,
                 cursor: Cursor | None = None) -> Cursor:
    """Print (through `sink(worker, line)`) each selected worker's log; with `follow`, until every job process
    exited. Blocks; cancel the task to stop early (the cursor keeps the offsets)."""
    cursor = cursor or Cursor()
    indices = workers if workers is not None else [t.index for t in fleet.targets]
    await asyncio.gather(*(_stream(fleet, i, run, sink, cursor, follow) for i in indices))
    return cursor
