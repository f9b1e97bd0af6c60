"""OAuth access tokens that localcloud issues to the service accounts of its TPU nodes and VMs.

On Google a TPU VM's programs get their service account's token from the metadata server
(`instance/service-accounts/default/token`) and send it as `Authorization: Bearer TOKEN`; Cloud Storage then
checks the bucket's IAM policy for that account. `Tokens` is the one place that mints such tokens and maps them
back to the account, so the metadata server (whoever serves it) and the storage layer agree on the format.
Tokens are opaque random strings with Google's `ya29.` prefix and an expiry; they die with the process (a worker
asks the metadata server again, as google-auth does when a token expires or is refused). A guest's metadata server
hands out the same token until it has `REFRESH_S` left, as Google's does ("The metadata server caches access tokens
until 5 minutes before they expire": compute/docs/access/authenticate-workloads).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

# Only tokens of this shape are checked; any other bearer token (a user's real credentials) acts as the owner.
PREFIX = "ya29.lcsa."
LIFETIME_S = 3600  # a new token's lifetime: the metadata server's first expires_in for it
REFRESH_S = 300  # a guest's cached token is replaced once it has this little left


@dataclass(frozen=True)
class Identity:
    email: str
    project: str
    expires: float


class Tokens:
    """Thread-safe registry of issued tokens. `issue` and `identity` never block on I/O."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock  # wall-clock seconds, as tokens expire on Google's side
        self._lock = threading.Lock()
        self._issued: dict[str, Identity] = {}
        self._cached: dict[str, str] = {}  # a guest's account (its cache key) -> the token its server hands out

    def issue(self, email: str, project: str, *, lifetime_s: float = LIFETIME_S) -> str:
        """A new token for service account `email` of `project`, valid for `lifetime_s` seconds."""
        token = PREFIX + secrets.token_urlsafe(24)
        with self._lock:
            now = self._clock()
            self._issued = {t: i for t, i in self._issued.items() if i.expires > now}
            self._issued[token] = Identity(email, project, now + lifetime_s)
        return token

    def cached(self, key: str, email: str, project: str) -> tuple[str, int]:
        """The token a guest's metadata server answers for account `email` (`key` names the guest and account),
        and its expires_in: the one it handed out before while that has more than `REFRESH_S` left, else a new one.
        The server rebuilds a guest's tree every 50 ms while it holds a `wait_for_change` request: this issues once."""
        with self._lock:
            token = self._cached.get(key)
            found = self._issued.get(token) if token else None
        if found is None or found.expires - self._clock() <= REFRESH_S:
            token = self.issue(email, project)
            with self._lock:
                self._cached[key] = token
                found = self._issued[token]
        return token, int(found.expires - self._clock())  # whole seconds left, as Google's expires_in counts them

    def identity(self, token: str) -> Identity | None:
        """Whose token this is; None for a token localcloud did not issue or that has expired."""
        with self._lock:
            found = self._issued.get(token)
        return found if found is not None and found.expires > self._clock() else None


def is_ours(token: str) -> bool:
    """Whether a bearer token has localcloud's shape (issued here, possibly expired)."""
    return token.startswith(PREFIX)


def bearer(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header value, else None."""
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None
