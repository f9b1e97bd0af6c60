"""Labels (the source of truth for what belongs to a run) and GCP naming rules.

Every resource tpuctl creates carries `tpuctl-run`, `tpuctl-owner`, `tpuctl-created` and `tpuctl-expires`
(unix seconds). Label values follow GCP rules: lowercase letters, digits, `-` and `_`, at most 63 chars.
"""

from __future__ import annotations

import getpass
import hashlib
import os
import re
import time
from collections.abc import Mapping

from tpuctl.errors import BadInput, NameTaken

RUN = "tpuctl-run"
OWNER = "tpuctl-owner"
CREATED = "tpuctl-created"
EXPIRES = "tpuctl-expires"
OURS = (RUN, OWNER, CREATED, EXPIRES)
# What a resource does for its run, where that is not its kind: `supervisor`, the VM of a detached run
# (tpuctl.jobs.supervisor_vm) that teardown must stop before anything else.
ROLE = "tpuctl-role"
SUPERVISOR = "supervisor"

_LABEL_KEY = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
_LABEL_VALUE = re.compile(r"^[a-z0-9_-]{0,63}$")
# TPU node ids, Compute instance names, queued resource ids: RFC 1035 labels.
_RESOURCE_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
# Cloud Storage bucket names (cloud.google.com/storage/docs/buckets#naming).
_BUCKET_CHARS = re.compile(r"^[a-z0-9][a-z0-9._-]*[a-z0-9]$")
_DOTTED_DECIMAL = re.compile(r"^\d{1,3}(\.\d{1,3}){3}$")
_GOOGLE_LIKE = re.compile(r"g[o0]{2}g[l1]e")  # "google" and close misspellings such as "g00gle"


def label_value(text: str) -> str:
    """Any text as a valid label value: lowercased, other characters -> `-`, cut to 63."""
    return re.sub(r"[^a-z0-9_-]", "-", str(text).lower())[:63]


def owner() -> str:
    """Who the run belongs to, as a label value: $TPUCTL_OWNER (a team, a CI bot, the account a scheduled gc
    acts for), else the login name. gc acts on its owner's runs only, so shared machines should set it."""
    explicit = os.environ.get("TPUCTL_OWNER", "").strip()
    if explicit:
        return label_value(explicit)
    try:
        return label_value(getpass.getuser()) or "unknown"
    except (KeyError, OSError):
        return "unknown"


def run_labels(run: str, *, owner_name: str, ttl_s: float | None, extra: Mapping[str, str] | None = None,
               now: float | None = None) -> dict[str, str]:
    now = time.time() if now is None else now
    labels = dict(extra or {})
    labels.update({RUN: run, OWNER: owner_name, CREATED: str(int(now))})
    if ttl_s is not None:
        labels[EXPIRES] = str(int(now + ttl_s))
    return labels


def check_labels(labels: Mapping[str, str], *, field: str = "labels") -> None:
    for k, v in labels.items():
        if not _LABEL_KEY.fullmatch(k):
            raise BadInput(f"label key {k!r} is invalid", field=field,
                           hint="keys: lowercase letter first, then lowercase letters, digits, - or _, at most 63")
        if not _LABEL_VALUE.fullmatch(str(v)):
            raise BadInput(f"label {k}={v!r} has an invalid value", field=field,
                           hint="values: lowercase letters, digits, - or _, at most 63 characters")
    if len(labels) > 64:
        raise BadInput(f"{len(labels)} labels; GCP allows 64", field=field)


def check_name(name: str, *, field: str, max_len: int = 63) -> None:
    """RFC 1035: what TPU node ids and Compute instance names must be."""
    if len(name) > max_len or not _RESOURCE_NAME.fullmatch(name):
        raise BadInput(f"{name!r} is not a valid resource name", field=field,
                       hint=f"use lowercase letters, digits and -, starting with a letter, at most {max_len} "
                            f"characters, e.g. {suggest_name(name, max_len)!r}")


def suggest_name(text: str, max_len: int = 63) -> str:
    s = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    if not s or not s[0].isalpha():
        s = "run-" + s
    return s[:max_len].rstrip("-") or "run"


def bucket_name_problem(name: str) -> str | None:
    """Which of Google's bucket naming rules `name` breaks, or None."""
    limit = 222 if "." in name else 63
    if not 3 <= len(name) <= limit:
        return f"must be 3-63 characters (up to 222 with dots), not {len(name)}"
    if any(len(part) > 63 for part in name.split(".")):
        return "each dot-separated part must be at most 63 characters"
    if not _BUCKET_CHARS.fullmatch(name):
        return "use lowercase letters, digits, -, _ and ., starting and ending with a letter or digit"
    if ".." in name:
        return "no empty dot-separated part ('..')"
    if _DOTTED_DECIMAL.fullmatch(name):
        return "must not be an IP address"
    if name.startswith("goog"):
        return "must not start with 'goog'"
    if _GOOGLE_LIKE.search(name):
        return "must not contain 'google' or a close misspelling of it"
    return None


def check_bucket_name(name: str, *, field: str = "bucket") -> None:
    problem = bucket_name_problem(name)
    if problem:
        raise BadInput(f"{name!r} is not a valid bucket name: {problem}", field=field,
                       hint="or use bucket: auto (a unique name made from the project and run)")


def auto_bucket(project: str, run: str) -> str:
    """A globally unique, stable bucket name for a run: the same project and run always give the same name."""
    digest = hashlib.sha256(f"{project}/{run}".encode()).hexdigest()[:8]
    # A run may be called anything valid as a TPU name, "google-test" included, which no bucket may contain.
    stem = _GOOGLE_LIKE.sub("g-oogle", run)[:46].rstrip("-")
    return f"tpuctl-{stem}-{digest}"


def matches(labels: Mapping[str, str] | None, run: str | None = None) -> bool:
    """True when `labels` mark a tpuctl resource (of `run`, when given)."""
    if not labels or RUN not in labels:
        return False
    return run is None or labels[RUN] == run


def check_owned(found: Mapping[str, str] | None, run: str | None, *, what: str, field: str = "name",
                owner: str | None = None) -> None:
    """NameTaken unless `found` (the labels of an existing resource named like the run's, None when there is
    none) says it is `run`'s, and `owner`'s where both name one: what tpuctl did not create, it neither adopts
    nor deletes, and one owner's run is not another's who picked the same name (gc keeps them apart too)."""
    if found is not None and found.get(RUN) != run:
        raise NameTaken(f"{what} already exists and does not belong to run {run!r}", field=field,
                        hint="pick another run name with --name")
    theirs = None if found is None else found.get(OWNER)
    if owner and theirs and theirs != owner:
        raise NameTaken(f"{what} already exists: run {run!r} of owner {theirs}, not {owner}", field=field,
                        hint=f"pick another run name with --name (or act as its owner: TPUCTL_OWNER={theirs})")
