"""Retries and waits: every one has a deadline on the monotonic clock, backoff with jitter, and a callback.

The TPU client retries neither 429 nor 503, and the operation pollers cap at 900 s; these replace both.
Polling backs off in proportion to the time already waited, so a wait overshoots the moment the resource
is ready by at most a few percent whether that moment comes after 2 s (local) or 20 min (a v5p pod).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from google.api_core import exceptions as gexc

from tpuctl.errors import Interrupted, QuotaError, TpuctlError, WaitTimeout, from_google, quota_violation
from tpuctl.provision.resources import State

T = TypeVar("T")

DEFAULT_DEADLINE_S = 3600.0  # an hour for a create: large pod slices can take tens of minutes

# Transient by type: rate limits, unavailability, server errors, aborted transactions (IAM etag races).
TRANSIENT = (gexc.TooManyRequests, gexc.ServiceUnavailable, gexc.InternalServerError, gexc.BadGateway,
             gexc.GatewayTimeout, gexc.DeadlineExceeded, gexc.Aborted)


@dataclass(frozen=True)
class Backoff:
    initial: float = 0.05
    maximum: float = 10.0
    multiplier: float = 2.0
    proportional: float = 0.03  # poll no slower than this fraction of the time already waited
    jitter: float = 0.2  # +-20 %: a fleet of threads must not poll in lockstep

    def delays(self) -> Callable[[float], float]:
        """A stateful generator of the next delay given the seconds elapsed so far."""
        current = [self.initial]

        def next_delay(elapsed: float) -> float:
            d = min(current[0], max(self.initial, elapsed * self.proportional))
            current[0] = min(self.maximum, current[0] * self.multiplier)
            return max(0.001, d * random.uniform(1 - self.jitter, 1 + self.jitter))

        return next_delay


RETRY_BACKOFF = Backoff(initial=0.05, maximum=8.0, multiplier=1.6, proportional=1.0)
# A 429 that names a quota (google.rpc.QuotaFailure) is a limit, not a burst: a few tries, then report it.
QUOTA_ATTEMPTS = 3
# A 429 without that detail may be a short burst of a per-minute limit or the same quota worded only in its
# message (Cloud TPU sends both shapes): retry it this long, never minutes, then report it as a quota.
BARE_429_S = 20.0
POLL_BACKOFF = Backoff()


class Cancelled(Interrupted):
    """A wait noticed that its cancel event was set (Ctrl-C, or a sibling step failed)."""


def _sleep(seconds: float, cancel: threading.Event | None) -> None:
    if cancel is None:
        time.sleep(seconds)
    elif cancel.wait(seconds):
        raise Cancelled("cancelled")


def pause(seconds: float, cancel: threading.Event | None = None) -> None:
    """Sleep `seconds` with jitter; Cancelled if `cancel` is set meanwhile."""
    _sleep(seconds * random.uniform(0.8, 1.2), cancel)


def call(fn: Callable[[], T], *, what: str, deadline_s: float = 120.0, backoff: Backoff = RETRY_BACKOFF,
         cancel: threading.Event | None = None, on_retry: Callable[[str], None] | None = None) -> T:
    """Run one API call, retrying transient failures (429, 5xx) with backoff and jitter until `deadline_s`.

    Other Google errors are mapped with `tpuctl.errors.from_google` and raised at once; the last transient
    error is mapped the same way when the deadline passes (a 429 storm becomes QuotaError, 503 CloudError),
    or after QUOTA_ATTEMPTS when the 429 names the quota it hit.
    """
    start = time.monotonic()
    next_delay = backoff.delays()
    attempt = quota_hits = 0
    while True:
        attempt += 1
        try:
            return fn()
        except TRANSIENT as exc:
            elapsed = time.monotonic() - start
            delay = next_delay(elapsed)
            quota = quota_violation(exc)
            quota_hits += quota is not None
            if quota is not None and quota_hits >= QUOTA_ATTEMPTS:
                raise QuotaError(f"{what}: quota {quota} exceeded ({getattr(exc, 'message', exc)})") from exc
            bare_429 = isinstance(exc, gexc.TooManyRequests) and elapsed + delay > BARE_429_S
            if elapsed + delay > deadline_s or bare_429:
                raise from_google(exc, what=what) from exc
            if on_retry is not None:
                on_retry(f"{type(exc).__name__}, retry {attempt}")
            _sleep(delay, cancel)
        except gexc.GoogleAPICallError as exc:
            raise from_google(exc, what=what) from exc


def get_or_none(fn: Callable[[], T], *, what: str, cancel: threading.Event | None = None) -> T | None:
    """One read, retried like `call`; None when the thing does not exist (NotFound)."""
    try:
        return call(fn, what=what, cancel=cancel)
    except TpuctlError as exc:
        if isinstance(exc.__cause__, gexc.NotFound):
            return None
        raise


def until(poll: Callable[[], tuple[bool, T]], *, what: str, deadline_s: float,
          backoff: Backoff = POLL_BACKOFF, cancel: threading.Event | None = None,
          on_poll: Callable[[T, float], None] | None = None) -> T:
    """Call `poll` until it returns (True, value); returns the value.

    `poll` returns (done, value) and may raise a TpuctlError to stop. Each poll's value and the elapsed
    seconds go to `on_poll` (progress). Raises WaitTimeout after `deadline_s`, Cancelled when `cancel` is set.
    """
    start = time.monotonic()
    next_delay = backoff.delays()
    while True:
        if cancel is not None and cancel.is_set():
            raise Cancelled(f"{what}: cancelled")
        done, value = poll()
        elapsed = time.monotonic() - start
        if on_poll is not None:
            on_poll(value, elapsed)
        if done:
            return value
        if elapsed >= deadline_s:
            raise WaitTimeout(f"{what}: not done after {deadline_s:.0f} s")
        _sleep(min(next_delay(elapsed), max(0.0, deadline_s - elapsed) + 0.001), cancel)


def delete(request: Callable[[], Any], wait: Callable[[Any], None], *, what: str,
           cancel: threading.Event | None = None, progress: Callable[[State, str], None] | None = None) -> None:
    """Issue a delete (`request`, retried like `call`), report it, and block in `wait(operation)` until done.

    Idempotent: NotFound, when asked or while waiting, means the resource is gone, which is what was wanted."""
    try:
        op = call(request, what=what, cancel=cancel)
        if progress is not None:
            progress(State.DELETING, "requested")
        wait(op)
    except TpuctlError as exc:
        if not isinstance(exc.__cause__, gexc.NotFound):
            raise
