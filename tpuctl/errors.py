"""The one error hierarchy of tpuctl.

Every failure a user can see is a `TpuctlError`: a one-line message, a hint that says what to do, an
exit code, and (for bad input) the field at fault. The CLI prints `error: <field>: <message>` and the hint
on the next line, then exits with `exit_code`. Google API exceptions are mapped by *type* in
`from_google`, never by parsing their message text.

Exit codes (documented in the README): 0 ok, 1 failure, 2 bad input, 3 capacity/quota, 4 the TPU's time ran out,
130 interrupted.
"""

from __future__ import annotations

from typing import Any

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_CAPACITY = 3
EXIT_TIME_ENDED = 4
EXIT_INTERRUPTED = 130


class TpuctlError(Exception):
    """Base of every error tpuctl reports to a user."""

    exit_code = EXIT_FAILURE
    default_hint = ""

    def __init__(self, message: str, *, hint: str | None = None, field: str | None = None):
        super().__init__(message)
        self.message = " ".join(str(message).split())  # one line, always
        self.hint = hint if hint is not None else self.default_hint
        self.field = field

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


class BadInput(TpuctlError):
    """The user's spec, flags or files are wrong; nothing was created."""

    exit_code = EXIT_BAD_INPUT


class NameTaken(BadInput):
    """A resource of the run's name exists and is not the run's (its `tpuctl-run` label says so): nothing was
    created, and nothing of the other one's may be touched, not even by a rollback."""


class NotFound(TpuctlError):
    """A named run, resource or file does not exist."""

    exit_code = EXIT_BAD_INPUT


def capacity_hint(provisioning: str | None = None) -> str:
    """What else to try when no zone had capacity, leaving out what the request already was."""
    tries = ["add zones with --zone (comma-separated, same region first)"]
    if provisioning not in ("spot", "preemptible"):
        tries.append("try --spot")
    if provisioning != "queued":
        tries.append("use a queued resource (--provisioning queued)")
    if len(tries) == 1:
        return tries[0]
    return ", ".join(tries[:-1]) + ("," if len(tries) > 2 else "") + " or " + tries[-1]


class CapacityError(TpuctlError):
    """No zone in the failover list had capacity for the accelerator."""

    exit_code = EXIT_CAPACITY
    default_hint = capacity_hint()


QUOTAS_PAGE = "https://console.cloud.google.com/iam-admin/quotas"


class QuotaError(TpuctlError):
    """A quota or rate limit refused the request (a quota is a limit: retrying does not lift it)."""

    exit_code = EXIT_CAPACITY
    default_hint = (f"raise the quota named above on the Quotas page, {QUOTAS_PAGE} (filter by its name), "
                    "or ask for fewer or smaller TPUs")


class PermissionDenied(TpuctlError):
    exit_code = EXIT_FAILURE
    default_hint = "check that your credentials have the TPU Admin, Compute Admin and Storage Admin roles on the project"


class CloudError(TpuctlError):
    """The cloud API failed in a way retries did not fix."""


class Unexpected(TpuctlError):
    """Something tpuctl did not expect was raised (a response without a field it needs, a client's own
    error): a bug of tpuctl's, or an answer of the API it does not understand. Reported like any error."""

    default_hint = "this is a tpuctl bug or an API answer it does not understand: please report it with the command"

    @classmethod
    def of(cls, exc: BaseException) -> TpuctlError:
        """`exc` itself when it is a TpuctlError already, else one line naming its type, its text (cut at 300
        characters) and where it was raised (the innermost frame), so a report points at the code."""
        if isinstance(exc, TpuctlError):
            return exc
        where = ""
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is not None:
            code = tb.tb_frame.f_code
            where = f" (in {code.co_name}, {code.co_filename.rsplit('/', 1)[-1]}:{tb.tb_lineno})"
        text = " ".join(str(exc).split())
        text = text if len(text) <= 300 else text[:297] + "..."
        return cls(f"unexpected {type(exc).__name__}: {text}{where}")


class WaitTimeout(TpuctlError):
    """An operation did not finish before its deadline."""

    default_hint = "the resource may still be changing: check with `tpuctl status`, then `tpuctl down RUN`"


class JobFailed(TpuctlError):
    """The training job exited non-zero on at least one worker."""


class RunDurationEnded(TpuctlError):
    """Google ended a flex-start TPU at the max run duration the user chose, before the job finished.

    Its own exit code, not 1: nothing failed, and a wrapper can tell "ask for another flex-start window and
    resume" from "debug the job"."""

    exit_code = EXIT_TIME_ENDED


class Interrupted(TpuctlError):
    """The user pressed Ctrl-C or the process got SIGTERM."""

    exit_code = EXIT_INTERRUPTED


class LocalCloudError(TpuctlError):
    """The embedded local cloud could not be started, reached or stopped."""

    default_hint = "see `tpuctl local status`; `tpuctl local stop` then `tpuctl local start` resets it"


def from_google(exc: BaseException, *, what: str) -> TpuctlError:
    """Map a google.api_core exception to our hierarchy by its type.

    `what` names the action ("create TPU node tpuctl-abc in europe-west4-a") so the message is useful
    without the API's own wording.
    """
    from google.api_core import exceptions as gexc

    detail = getattr(exc, "message", None) or str(exc)
    if isinstance(exc, gexc.ResourceExhausted):
        if _is_quota(exc):
            return QuotaError(f"{what}: quota {_quota_name(exc)} exceeded ({detail})")
        return CapacityError(f"{what}: no capacity ({detail})")
    if isinstance(exc, gexc.TooManyRequests):
        # HTTP 429 is a quota (Cloud TPU's "Quota limit '...' has been exceeded"), named by its
        # QuotaFailure detail when Google sends one, else only in the message, which is shown as it is.
        name = _quota_name(exc)
        return QuotaError(f"{what}: quota {name + ' ' if name else ''}exceeded ({detail})")
    if isinstance(exc, gexc.Forbidden) and _compute_reasons(exc) & COMPUTE_QUOTA_REASONS:
        # Compute answers an exceeded quota with 403 and errors[].reason "quotaExceeded": not a missing role.
        return QuotaError(f"{what}: quota exceeded ({detail})")
    if isinstance(exc, (gexc.Forbidden, gexc.Unauthorized)):
        return PermissionDenied(f"{what}: permission denied ({detail})")
    if isinstance(exc, gexc.NotFound):
        return NotFound(f"{what}: not found ({detail})")
    if isinstance(exc, (gexc.BadRequest, gexc.InvalidArgument, gexc.FailedPrecondition)):
        return BadInput(f"{what}: rejected by the API ({detail})", hint="check the spec values against `tpuctl catalog list`")
    if isinstance(exc, (gexc.ServiceUnavailable, gexc.InternalServerError, gexc.DeadlineExceeded)):
        return CloudError(f"{what}: the API kept failing ({detail})", hint="retry in a few minutes")
    return CloudError(f"{what}: {detail}")


# Compute's `errors[].reason` values for a quota refusal (HTTP 403), as its error model documents them.
COMPUTE_QUOTA_REASONS = frozenset({"quotaExceeded", "rateLimitExceeded", "userRateLimitExceeded"})


def _compute_reasons(exc: BaseException) -> set[str]:
    """The structured `reason`s of a Compute error (`exc.errors` is the body's `error.errors` list)."""
    return {str(e.get("reason")) for e in getattr(exc, "errors", None) or () if isinstance(e, dict) and e.get("reason")}


def _field(obj: Any, proto_name: str, json_name: str) -> Any:
    """A field of an error detail, parsed (a proto: REST and gRPC alike) or not (a JSON dict)."""
    return obj.get(json_name, obj.get(proto_name)) if isinstance(obj, dict) else getattr(obj, proto_name, None)


def quota_violation(exc: BaseException) -> str | None:
    """The quota a google.rpc.QuotaFailure detail names: a violation's `quota_id` ("Also know as 'limit
    name', this is the unique identifier of a quota", error_details.proto), else its `subject` unless that
    names the caller instead ("clientip:<ip address of client>", "project:<Google developer project id>")."""
    for d in getattr(exc, "details", None) or ():
        is_failure = (isinstance(d, dict) and str(d.get("@type", "")).endswith("google.rpc.QuotaFailure")) or (
            type(d).__name__ == "QuotaFailure")
        for v in (_field(d, "violations", "violations") or ()) if is_failure else ():
            subject = str(_field(v, "subject", "subject") or "")
            name = _field(v, "quota_id", "quotaId") or (subject if subject and ":" not in subject else None)
            if name:
                return str(name)
    return None


def _quota_name(exc: BaseException) -> str | None:
    """The quota's name from structured error details (google.rpc.QuotaFailure, else ErrorInfo), if present."""
    name = quota_violation(exc)
    if name:
        return name
    for d in getattr(exc, "details", None) or []:
        meta = _field(d, "metadata", "metadata")
        if meta is not None and (meta.get("quota_limit") or meta.get("quota_metric")):
            return str(meta.get("quota_limit") or meta.get("quota_metric"))
    return None


def _is_quota(exc: BaseException) -> bool:
    # HTTP 429 maps to ResourceExhausted's subclass TooManyRequests for REST; gRPC RESOURCE_EXHAUSTED with a
    # QuotaFailure detail is a quota, without one it is capacity (TPU stockouts come as code 8).
    return _quota_name(exc) is not None
