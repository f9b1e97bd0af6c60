"""`gs://BUCKET/runs/RUN/status.json`: a run's account of its job, one typed record for everyone who reads or
writes it: the worker agents (`storage.merge_status`), `tpuctl run` (jobs/cluster.py), `tpuctl gc`
(provision/gc.py), `tpuctl job status` and `tpuctl board`.

Standard library only: it ships in the agent's bundle (`tpuctl_agent.status`, on workers without tpuctl) and is
imported by tpuctl as `tpuctl.jobs.agent.status`.

The record has two writers, each merging its own fields (storage.merge_status, a generation-checked
read-modify-write): worker 0's agent (the job's account: state, step, exit_code, workers, heartbeat) and the
laptop's `tpuctl run` (recovering; and, when it decides how the run ended, `final` with its verdict). The agent
leaves a final record alone.

Versions: every write stamps VERSION. A record without `version` was written before the field existed (read
as version 0; its fields mean what they mean now). Fields this code does not know (a newer writer's) are kept in
`extra` and written back unchanged, so an older writer never drops them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

NAME = "status.json"
VERSION = 1
STATES = ("running", "succeeded", "failed", "cancelled")  # what tpuctl writes; another state is kept as read


def object_name(run: str) -> str:
    """The record's object in the run's bucket."""
    return f"runs/{run}/{NAME}"


class CorruptStatus(ValueError):
    """The object is not a status record (not JSON, not an object, no state, a field of the wrong type). Laptop
    readers turn it into a TpuctlError with what to do (jobs/cluster.py `read_status`)."""


def _optional(kind: type | tuple[type, ...], what: str):
    def check(name: str, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, kind):  # JSON true is no number
            raise CorruptStatus(f"field {name!r} is {value!r}, not {what}")
        return value
    return check


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise CorruptStatus(f"field {name!r} is {value!r}, not true or false")
    return value


_NUMBER = _optional((int, float), "a number")
# Each known field's check, in the record's order; `state` and `version` are checked on their own.
_FIELDS = {
    "heartbeat": lambda n, v: None if (v := _NUMBER(n, v)) is None else float(v),
    "recovering": _flag,
    "step": _optional(int, "an integer"),
    "exit_code": _optional(int, "an integer"),
    "workers": _optional(int, "an integer"),
    "final": _flag,
    "ended": _optional(str, "a string"),
    "interrupted": _flag,
}


@dataclass(frozen=True)
class RunStatus:
    state: str  # one of STATES (a newer writer's state is kept as read)
    heartbeat: float | None = None  # unix seconds of the last sign of life
    recovering: bool = False  # `tpuctl run` is bringing the run back: gc leaves it alone
    step: int | None = None  # the furthest step any worker reported
    exit_code: int | None = None
    workers: int | None = None
    final: bool = False  # the laptop's verdict: agents still stopping leave it as it is
    ended: str | None = None  # why it ended, when not by itself: "max_run_duration"
    interrupted: bool = False  # `tpuctl run` was stopped (Ctrl-C)
    version: int = VERSION
    extra: dict[str, Any] = field(default_factory=dict, hash=False)  # fields this version does not know

    @classmethod
    def from_doc(cls, doc: Any) -> RunStatus:
        """The record of a decoded JSON document. CorruptStatus when it is not one."""
        if not isinstance(doc, dict):
            raise CorruptStatus(f"a JSON {type(doc).__name__}, not an object")
        state = doc.get("state")
        if not isinstance(state, str) or not state:
            raise CorruptStatus(f"no state (field 'state' is {state!r})")
        version = doc.get("version", 0)
        if isinstance(version, bool) or not isinstance(version, int):
            raise CorruptStatus(f"field 'version' is {version!r}, not an integer")
        known = {name: check(name, doc[name]) for name, check in _FIELDS.items() if name in doc}
        extra = {k: v for k, v in doc.items() if k not in _FIELDS and k not in ("state", "version")}
        return cls(state=state, version=version, extra=extra, **known)

    @classmethod
    def from_json(cls, raw: bytes | str) -> RunStatus:
        """The record of status.json's bytes. CorruptStatus (with a hint) when they are not one."""
        try:
            doc = json.loads(raw)
        except ValueError as exc:  # UnicodeDecodeError too
            raise CorruptStatus(f"not JSON ({exc})") from None
        return cls.from_doc(doc)

    def to_doc(self) -> dict[str, Any]:
        """The JSON object: every known field, defaults included (a reader of the raw object, a script or an
        older tpuctl, finds each key), over the unknown fields (a known one always wins)."""
        known = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return {**self.extra, **known}

    def to_json(self) -> str:
        return json.dumps(self.to_doc(), sort_keys=True)

    def merged(self, fields: dict[str, Any]) -> RunStatus:
        """This record with `fields` (known field names; a TypeError names any other) written over it, stamped
        with this version."""
        return dataclasses.replace(self, **fields, version=VERSION)
