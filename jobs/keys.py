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


def ensure_keypair(directory: Path | None = None) -> KeyPair:
    """The key pair, generated on first use. Idempotent; a private key readable by others is refused."""
    directory = directory or paths.ssh_dir()
    private = directory / KEY_NAME
    public = directory / f"{KEY_NAME}.pub"
    user = ssh_user()
    if not private.exists():
        key = asyncssh.generate_private_key("ssh-ed25519", comment=user)
        fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key.export_private_key())
        public.write_bytes(key.export_public_key())
    mode = private.stat().st_mode & 0o077
    if mode:
        from tpuctl.errors import BadInput

        raise BadInput(f"{private} is readable by other users", field="ssh key", hint=f"chmod 600 {private}")
    if not public.exists():
        public.write_bytes(asyncssh.read_private_key(str(private)).export_public_key())
    public_key = " ".join(public.read_text().split()[:2]) + f" {user}"
    return KeyPair(private_path=private, public_key=public_key, user=user)
