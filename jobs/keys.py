"""The per-user SSH key pair tpuctl uses to reach TPU workers, created once under `tpuctl.paths.ssh_dir()`.

Like `gcloud compute tpus tpu-vm ssh`, the public half goes into the node's `ssh-keys` metadata as
`USER:KEY USER`; the private half never leaves the laptop and is written 0600 before any byte of it is.
"""

from __future__ import annotations

import getpass
import os
import re
from dataclasses import dataclass
from pathlib import Path

import asyncssh

from tpuctl import paths

KEY_NAME = "tpuctl_ed25519"


@dataclass(frozen=True)
class KeyPair:
    private_path: Path
    public_key: str  # "ssh-ed25519 AAAA... comment"
    user: str

    def metadata_line(self) -> str:
        """The `ssh-keys` metadata entry that lets `user` log in with this key (the format GCE guests read)."""
        return f"{self.user}:{self.public_key}"

    def load_private(self) -> asyncssh.SSHKey:
        return asyncssh.read_private_key(str(self.private_path))


def ssh_user() -> str:
    """The login name on workers: the local user name reduced to what Linux guests accept."""
    name = re.sub(r"[^a-z0-9_-]", "", getpass.getuser().lower()).lstrip("-") or "tpuctl"
    return name[:32]


def _write_atomically(path: Path, data: bytes, *, mode: int) -> None:
    """Write `path` whole or not at all; when another process got there first, its file wins."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.link(tmp, path)  # atomic, and fails if the name exists: the first writer wins
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)


def _create_private_key(private: Path, *, comment: str) -> None:
    # Written 0600 before any byte of it is; concurrent first runs all end up with the winner's key.
    key = asyncssh.generate_private_key("ssh-ed25519", comment=comment)
    _write_atomically(private, key.export_private_key(), mode=0o600)


def ensure_keypair(directory: Path | None = None) -> KeyPair:
    """The key pair, generated on first use. Idempotent; a private key readable by others is refused."""
    directory = directory or paths.ssh_dir()
    private = directory / KEY_NAME
    public = directory / f"{KEY_NAME}.pub"
    user = ssh_user()
    if not private.exists():
        _create_private_key(private, comment=user)
    mode = private.stat().st_mode & 0o077
    if mode:
        from tpuctl.errors import BadInput

        raise BadInput(f"{private} is readable by other users", field="ssh key", hint=f"chmod 600 {private}")
    # Derived from the private half every time: a public file another process is still writing is never read.
    algorithm_and_key = " ".join(asyncssh.read_private_key(str(private)).export_public_key().decode().split()[:2])
    if not public.exists():
        _write_atomically(public, f"{algorithm_and_key} {user}\n".encode(), mode=0o644)
    return KeyPair(private_path=private, public_key=f"{algorithm_and_key} {user}", user=user)
