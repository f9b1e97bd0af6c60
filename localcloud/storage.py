"""Cloud Storage for `google.cloud.storage.Client` (pointed here with ``STORAGE_EMULATOR_HOST``).

The storage engine is the third-party ``gcp-storage-emulator`` (BSD), run in-process on a private
loopback port. It was chosen over ``drongo`` (Apache-2.0, 0.8 "alpha") because it keeps buckets, objects,
IAM policies and even in-flight resumable uploads in a data dir across restarts, whereas drongo's server
mode holds every object as bytes in process memory and forgets everything on exit; drongo also mocks a
dozen services tpuctl does not use. What gcp-storage-emulator gets wrong is bucket *metadata*, so the gap
is filled by a thin reverse proxy of ours in front of it (the address clients see), never by patching it:

- bucket insert: name, location and labels checked as GCS does (400, nothing created), then location (upper-cased, with its
  locationType), labels, uniform bucket-level access (mirrored as bucketPolicyOnly, with lockedTime) and
  public access prevention ("inherited" unless given) are written through the emulator's own PATCH, under a
  per-bucket lock that bucket-level requests also take, so that no client sees a bucket half created;
- bucket PATCH merges labels (``null`` deletes a key) and iamConfiguration like GCS instead of replacing;
- bucket list honours ``project`` (recorded at insert) and ``prefix``;
- IAM setIamPolicy checks the etag (412 on a stale one) and issues a new etag per write;
- errors get GCS-shaped JSON bodies (the emulator often answers 404/409 with an empty body);
- strict mode: with a ``validator_factory``, JSON request bodies are checked before they reach the
  emulator (400 on a violation) and bucket/object/policy responses after (500 on drift).

Object media is streamed through in both directions; only JSON bodies (and multipart uploads, which the
client uses only below 8 MiB) are buffered by the proxy.
"""

from __future__ import annotations

import base64
import email.message
import email.parser
import email.policy
import http.client
import json
import logging
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from functools import partial
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

from gcp_storage_emulator.server import RequestHandler as EmulatorHandler
from gcp_storage_emulator.storage import RESUMABLE_DIR
from gcp_storage_emulator.storage import Storage as EmulatorStorage

from . import facts
from . import tokens as tokenlib

LOOPBACK = "127.0.0.1"
_API = "/storage/v1"
_UPLOAD = "/upload/storage/v1"
_CHUNK = 1 << 20
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "te", "trailer", "upgrade",
               "proxy-connection"}
_BUCKET_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_.-]*[a-z0-9]")
_DOTTED_DECIMAL = re.compile(r"\d{1,3}(?:\.\d{1,3}){3}")
# "google" and close misspellings ("g00gle"): Google's naming page forbids both; the misspellings are those
# Google's storage-testbench refuses (gcs/bucket.py: g[0o][0o]g[1l][e3]).
_GOOGLE_LIKE = re.compile(r"g[o0]{2}g[l1][e3]")
_PUBLIC_ACCESS_PREVENTION = {"inherited": "inherited", "unspecified": "inherited", "enforced": "enforced"}
# GCS locks uniform bucket-level access in 90 days; after that it cannot be disabled.
_UBLA_LOCK = timedelta(days=90)
_SIDECAR = "localcloud-buckets.json"
_SOFT_SIDECAR = "localcloud-soft-deleted.json"
_SESSIONS_SIDECAR = "localcloud-upload-sessions.json"
# How often the servers' loops check for shutdown: stop() waits up to this long (the default is 0.5 s).
_POLL_S = 0.05

# (method, route) -> schema of the JSON request body and of the JSON response body, for every route the
# emulator implements that carries bucket, object or policy JSON.
_REQUEST_SCHEMAS = {
    ("POST", "buckets"): "Bucket", ("PATCH", "bucket"): "Bucket", ("PUT", "iam"): "Policy",
    ("PATCH", "object"): "Object", ("POST", "compose"): "ComposeRequest", ("POST", "upload"): "Object",
}
_RESPONSE_SCHEMAS = {
    ("GET", "buckets"): "Buckets", ("POST", "buckets"): "Bucket", ("GET", "bucket"): "Bucket",
    ("PATCH", "bucket"): "Bucket", ("GET", "iam"): "Policy", ("PUT", "iam"): "Policy",
    ("GET", "objects"): "Objects", ("GET", "object"): "Object", ("PATCH", "object"): "Object",
    ("POST", "compose"): "Object", ("POST", "copy"): "Object", ("POST", "rewrite"): "RewriteResponse",
    ("POST", "upload"): "Object", ("PUT", "upload"): "Object",
}
# First match wins: the object sub-resources come before the catch-all object route.
_ROUTES = [
    ("buckets", re.compile(rf"{_API}/b")),
    ("iam", re.compile(rf"{_API}/b/(?P<bucket>[^/]+)/iam")),
    ("bucket", re.compile(rf"{_API}/b/(?P<bucket>[^/]+)")),
    ("objects", re.compile(rf"{_API}/b/(?P<bucket>[^/]+)/o")),
    ("copy", re.compile(rf"{_API}/b/(?P<bucket>[^/]+)/o/(?P<object>.+)/copyTo/b/[^/]+/o/.+")),
    ("rewrite", re.compile(rf"{_API}/b/(?P<bucket>[^/]+)/o/(?P<object>.+)/rewriteTo/b/[^/]+/o/.+")),
    ("compose", re.compile(rf"{_API}/b/(?P<bucket>[^/]+)/o/(?P<object>.+)/compose")),
    ("object-sub", re.compile(rf"{_API}/b/(?P<bucket>[^/]+)/o/(?P<object>.+)/(?:acl|restore)")),
    ("object", re.compile(rf"{_API}/b/(?P<bucket>[^/]+)/o/(?P<object>.+)")),
    ("upload", re.compile(rf"{_UPLOAD}/b/(?P<bucket>[^/]+)/o")),
    ("download", re.compile(rf"/download{_API}/b/(?P<bucket>[^/]+)/o/(?P<object>.+)")),
]
# Requests about a bucket itself (metadata, IAM): these wait for an insert of the same name to finish.
_BUCKET_LEVEL = frozenset({"bucket", "iam"})
# Request preconditions of the JSON API (cloud.google.com/storage/docs/request-preconditions). Only
# ifGenerationMatch on an upload (single-request, or a resumable one's initiation) is emulated; any other is
# refused (501), never ignored.
_PRECONDITIONS = ("ifGenerationMatch", "ifGenerationNotMatch", "ifMetagenerationMatch", "ifMetagenerationNotMatch",
                  "ifSourceGenerationMatch", "ifSourceGenerationNotMatch", "ifSourceMetagenerationMatch",
                  "ifSourceMetagenerationNotMatch")


class _Reject(Exception):
    """A request answered by the proxy itself with a GCS-shaped error."""

    def __init__(self, status: int, message: str, reason: str):
        super().__init__(message)
        self.status, self.message, self.reason = status, message, reason


def _error_body(status: int, message: str, reason: str) -> bytes:
    error = {"code": status, "message": message, "errors": [{"message": message, "domain": "global",
                                                              "reason": reason}]}
    return json.dumps({"error": error}).encode()


# (method, route) -> the _Proxy method that answers it from emulator calls instead of passing it through.
_SPECIAL = {
    ("POST", "buckets"): "_insert_bucket", ("GET", "buckets"): "_list_buckets",
    ("PATCH", "bucket"): "_patch_bucket", ("DELETE", "bucket"): "_delete_bucket",
    ("PUT", "iam"): "_set_iam_policy", ("DELETE", "object"): "_delete_object",
}


def _valid_bucket_name(name: str) -> bool:
    """GCS naming rules (cloud.google.com/storage/docs/buckets#naming): lowercase letters, digits, -, _ and .,
    starting and ending with a letter or digit; 3-63 characters (222 with dots, 63 per dot-separated part); not
    an IP address in dotted-decimal notation; no "goog" prefix; no "google" or close misspellings."""
    limit = 222 if "." in name else 63
    return (3 <= len(name) <= limit and bool(_BUCKET_NAME_RE.fullmatch(name))
            and all(len(part) <= 63 for part in name.split(".")) and not _DOTTED_DECIMAL.fullmatch(name)
            and not name.startswith("goog") and not _GOOGLE_LIKE.search(name))


def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _soft_delete_policy(requested: Any) -> dict:
    """A softDeletePolicy as GCS stores it: retention 0 (off) or 7-90 days, effective from now. 400 otherwise."""
    raw = (requested or {}).get("retentionDurationSeconds")
    raw = facts.SOFT_DELETE_DEFAULT_S if raw is None else raw
    try:
        seconds = int(raw)
    except (TypeError, ValueError):
        seconds = -1
    if seconds != 0 and not facts.SOFT_DELETE_MIN_S <= seconds <= facts.SOFT_DELETE_MAX_S:
        raise _Reject(400, f"Invalid argument: softDeletePolicy.retentionDurationSeconds {raw!r} must be 0 (soft "
                           f"delete disabled) or between {facts.SOFT_DELETE_MIN_S} (7 days) and "
                           f"{facts.SOFT_DELETE_MAX_S} (90 days).", "invalid")
    return {"retentionDurationSeconds": str(seconds), "effectiveTime": _rfc3339(time.time())}


def _retention_s(bucket: dict | None) -> int:
    try:
        return int(((bucket or {}).get("softDeletePolicy") or {}).get("retentionDurationSeconds") or 0)
    except (TypeError, ValueError):
        return 0


def _default_bindings(project: str, uniform: bool) -> list[dict]:
    """The IAM policy GCS gives a new bucket: the project's owners and editors own it, its viewers read it
    (project convenience values). With uniform bucket-level access the object-level legacy roles are bound too,
    since no object ACL can grant them."""
    owners = [f"projectEditor:{project}", f"projectOwner:{project}"]
    viewers = [f"projectViewer:{project}"]
    bindings = [{"role": "roles/storage.legacyBucketOwner", "members": owners},
                {"role": "roles/storage.legacyBucketReader", "members": viewers}]
    if uniform:
        bindings += [{"role": "roles/storage.legacyObjectOwner", "members": owners},
                     {"role": "roles/storage.legacyObjectReader", "members": viewers}]
    return bindings


def _granted(policy: dict | None, email: str) -> frozenset[str]:
    """Storage permissions `email` (a service account) holds through the bucket's policy. Project-level roles
    are not modelled: the account has none (Google stopped granting Editor to default service accounts)."""
    who = {f"serviceAccount:{email}", "allUsers", "allAuthenticatedUsers"}
    granted: set[str] = set()
    for binding in (policy or {}).get("bindings", []):
        if who & set(binding.get("members", [])):
            granted |= facts.STORAGE_ROLES.get(binding.get("role", ""), frozenset())
    return frozenset(granted)


def _quote(name: str) -> str:
    return quote(name, safe="")


# (method, route) -> the permission it needs on the bucket in the path (None: on the project) and what kind of
# resource the permission error names. Uploads, copies and rewrites are handled in _required.
_PERMISSIONS = {
    ("POST", "buckets"): ("storage.buckets.create", None), ("GET", "buckets"): ("storage.buckets.list", None),
    ("GET", "bucket"): ("storage.buckets.get", "bucket"), ("PATCH", "bucket"): ("storage.buckets.update", "bucket"),
    ("PUT", "bucket"): ("storage.buckets.update", "bucket"), ("DELETE", "bucket"): ("storage.buckets.delete", "bucket"),
    ("GET", "iam"): ("storage.buckets.getIamPolicy", "bucket"),
    ("PUT", "iam"): ("storage.buckets.setIamPolicy", "bucket"),
    ("GET", "objects"): ("storage.objects.list", "bucket"),
    ("GET", "object"): ("storage.objects.get", "object"), ("GET", "download"): ("storage.objects.get", "object"),
    ("PATCH", "object"): ("storage.objects.update", "object"), ("PUT", "object"): ("storage.objects.update", "object"),
    ("DELETE", "object"): ("storage.objects.delete", "object"), ("POST", "compose"): ("storage.objects.create", "object"),
}
_DESTINATION = re.compile(r"/(?:copyTo|rewriteTo)/b/(?P<bucket>[^/]+)/o/")


def _upload_name(query: dict, document: Any) -> str | None:
    """The object an upload names: `name` in the query (media uploads) or in its JSON metadata."""
    return (query.get("name") or [None])[0] or (document or {}).get("name")


def _required(method: str, route: str | None, params: dict, query: dict, document: Any, path: str,
              exists: Callable[[str, str], bool]) -> list[tuple[str, str | None, str]]:
    """(permission, bucket or None for the project, noun) pairs a request needs, as Cloud Storage checks them.

    Overwriting an existing object needs storage.objects.delete as well as create (iam-permissions page);
    a resumable upload is authorized when it starts, not per chunk."""
    bucket = params.get("bucket")
    if route == "upload":
        if method != "POST" or "upload_id" in query:
            return []
        name = _upload_name(query, document)
        needs = [("storage.objects.create", bucket, "object")]
        if name and exists(bucket, name):
            needs.append(("storage.objects.delete", bucket, "object"))
        return needs
    if route in ("copy", "rewrite"):
        target = _DESTINATION.search(path)
        return [("storage.objects.get", bucket, "object"),
                ("storage.objects.create", unquote(target["bucket"]) if target else bucket, "object")]
    found = _PERMISSIONS.get((method, route))
    if found is None:
        return []
    permission, noun = found
    return [(permission, bucket if noun else None, noun or "project")]


def _carries_metadata(route: str | None, query: dict, content_type: str) -> bool:
    """Whether the request body is JSON metadata (checked, buffered) rather than object media (streamed)."""
    if route == "upload":
        return "upload_id" not in query and query.get("uploadType", [""])[0] in ("multipart", "resumable")
    return route is not None and content_type.startswith("application/json")


def _first_part(body: bytes, content_type: str) -> bytes:
    """A multipart body cut after its first part (the JSON metadata), closed with the final delimiter: the
    email parser decodes what it is given to text, and given the media too it holds several copies of an
    upload of up to 8 MiB per request thread, which malloc then keeps (the daemon grew by ~100 MB a
    concurrent upload)."""
    header = email.message.Message()
    header["Content-Type"] = content_type
    boundary = header.get_boundary()
    if not boundary:
        return body
    delimiter = b"\r\n--" + boundary.encode()
    end = body.find(delimiter, body.find(delimiter[2:]) + len(delimiter) - 2)
    return body if end < 0 else body[:end] + delimiter + b"--\r\n"


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _route(path: str) -> tuple[str | None, dict[str, str]]:
    for name, pattern in _ROUTES:
        match = pattern.fullmatch(path)
        if match:
            return name, {k: unquote(v) for k, v in match.groupdict().items()}
    return None, {}


def _location_type(location: str) -> str:
    if location in facts.GCS_MULTI_REGIONS:
        return "multi-region"
    return "dual-region" if location in facts.GCS_DUAL_REGIONS else "region"


def _next_etag(etag: str | None) -> str:
    """IAM etags as GCS writes them: base64 of a protobuf varint field 1 holding the policy's write count
    (`CAE=` for 1, `CAI=` for 2, ...), so no etag ever comes back after later writes."""
    try:
        raw = base64.b64decode(etag or "", validate=True)
    except ValueError:
        raw = b""
    count = 0
    if raw[:1] == b"\x08":
        for shift, byte in enumerate(raw[1:]):
            count |= (byte & 0x7F) << (7 * shift)
    count += 1
    out = bytearray([0x08])
    while True:
        out.append((count & 0x7F) | (0x80 if count > 0x7F else 0))
        count >>= 7
        if not count:
            return base64.b64encode(bytes(out)).decode()


def _iam_configuration(current: dict, requested: dict) -> dict:
    """Merge a requested iamConfiguration onto the current one the way GCS presents the result."""
    ubla = {**current.get("uniformBucketLevelAccess", {}), **requested.get("bucketPolicyOnly", {}),
            **requested.get("uniformBucketLevelAccess", {})}
    enabled = bool(ubla.get("enabled"))
    ubla = {"enabled": enabled}
    if enabled:
        locked = current.get("uniformBucketLevelAccess", {}).get("lockedTime")
        ubla["lockedTime"] = locked or (datetime.now(timezone.utc) + _UBLA_LOCK).isoformat(
            timespec="milliseconds").replace("+00:00", "Z")
    prevention = requested.get("publicAccessPrevention", current.get("publicAccessPrevention", "inherited"))
    if prevention not in _PUBLIC_ACCESS_PREVENTION:
        raise _Reject(400, f"Invalid value for iamConfiguration.publicAccessPrevention: {prevention!r}; "
                           "use 'enforced' or 'inherited'.", "invalid")
    return {"uniformBucketLevelAccess": ubla, "bucketPolicyOnly": dict(ubla),
            "publicAccessPrevention": _PUBLIC_ACCESS_PREVENTION[prevention]}


def _merge_labels(current: dict, patch: dict) -> dict:
    merged = {**current, **patch}
    return _checked_labels({k: v for k, v in merged.items() if v is not None})


def _label_part_ok(text: str) -> bool:
    return len(text) <= 63 and all(c.isdigit() or c in "_-" or (c.isalpha() and not c.isupper()) for c in text)


def _checked_labels(labels: dict) -> dict:
    """GCS label rules: at most 64; keys and values of lowercase letters, digits, '_' and '-', each at most
    63 characters; keys start with a letter. Real GCS answers a violation with 400, and so do we."""
    if len(labels) > 64:
        raise _Reject(400, f"Too many labels: {len(labels)} (at most 64).", "invalid")
    for key, value in labels.items():
        if not (key[:1].isalpha() and _label_part_ok(key) and isinstance(value, str) and _label_part_ok(value)):
            raise _Reject(400, f"Invalid label {key}={value!r}: keys and values use lowercase letters, digits, "
                               "'_' and '-', at most 63 characters, and keys start with a letter.", "invalid")
    return labels


# The emulator logs every 404 at ERROR level; the proxy answers those as GCS does, so they are not errors.
_EMULATOR_LOGGERS = ("gcp_storage_emulator", "api.bucket", "api.object")


class _EmulatorListener(HTTPServer):
    # Several proxy threads may connect at once while a large upload is being served. A class attribute:
    # the constructor calls listen() with it.
    request_queue_size = 256


class _Backend:
    """The emulator on its private port, reached with one short HTTP/1.0 exchange per request."""

    def __init__(self, data_dir: Path | None):
        for name in _EMULATOR_LOGGERS:
            logging.getLogger(name).setLevel(logging.CRITICAL)
        self.storage = EmulatorStorage(use_memory_fs=data_dir is None, data_dir=str(data_dir) if data_dir else None)
        self.server = _EmulatorListener((LOOPBACK, 0), partial(EmulatorHandler, self.storage))
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(_POLL_S,), name="localcloud-gcs",
                                       daemon=True)

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(LOOPBACK, self.port, timeout=300)

    def drop_uploads(self, bucket: str) -> None:
        """Forget the engine's unfinished resumable uploads into `bucket` (it has no call to cancel one)."""
        for upload_id, meta in list(self.storage.resumable.items()):
            if meta.get("bucket") == bucket:
                self.storage.delete_resumable_file_obj(upload_id)
                self.storage._delete_file(RESUMABLE_DIR, self.storage.safe_id(upload_id))

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """A JSON exchange with the emulator; the body comes back parsed (None when empty or not JSON)."""
        conn = self.connect()
        try:
            data = json.dumps(body).encode() if body is not None else None
            headers = {"Content-Type": "application/json"} if data is not None else {}
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        try:
            return resp.status, json.loads(raw) if raw else None
        except ValueError:
            return resp.status, None


class _Proxy(BaseHTTPRequestHandler):
    """Forwards to the emulator, fixing bucket metadata, IAM etags, errors, and validating in strict mode."""

    protocol_version = "HTTP/1.1"
    timeout = 120
    server: _FrontServer

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the local cloud's own log is the place for request traces, not stderr."""

    def do_GET(self) -> None:
        self._handle()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

    def _handle(self) -> None:
        self.server.last_request = time.time()
        method = self.headers.get("X-HTTP-Method-Override", self.command).upper()
        url = urlsplit(self.path)
        route, params = _route(url.path)
        query = parse_qs(url.query)
        content_type = self.headers.get("Content-Type", "")
        metadata = _carries_metadata(route, query, content_type)
        special = _SPECIAL.get((method, route))
        if route in _BUCKET_LEVEL:
            with self.server.bucket_lock(params["bucket"]):
                self._dispatch(method, route, params, query, content_type, metadata, special)
        else:
            self._dispatch(method, route, params, query, content_type, metadata, special)

    def _dispatch(self, method: str, route: str | None, params: dict, query: dict, content_type: str,
                  metadata: bool, special: str | None) -> None:
        body = None
        try:
            # Read every body the proxy answers itself, so an early rejection never desyncs keep-alive.
            body = self._read_body() if metadata or special or self._is_chunked() else None
            document = self._check_request(method, route, content_type, body) if metadata and body else None
            self._authorize(method, route, params, query, document)
            if (method, route) == ("GET", "objects") and (query.get("softDeleted") or [""])[0].lower() == "true":
                special = "_list_soft_deleted"
            with self._object_guard(method, route, params, query, document) as (headers, live):
                if special is None:
                    self._note_overwrite(route, method, params, query, document, live)
                    track = (partial(self._track_upload_session, method, params, query, document)
                             if route == "upload" else None)
                    self._forward(method, route, params, body, headers, track)
                    return
                status, payload = getattr(self, special)(params, document or {}, query)
            self._reply_json(method, route, status, payload, params)
        except _Reject as exc:
            if body is None and int(self.headers.get("Content-Length") or 0):
                self.close_connection = True  # the unread media must not be taken for the next request
            self._send(exc.status, {"Content-Type": "application/json"},
                       _error_body(exc.status, exc.message, exc.reason))

    # ---- request side

    def _is_chunked(self) -> bool:
        return self.headers.get("Transfer-Encoding", "").lower() == "chunked"

    def _read_body(self) -> bytes:
        if self._is_chunked():
            parts = []
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                parts.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline().strip():
                pass  # trailers
            return b"".join(parts)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _check_request(self, method: str, route: str | None, content_type: str, body: bytes) -> Any:
        """The JSON metadata of a request (the first part of a multipart upload), checked in strict mode."""
        try:
            if content_type.startswith("multipart/related"):
                message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
                    f"Content-Type: {content_type}\r\n\r\n".encode() + _first_part(body, content_type))
                document = json.loads(next(message.iter_parts()).get_content())
            else:
                document = json.loads(body)
        except (ValueError, StopIteration):
            raise _Reject(400, "Parse Error: the request metadata is not JSON.", "parseError") from None
        schema = _REQUEST_SCHEMAS.get((method, route))
        if schema is not None:
            # null means "unset": in a PATCH it deletes the key (the client sends labels {"old": null}), in an
            # insert it leaves the default (the client sends softDeletePolicy.effectiveTime: null). Not a type error.
            self._validate(schema, _without_nulls(document), request=True)
        return document

    def _validate(self, schema: str, document: Any, *, request: bool) -> None:
        validator = self.server.validator
        if validator is None:
            return
        check = validator.check_request if request else validator.check_response
        problems = check(schema, document)
        if problems:
            side = "request" if request else "emulator response"
            status = 400 if request else 500
            raise _Reject(status, f"localcloud strict mode: {side} is not a valid storage.v1 {schema}: "
                                  + "; ".join(problems), "invalid")

    # ---- special routes: bucket metadata and IAM, answered from emulator calls

    def _insert_bucket(self, params: dict, body: dict, query: dict) -> tuple[int, Any]:
        name = body.get("name") or ""
        if not _valid_bucket_name(name):
            raise _Reject(400, f"Invalid bucket name: '{name}'", "invalid")
        location = (body.get("location") or "US").upper()
        if location not in facts.GCS_MULTI_REGIONS | facts.GCS_DUAL_REGIONS | facts.GCS_REGIONS:
            raise _Reject(400, f"The specified location constraint is not valid: '{body.get('location')}'",
                          "invalid")
        project = (query.get("project") or [""])[0]
        if not project:
            raise _Reject(400, "Required parameter: project", "required")
        # Everything is checked before the emulator sees the bucket: bad input creates nothing.
        fields = {k: v for k, v in body.items() if k not in ("name", "iamConfiguration", "location")}
        fields.update(location=location, iamConfiguration=_iam_configuration({}, body.get("iamConfiguration", {})),
                      softDeletePolicy=_soft_delete_policy(body.get("softDeletePolicy")))
        if "labels" in fields:
            _checked_labels(fields["labels"] or {})
        backend = self.server.backend
        # Both emulator calls under the bucket's lock (a client retrying after a lost response must not see the
        # bucket half made); a failed metadata write removes the bucket again.
        with self.server.bucket_lock(name):
            status, created = backend.call("POST", f"{_API}/b", {"name": name})
            if status == 409 and self.server.projects().get(name) not in (None, project):
                # One namespace for every project: another project's bucket is not "yours already".
                raise _Reject(409, "The requested bucket name is not available. The bucket namespace is shared by "
                                   "all users of the system. Please select a different name and try again.",
                              "conflict")
            if status != 200:
                return status, created
            status, bucket = backend.call("PATCH", f"{_API}/b/{name}", fields)
            if status == 200:
                uniform = fields["iamConfiguration"]["uniformBucketLevelAccess"]["enabled"]
                status, _ = backend.call("PUT", f"{_API}/b/{name}/iam",
                                         {"bindings": _default_bindings(project, uniform)})
            if status != 200:
                backend.call("DELETE", f"{_API}/b/{name}")
                return status, bucket
            self.server.record_project(name, project)
        return status, bucket

    def _list_buckets(self, params: dict, body: dict, query: dict) -> tuple[int, Any]:
        if not (query.get("project") or [""])[0]:  # buckets.list's `project` is required (discovery document)
            raise _Reject(400, "Required parameter: project", "required")
        status, listing = self.server.backend.call("GET", f"{_API}/b")
        if status != 200:
            return status, listing
        project = (query.get("project") or [None])[0]
        prefix = (query.get("prefix") or [""])[0]
        owners = self.server.projects()
        items = [b for b in listing.get("items", [])
                 if b["name"].startswith(prefix) and (project is None or owners.get(b["name"]) == project)]
        return 200, {"kind": "storage#buckets", "items": items}

    def _patch_bucket(self, params: dict, body: dict, query: dict) -> tuple[int, Any]:
        backend = self.server.backend
        path = f"{_API}/b/{params['bucket']}"
        with self.server.read_modify_write:
            status, current = backend.call("GET", path)
            if status != 200:
                return status, current
            if "labels" in body:
                body["labels"] = _merge_labels(current.get("labels") or {}, body["labels"] or {})
            if "iamConfiguration" in body:
                body["iamConfiguration"] = _iam_configuration(current.get("iamConfiguration", {}),
                                                              body["iamConfiguration"] or {})
            if "softDeletePolicy" in body:
                # Objects deleted before the change keep the retention they were deleted under.
                body["softDeletePolicy"] = _soft_delete_policy(body["softDeletePolicy"])
            body.pop("location", None)  # a bucket's location is fixed at creation
            return backend.call("PATCH", path, body)

    def _delete_bucket(self, params: dict, body: dict, query: dict) -> tuple[int, Any]:
        """Delete an empty bucket. An unfinished resumable upload into it does not keep it (only live objects do,
        as Google's storage-testbench checks), though the engine would refuse: its sessions are dropped first.
        The bucket's soft-deleted objects stay (billed) with it, no longer listed under its name."""
        backend, bucket = self.server.backend, params["bucket"]
        status, payload = backend.call("DELETE", f"{_API}/b/{bucket}")
        if status == 409:
            _, listing = backend.call("GET", f"{_API}/b/{bucket}/o")
            if not (listing or {}).get("items"):
                self.server.upload_sessions.close_bucket(bucket)
                backend.drop_uploads(bucket)
                status, payload = backend.call("DELETE", f"{_API}/b/{bucket}")
        if status in (200, 204):
            self.server.forget_project(bucket)
            self.server.soft.bucket_deleted(bucket)
            return 204, None
        return status, payload

    def _delete_object(self, params: dict, body: dict, query: dict) -> tuple[int, Any]:
        """Delete an object; under a soft delete policy its bytes stay (and bill) until the retention ends."""
        backend = self.server.backend
        bucket, name = params["bucket"], params["object"]
        path = f"{_API}/b/{bucket}/o/{_quote(name)}"
        _, old = backend.call("GET", path)
        status, payload = backend.call("DELETE", path)
        if status in (200, 204):
            self.server.soft.deleted(old, *self._bucket_retention(bucket))
            return 204, None
        return status, payload

    def _list_soft_deleted(self, params: dict, body: dict, query: dict) -> tuple[int, Any]:
        prefix = (query.get("prefix") or [""])[0]
        items = [o for o in self.server.soft.objects(params["bucket"]) if o["name"].startswith(prefix)]
        return 200, {"kind": "storage#objects", "items": items}

    def _bucket_retention(self, bucket: str) -> tuple[int, str, str | None]:
        """(soft delete retention seconds, location, project) of a bucket; (0, "", None) when it is gone."""
        status, meta = self.server.backend.call("GET", f"{_API}/b/{bucket}")
        if status != 200:
            return 0, "", None
        return _retention_s(meta), str(meta.get("location") or ""), self.server.projects().get(bucket)

    @contextmanager
    def _object_guard(self, method: str, route: str | None, params: dict, query: dict,
                      document: Any) -> Iterator[tuple[dict[str, str], dict | None]]:
        """Generations, as GCS keeps them for read-modify-write (storage/docs/request-preconditions): an upload
        with `ifGenerationMatch` is written only if the live object has that generation (0: no live object),
        else 412 `conditionNotMet`. A single-request upload is checked as it arrives; a resumable one takes the
        precondition when it starts and is checked when its last chunk arrives (README: sources), so a session
        opens whatever the object is then. A media read answers with the object's `x-goog-generation` and
        `x-goog-metageneration` (google-cloud-storage's Blob takes its generation from them), and one naming a
        `generation` that is no longer live is 404 (a bucket without versioning keeps no readable old
        generation). Each holds the object's lock from its check to the end of its transfer (reads share it), as
        does every single-request upload and every chunk of a resumable one (the last chunk writes the object),
        so no write lands in between. Yields the response headers to add and, for a single-request upload, the
        live object it read ({} when none; None when it read nothing)."""
        given = {name: query[name][0] for name in _PRECONDITIONS if name in query}
        upload_start = route == "upload" and method == "POST" and "upload_id" not in query
        single_upload = upload_start and (query.get("uploadType") or [""])[0] in ("multipart", "media")
        resumable_start = upload_start and (query.get("uploadType") or [""])[0] == "resumable"
        session = (self.server.upload_sessions.get((query.get("upload_id") or [""])[0])
                   if route == "upload" and method == "PUT" else None)
        # A session's URI repeats the query that opened it, its precondition included: a chunk sent there
        # carries that precondition again, which is the session's own, not a new one.
        own = {"ifGenerationMatch": session.if_generation_match} if session and session.if_generation_match else {}
        emulated = (single_upload or resumable_start) and list(given) == ["ifGenerationMatch"]
        if given and given != own and not emulated:
            raise _Reject(501, f"localcloud storage does not emulate {', '.join(given)} on {method} "
                               f"{urlsplit(self.path).path} (only ifGenerationMatch on an upload's first request)",
                          "notImplemented")
        media_read = method == "GET" and (route == "download" or (route == "object" and query.get("alt") == ["media"]))
        if session is not None:  # a resumable upload's chunk: the last one writes the object, as one write
            with self.server.object_locks.held(session.bucket, session.name, shared=False):
                if session.if_generation_match is not None and _completes(self.headers.get("Content-Range", "")):
                    self._check_generation(session.bucket, session.name, session.if_generation_match)
                yield {}, None
            return
        if not (single_upload or media_read):
            yield {}, None
            return
        bucket = params["bucket"]
        name = params["object"] if media_read else _upload_name(query, document) or ""
        with self.server.object_locks.held(bucket, name, shared=media_read):
            if single_upload:
                yield {}, self._check_generation(bucket, name, (query.get("ifGenerationMatch") or [None])[0])
                return
            live = self._live_object(bucket, name)
            wanted = (query.get("generation") or [None])[0]
            if not live or (wanted is not None and wanted != str(live.get("generation"))):
                raise _Reject(404, f"No such object: {bucket}/{name}", "notFound")
            yield {"x-goog-generation": str(live["generation"]),
                   "x-goog-metageneration": str(live.get("metageneration", "1"))}, None

    def _live_object(self, bucket: str, name: str) -> dict:
        """The object's metadata as stored now; {} when there is no live object."""
        status, live = self.server.backend.call("GET", f"{_API}/b/{bucket}/o/{_quote(name)}")
        return live if status == 200 and isinstance(live, dict) else {}

    def _check_generation(self, bucket: str, name: str, expected: str | None) -> dict:
        """The live object ({} when none), after 412 if `expected` (ifGenerationMatch) is not its generation."""
        live = self._live_object(bucket, name)
        if expected is not None and expected != str(live.get("generation", "0")):
            raise _Reject(412, "At least one of the pre-conditions you specified did not hold.", "conditionNotMet")
        return live

    def _note_overwrite(self, route: str | None, method: str, params: dict, query: dict, document: Any,
                        live: dict | None) -> None:
        """Before an upload that names an existing object: remember that object, soft-deleted once replaced.
        `live` is that object when the caller has already read it (`_object_guard`)."""
        if route != "upload" or method != "POST":
            return
        name = _upload_name(query, document)
        if name and live is None:
            _, live = self.server.backend.call("GET", f"{_API}/b/{params['bucket']}/o/{_quote(name)}")
        if isinstance(live, dict) and live.get("kind") == "storage#object":
            self.server.soft.pending(live)

    def _authorize(self, method: str, route: str | None, params: dict, query: dict, document: Any) -> None:
        """IAM for requests that carry a worker's service account token; others act as the project owner."""
        token = tokenlib.bearer(self.headers.get("Authorization"))
        if token is None or not tokenlib.is_ours(token) or self.server.tokens is None:
            return
        who = self.server.tokens.identity(token)
        if who is None:
            raise _Reject(401, "Invalid Credentials", "authError")
        backend = self.server.backend

        def exists(bucket: str, name: str) -> bool:
            return backend.call("GET", f"{_API}/b/{bucket}/o/{_quote(name)}")[0] == 200

        for permission, bucket, noun in _required(method, route, params, query, document,
                                                  urlsplit(self.path).path, exists):
            if bucket is None:
                raise _Reject(403, f"{who.email} does not have {permission} access to the Google Cloud project. "
                                   f"Permission '{permission}' denied on resource (or it may not exist).",
                              "forbidden")
            status, policy = backend.call("GET", f"{_API}/b/{bucket}/iam")
            if status == 200 and permission not in _granted(policy, who.email):
                raise _Reject(403, f"{who.email} does not have {permission} access to the Google Cloud Storage "
                                   f"{noun}. Permission '{permission}' denied on resource (or it may not exist).",
                              "forbidden")

    def _set_iam_policy(self, params: dict, body: dict, query: dict) -> tuple[int, Any]:
        backend = self.server.backend
        path = f"{_API}/b/{params['bucket']}/iam"
        with self.server.read_modify_write:
            status, current = backend.call("GET", path)
            if status != 200:
                return status, current
            if body.get("etag") and body["etag"] != current.get("etag"):
                raise _Reject(412, "Precondition Failed: the policy was changed since it was read (etag "
                                   f"{body['etag']} is stale).", "conditionNotMet")
            body["etag"] = _next_etag(current.get("etag"))
            return backend.call("PUT", path, body)

    # ---- response side

    def _present(self, method: str, route: str | None, payload: Any) -> Any:
        """Fix what the emulator stores but presents wrongly, then check it against the schema."""
        if isinstance(payload, dict) and payload.get("kind") in ("storage#bucket", "storage#buckets"):
            owners = self.server.projects()
            for bucket in payload.get("items", []) if payload["kind"] == "storage#buckets" else [payload]:
                bucket["locationType"] = _location_type(bucket.get("location", "US"))
                if bucket.get("name") in owners:
                    bucket["projectNumber"] = facts.project_number(owners[bucket["name"]])
        if route == "upload" and isinstance(payload, dict) and payload.get("kind") == "storage#object":
            self.server.soft.replaced(payload, lambda: self._bucket_retention(payload.get("bucket", "")))
        schema = _RESPONSE_SCHEMAS.get((method, route))
        if schema is not None and payload is not None:
            self._validate(schema, payload, request=False)
        return payload

    def _reply_json(self, method: str, route: str | None, status: int, payload: Any, params: dict) -> None:
        if status >= 400:
            self._send_error(status, route, params, payload)
        elif payload is None:
            self._send(status, {}, b"")
        else:
            body = json.dumps(self._present(method, route, payload)).encode()
            self._send(status, {"Content-Type": "application/json"}, body)

    def _send_error(self, status: int, route: str | None, params: dict, payload: Any) -> None:
        if isinstance(payload, dict) and isinstance(payload.get("error"), dict) \
                and payload["error"].get("errors"):
            body = json.dumps(payload).encode()
        elif status == 404 and "object" in params:
            body = _error_body(404, f"No such object: {params['bucket']}/{params['object']}", "notFound")
        elif status == 404 and "bucket" in params:
            body = _error_body(404, "The specified bucket does not exist.", "notFound")
        elif status == 409 and route == "bucket":
            body = _error_body(409, "The bucket you tried to delete was not empty.", "conflict")
        elif status == 501:
            body = _error_body(501, f"localcloud storage does not implement {self.command} "
                                    f"{urlsplit(self.path).path}", "notImplemented")
        else:
            message = (payload or {}).get("error", {}).get("message") if isinstance(payload, dict) else None
            body = _error_body(status, message or HTTPStatus(status).phrase, "backendError")
        self._send(status, {"Content-Type": "application/json"}, body)

    def _send(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        if status != HTTPStatus.NO_CONTENT:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _track_upload_session(self, method: str, params: dict, query: dict, document: Any, resp) -> None:
        """Remember which object a resumable upload session writes (its chunks name only the session) and the
        precondition it was opened with, from the answer that opened it, until the answer that completed it."""
        if method == "POST" and resp.status == 200 and (query.get("uploadType") or [""])[0] == "resumable":
            opened = parse_qs(urlsplit(resp.getheader("Location") or "").query).get("upload_id")
            name = _upload_name(query, document)
            if opened and name:
                self.server.upload_sessions.open(opened[0], _UploadSession(
                    params["bucket"], name, (query.get("ifGenerationMatch") or [None])[0]))
        elif method == "PUT" and resp.status in (200, 201):
            self.server.upload_sessions.close((query.get("upload_id") or [""])[0])

    def _forward(self, method: str, route: str | None, params: dict, body: bytes | None,
                 extra_headers: dict[str, str], on_response: Callable[[Any], None] | None = None) -> None:
        """Pass the request through; media streams in chunks, JSON responses are checked and fixed.
        `on_response(response)` sees the engine's answer (status, headers) before it is relayed."""
        conn = self.server.backend.connect()
        try:
            conn.putrequest(method, self.path, skip_host=True, skip_accept_encoding=True)
            for key, value in self.headers.items():
                if key.lower() not in _HOP_BY_HOP:
                    conn.putheader(key, value)
            length = len(body) if body is not None else int(self.headers.get("Content-Length") or 0)
            conn.putheader("Content-Length", str(length))
            conn.endheaders()
            if body is not None:
                conn.send(body)
            else:
                remaining = length
                while remaining:
                    chunk = self.rfile.read(min(_CHUNK, remaining))
                    if not chunk:
                        raise ConnectionError("client closed the connection mid-body")
                    conn.send(chunk)
                    remaining -= len(chunk)
            resp = conn.getresponse()
            if on_response is not None:
                on_response(resp)
            is_json = resp.getheader("Content-Type", "").startswith("application/json")
            if resp.status >= 400 or (is_json and (method, route) in _RESPONSE_SCHEMAS):
                raw = resp.read()
                try:
                    payload = json.loads(raw) if raw else None
                except ValueError:
                    payload = None
                if resp.status >= 400:
                    self._send_error(resp.status, route, params, payload)
                    return
                headers = {k: v for k, v in resp.getheaders() if k.lower() not in _HOP_BY_HOP}
                self._send(resp.status, headers, json.dumps(self._present(method, route, payload)).encode())
                return
            self.send_response(resp.status)
            for key, value in [*resp.getheaders(), *extra_headers.items()]:
                if key.lower() not in _HOP_BY_HOP:
                    self.send_header(key, value)
            remaining = int(resp.getheader("Content-Length") or 0)
            self.send_header("Content-Length", str(remaining))
            self.end_headers()
            while remaining:
                chunk = resp.read(min(_CHUNK, remaining))
                if not chunk:
                    raise ConnectionError("storage emulator closed the connection mid-body")
                self.wfile.write(chunk)
                remaining -= len(chunk)
        finally:
            conn.close()


def _save_sidecar(path: Path | None, value: Any) -> None:
    """Replace the JSON file `path` (None: kept in memory only) with `value`, atomically."""
    if path is None:
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1, sort_keys=True))
    tmp.replace(path)


def _completes(content_range: str) -> bool:
    """Whether a resumable upload chunk with this Content-Range finishes the upload: its last byte is the
    declared total ("bytes 0-6/7"), or it declares the total with no bytes ("bytes */7"). "bytes */*" asks for
    the session's status and "bytes 0-6/*" sends a chunk of an upload of unknown size; neither completes."""
    match = re.fullmatch(r"\s*bytes\s+(?:(\d+)-(\d+)|\*)/(\d+)\s*", content_range)
    return bool(match) and (match[2] is None or int(match[2]) + 1 == int(match[3]))


@dataclass(frozen=True)
class _UploadSession:
    """A resumable upload as the proxy knows it: the object it writes and the ifGenerationMatch it started
    with (None: none), checked when it completes."""

    bucket: str
    name: str
    if_generation_match: str | None


class _UploadSessions:
    """upload_id -> _UploadSession, from the answer that opened a session to the one that completed it (a
    session abandoned unfinished stays, about 100 bytes). Persisted with the data dir like the engine's own
    in-flight uploads, so a session resumed after a restart still holds its precondition."""

    def __init__(self, sidecar: Path | None):
        self._sidecar = sidecar
        self._lock = threading.Lock()
        saved = json.loads(sidecar.read_text()) if sidecar and sidecar.exists() else {}
        self._sessions = {upload_id: _UploadSession(*fields) for upload_id, fields in saved.items()}

    def get(self, upload_id: str) -> _UploadSession | None:
        with self._lock:
            return self._sessions.get(upload_id)

    def open(self, upload_id: str, session: _UploadSession) -> None:
        with self._lock:
            self._sessions[upload_id] = session
            self._save()

    def close(self, upload_id: str) -> None:
        with self._lock:
            if self._sessions.pop(upload_id, None) is not None:
                self._save()

    def close_bucket(self, bucket: str) -> None:
        with self._lock:
            self._sessions = {k: v for k, v in self._sessions.items() if v.bucket != bucket}
            self._save()

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def _save(self) -> None:
        _save_sidecar(self._sidecar, {k: [v.bucket, v.name, v.if_generation_match] for k, v in self._sessions.items()})


class _SoftDeleted:
    """Soft-deleted object generations: kept (listed with softDeleted=true, billed) until their hardDeleteTime.

    GCS keeps their bytes for restore; localcloud keeps only their metadata and size, which is what listing and
    billing need. Persisted next to the emulator's data when there is a data dir."""

    def __init__(self, sidecar: Path | None):
        self._sidecar = sidecar
        self._lock = threading.Lock()
        self._items: list[dict] = json.loads(sidecar.read_text()) if sidecar and sidecar.exists() else []
        self._pending: dict[tuple[str, str], dict] = {}

    def deleted(self, obj: Any, retention_s: int, location: str, project: str | None) -> None:
        """Record `obj` (its metadata as read just before it went) as soft-deleted now, if the bucket keeps it."""
        if not isinstance(obj, dict) or obj.get("kind") != "storage#object" or retention_s <= 0:
            return
        now = time.time()
        item = {"kind": "storage#object", "bucket": obj["bucket"], "name": obj["name"],
                "generation": str(obj.get("generation", "")), "size": str(obj.get("size", "0")),
                "softDeleteTime": _rfc3339(now), "hardDeleteTime": _rfc3339(now + retention_s),
                "_hard": now + retention_s, "_location": location, "_project": project}
        with self._lock:
            self._items.append(item)
            self._save()

    def pending(self, obj: dict) -> None:
        """An upload over `obj` has started; it is soft-deleted when the upload completes (`replaced`)."""
        with self._lock:
            self._pending[(obj["bucket"], obj["name"])] = obj

    def replaced(self, new: dict, retention: Callable[[], tuple[int, str, str | None]]) -> None:
        """An upload completed as `new`; the object it replaced (if `pending`) is soft-deleted under the bucket's
        `retention()` = (seconds, location, project)."""
        with self._lock:
            old = self._pending.pop((new.get("bucket", ""), new.get("name", "")), None)
        if old is not None and str(old.get("generation")) != str(new.get("generation")):
            self.deleted(old, *retention())

    def bucket_deleted(self, bucket: str) -> None:
        """`bucket` is gone: its soft-deleted objects stay (retained and billed until their hardDeleteTime) but
        are no longer listed, so a new bucket of that name starts without them (storage/docs/
        use-soft-deleted-buckets: a soft-deleted bucket must be restored before its objects can be listed)."""
        with self._lock:
            for item in self._items:
                if item["bucket"] == bucket:
                    item["_bucket_deleted"] = True
            self._save()

    def _live(self) -> list[dict]:
        now = time.time()
        if any(i["_hard"] <= now for i in self._items):
            self._items = [i for i in self._items if i["_hard"] > now]
            self._save()
        return self._items

    def objects(self, bucket: str) -> list[dict]:
        """The bucket's soft-deleted objects as the JSON API lists them."""
        with self._lock:
            return [{k: v for k, v in i.items() if not k.startswith("_")} for i in self._live()
                    if i["bucket"] == bucket and not i.get("_bucket_deleted")]

    def totals(self) -> dict[str, dict]:
        """Per bucket name (deleted buckets too): soft-deleted bytes still retained, location and project."""
        out: dict[str, dict] = {}
        with self._lock:
            for i in self._live():
                row = out.setdefault(i["bucket"], {"bytes": 0, "location": i["_location"], "project": i["_project"]})
                row["bytes"] += int(i["size"] or 0)
        return out

    def _save(self) -> None:
        _save_sidecar(self._sidecar, self._items)


class _ObjectLocks:
    """Per (bucket, object): any number of readers, or one writer. Only held keys are kept, so a long-lived
    daemon holds no lock for every object it ever served; four workers reading one shard do not queue."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held: dict[tuple[str, str], int] = {}  # key -> how many readers hold it, or -1 for a writer

    @contextmanager
    def held(self, bucket: str, name: str, *, shared: bool) -> Iterator[None]:
        key = (bucket, name)
        with self._cond:
            self._cond.wait_for(lambda: self._held.get(key, 0) >= 0 if shared else key not in self._held)
            self._held[key] = self._held.get(key, 0) + 1 if shared else -1
        try:
            yield
        finally:
            with self._cond:
                if self._held[key] > 1:
                    self._held[key] -= 1
                else:
                    del self._held[key]
                self._cond.notify_all()


class _FrontServer(ThreadingHTTPServer):
    """The address clients see; owns the bucket -> project record that GCS keeps and the emulator lacks."""

    daemon_threads = True
    request_queue_size = 256  # see server._Listener: the default 5 drops connections under a burst

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client hanging up mid-transfer is routine (cancelled download); anything else is reported."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def __init__(self, backend: _Backend, validator: Any, sidecar: Path | None, tokens: tokenlib.Tokens | None,
                 soft: _SoftDeleted, upload_sessions: _UploadSessions):
        super().__init__((LOOPBACK, 0), _Proxy)
        self.backend = backend
        self.validator = validator
        self.tokens = tokens
        self.soft = soft
        self._sidecar = sidecar
        self._lock = threading.Lock()
        # Held across a read and the write that depends on it (label merges, IAM etag checks), so two
        # concurrent writers cannot both pass on the same etag.
        self.read_modify_write = threading.Lock()
        self._projects: dict[str, str] = json.loads(sidecar.read_text()) if sidecar and sidecar.exists() else {}
        self._bucket_locks: dict[str, threading.Lock] = {}
        self.object_locks = _ObjectLocks()
        self.upload_sessions = upload_sessions
        self.last_request = time.time()  # wall clock of the latest request (the daemon's idle stop reads it)

    def bucket_lock(self, bucket: str) -> threading.Lock:
        """Held by a bucket insert (create + metadata) and by every bucket-level request for that name, so that
        none sees the bucket half made; GCS creates a bucket with its metadata in one step."""
        with self._lock:
            return self._bucket_locks.setdefault(bucket, threading.Lock())

    def projects(self) -> dict[str, str]:
        with self._lock:
            return dict(self._projects)

    def record_project(self, bucket: str, project: str) -> None:
        with self._lock:
            self._projects[bucket] = project
            self._save()

    def forget_project(self, bucket: str) -> None:
        with self._lock:
            self._projects.pop(bucket, None)
            self._save()

    def _save(self) -> None:
        _save_sidecar(self._sidecar, self._projects)


class StorageServer:
    """Cloud Storage on 127.0.0.1: persistent under ``data_dir`` (in memory when None).

    ``validator_factory("storage.v1")`` (e.g. ``schema.Validator``) turns on strict mode. With ``tokens``,
    requests bearing a token it issued are checked against the bucket's IAM policy.
    ``start`` blocks until the server answers; ``stop`` is idempotent.
    """

    def __init__(self, data_dir: Path | None, validator_factory: Callable[[str], object] | None = None,
                 tokens: tokenlib.Tokens | None = None):
        self._data_dir = Path(data_dir).absolute() if data_dir is not None else None
        self._validator = validator_factory("storage.v1") if validator_factory else None
        self._tokens = tokens
        self._backend: _Backend | None = None
        self._front: _FrontServer | None = None
        self._front_thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Where clients reach it, as ``start`` returned; RuntimeError when not started."""
        if self._front is None:
            raise RuntimeError("storage server is not started")
        return f"http://{LOOPBACK}:{self._front.server_address[1]}"

    def start(self) -> str:
        """Serve; returns "http://127.0.0.1:PORT" for ``STORAGE_EMULATOR_HOST``. Idempotent."""
        if self._front is not None:
            return self.url
        if self._data_dir is not None:
            self._data_dir.mkdir(parents=True, exist_ok=True)
        self._backend = _Backend(self._data_dir)
        self._backend.thread.start()
        data = self._data_dir
        self._front = _FrontServer(self._backend, self._validator, data / _SIDECAR if data else None, self._tokens,
                                   _SoftDeleted(data / _SOFT_SIDECAR if data else None),
                                   _UploadSessions(data / _SESSIONS_SIDECAR if data else None))
        self._front_thread = threading.Thread(target=self._front.serve_forever, args=(_POLL_S,),
                                              name="localcloud-gcs-proxy", daemon=True)
        self._front_thread.start()
        return self.url

    @property
    def last_request(self) -> float:
        """Wall clock of the latest request served (the start time before any)."""
        return self._front.last_request if self._front is not None else 0.0

    def stop(self) -> None:
        """Stop both servers; the data dir keeps everything for the next start."""
        if self._front is None:
            return
        self._front.shutdown()
        self._front.server_close()
        self._backend.server.shutdown()
        self._backend.server.server_close()
        self._front_thread.join()
        self._backend.thread.join()
        self._front = self._backend = self._front_thread = None

    def buckets(self) -> list[dict]:
        """Every whole bucket (none an insert is still making) with what the billing meter and `local status`
        need, read through the emulator.

        Keys: name, project, location, labels, iamConfiguration, iam_policy, softDeletePolicy, objects (count),
        bytes.
        """
        if self._backend is None or self._front is None:
            raise RuntimeError("storage server is not started")
        backend = self._backend
        # An insert records the owner last, under the bucket's lock, after the metadata write; owners read before
        # the listing therefore name only buckets that were whole when listed. A bucket without one is half made
        # (clients' buckets.list hides it too) and would otherwise be metered at the default location.
        owners = self._front.projects()
        _, listing = backend.call("GET", f"{_API}/b")
        result = []
        for bucket in (listing or {}).get("items", []):
            name = bucket["name"]
            if name not in owners:
                continue
            _, policy = backend.call("GET", f"{_API}/b/{name}/iam")
            _, objects = backend.call("GET", f"{_API}/b/{name}/o")
            items = (objects or {}).get("items", [])
            result.append({
                "name": name,
                "project": owners.get(name),
                "location": bucket.get("location"),
                "labels": bucket.get("labels") or {},
                "iamConfiguration": bucket.get("iamConfiguration", {}),
                "iam_policy": policy,
                "softDeletePolicy": bucket.get("softDeletePolicy") or {},
                "objects": len(items),
                "bytes": sum(int(item.get("size", 0)) for item in items),
            })
        return result

    def soft_deleted(self) -> dict[str, dict]:
        """Per bucket name, including deleted buckets: bytes of soft-deleted objects still retained (billed until
        their hardDeleteTime), location and project."""
        if self._front is None:
            raise RuntimeError("storage server is not started")
        return self._front.soft.totals()
