"""The Compute Engine metadata server as a worker sees it: one server for every worker, a port per worker.

A real VM reaches its metadata server at `metadata.google.internal` (169.254.169.254), which tells VMs apart by
the network they call from. Every local worker is 127.0.0.1, so each one gets its own port instead and finds
it, as google-auth and JAX do, through `GCE_METADATA_HOST` / `GCE_METADATA_IP` (`127.0.0.1:PORT`).

What a request sees follows Google's metadata server (sources in localcloud/README.md, "The worker guest"):
`/computeMetadata/v1/...` needs the `Metadata-Flavor: Google` request header (403 without it); `/` answers the
ping google-auth sends; every answer carries the `Metadata-Flavor: Google` response header google-auth checks;
a directory ending in `/` lists its entries (sub-directories with a trailing `/`), `?recursive=true` returns
it as JSON (keys camelCased outside `attributes/`, as Google does); a directory without the `/` redirects to
it; `.../token` returns `{"access_token", "expires_in", "token_type"}` JSON. Every answer carries an `ETag`
of its content; `?wait_for_change=true` holds the request until the content differs from `last_etag` (or,
without one, from what it was when the request came), or `timeout_sec` passed, and answers it then
(compute/docs/metadata/querying-metadata, "Wait for updates").

The answers come from a callable per worker (`tree(index)`), called at each request under the caller's lock,
so metadata patched through the API is what the guest reads next. A tree is nested dicts: a `str` is a text
value, a `Json` a JSON value that recursive listings leave out (as they leave out `token`), a dict a directory.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, urlsplit

LOOPBACK = "127.0.0.1"
ROOT = "/computeMetadata/v1/"
FLAVOR = ("Metadata-Flavor", "Google")
# Values Google returns as JSON numbers in recursive listings.
_NUMERIC = frozenset({"id", "numeric-project-id"})
_ACCEPT_POLL_S = 0.5
_CONN_TIMEOUT_S = 30.0
_CHANGE_POLL_S = 0.05  # how often a held wait_for_change request looks at its value again


@dataclass(frozen=True)
class Json:
    """A value served as JSON (e.g. a token); not part of recursive listings."""

    value: Any


Tree = dict[str, Any]


def service_account_dir(email: str, scopes: list[str], token: tuple[str, int] | None = None) -> Tree:
    """`instance/service-accounts/<account>/`, as google-auth's `get_service_account_info` and token fetch read it.

    `token` is the account's access token and its seconds left (`tokens.Tokens.cached`: Cloud Storage checks bucket
    IAM for it); without one, a fresh random string that nothing checks.
    """
    access, expires_in = token or (f"ya29.localcloud-{secrets.token_urlsafe(24)}", 3599)
    return {"aliases": "default", "email": email, "scopes": "\n".join(scopes) + "\n",
            "token": Json({"access_token": access, "expires_in": expires_in, "token_type": "Bearer"})}


def guest_tree(*, project: str, number: str, zone: str, name: str, instance_id: str, attributes: dict[str, str],
               service_account: tuple[str, list[str]] | None, tokens: Any = None,
               machine_type: str | None = None, preempted: bool = False) -> Tree:
    """The paths a Compute Engine guest (a TPU VM worker is one) reads; see the module docstring.

    `instance/hostname` is the VM's internal zonal DNS name, NAME.ZONE.c.PROJECT.internal. `instance/machine-type`
    (`projects/NUMBER/machineTypes/TYPE`, compute/docs/metadata/predefined-metadata-keys) is served for a
    Compute Engine instance (`machine_type`); a TPU API node's VM has no machine type any source shows.
    `preempted`: the guest is in a preemption's notice (`instance/preempted` TRUE).
    """
    accounts: Tree = {}
    if service_account is not None:
        email, scopes = service_account
        token = tokens.cached(f"{instance_id}/{email}", email, project) if tokens is not None else None
        accounts = {"default": service_account_dir(email, scopes, token),
                    email: service_account_dir(email, scopes, token)}
    instance: Tree = {"machine-type": f"projects/{number}/machineTypes/{machine_type}"} if machine_type else {}
    return {
        # maintenance-event and preempted are what a guest polls for a coming maintenance or a Spot preemption
        # (compute/docs/metadata/getting-live-migration-notice; compute/docs/instances/spot): NONE and FALSE
        # while neither is coming; preempted is TRUE during a preemption's notice.
        "instance": {"attributes": dict(attributes), "hostname": f"{name}.{zone}.c.{project}.internal",
                     "id": instance_id, "maintenance-event": "NONE", "name": name,
                     "preempted": "TRUE" if preempted else "FALSE",
                     "zone": f"projects/{number}/zones/{zone}", "service-accounts": accounts, **instance},
        "project": {"attributes": {}, "numeric-project-id": number, "project-id": project},
    }


def _etag(body: str) -> str:
    """An ETag of an answer's content: the same content, the same tag (Google's are 16 hex digits too)."""
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def _camel(key: str) -> str:
    head, *rest = key.split("-")
    return head + "".join(part.capitalize() for part in rest)


def _recursive(node: Any, key: str = "", in_attributes: bool = False) -> Any:
    """A directory as `?recursive=true` JSON: Google's own keys camelCased; attribute keys and account names kept."""
    if isinstance(node, dict):
        keep = in_attributes or key == "service-accounts"
        return {(k if keep else _camel(k)): _recursive(v, k, in_attributes or k == "attributes")
                for k, v in node.items() if not isinstance(v, Json)}
    if key in _NUMERIC and not in_attributes and node.isdigit():
        return int(node)
    if key in ("aliases", "scopes") and not in_attributes:
        return [line for line in node.splitlines() if line]
    return node


class _Handler(BaseHTTPRequestHandler):
    server_version = "Metadata Server for VM"
    sys_version = ""
    listener: "_Listener"

    def __init__(self, request, client_address, listener: "_Listener"):
        self.listener = listener
        super().__init__(request, client_address, listener)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        pass  # the daemon's log is for the emulator, not for every guest request

    def _send(self, status: int, body: str, content_type: str = "application/text",
              headers: dict[str, str] | None = None) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header(*FLAVOR)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        url = urlsplit(self.path)
        if url.path == "/":
            self._send(200, "computeMetadata/\n")
            return
        if url.path in ("/computeMetadata", "/computeMetadata/"):
            self._send(200, "v1/\n")
            return
        if not url.path.startswith(ROOT) and url.path != ROOT.rstrip("/"):
            self._send(404, "Not Found\n", "text/html; charset=UTF-8")
            return
        if self.headers.get(FLAVOR[0]) != FLAVOR[1]:
            self._send(403, f"Your client does not have permission to get URL {url.path} from this server. "
                            "Missing Metadata-Flavor:Google header.\n", "text/html; charset=UTF-8")
            return
        query = parse_qs(url.query)
        answer = self._answer(url, query)
        if query.get("wait_for_change", ["false"])[-1].lower() == "true" and answer[0] == 200:
            answer = self._changed(url, query, answer)
        status, body, content_type, headers = answer
        self._send(status, body, content_type, headers)

    def _answer(self, url, query) -> tuple[int, str, str, dict[str, str]]:
        """(status, body, content type, headers) for the path as the tree is now."""
        parts = [p for p in url.path[len(ROOT):].split("/") if p] if url.path.startswith(ROOT) else []
        node: Any = self.listener.answer()
        for part in parts:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                return 404, "Not Found\n", "text/html; charset=UTF-8", {}
        recursive = query.get("recursive", ["false"])[-1].lower() == "true"
        if isinstance(node, Json):
            body, content_type = json.dumps(node.value), "application/json"
        elif isinstance(node, str):
            body, content_type = node, "application/text"
        elif not url.path.endswith("/"):
            return 301, "", "application/text", {"Location": url.path + "/" + (f"?{url.query}" if url.query else "")}
        elif recursive:
            value = _recursive(node, parts[-1] if parts else "", "attributes" in parts)
            body, content_type = json.dumps(value), "application/json"
        else:
            body = "".join(k + ("/" if isinstance(v, dict) else "") + "\n" for k, v in node.items())
            content_type = "application/text"
        return 200, body, content_type, {"ETag": _etag(body)}

    def _changed(self, url, query, answer):
        """`answer` once its ETag differs from `last_etag` (default: its own now), or at `timeout_sec`
        (default: the connection's own timeout); a path that stops answering 200 answers at once."""
        try:
            timeout = min(float(query.get("timeout_sec", [_CONN_TIMEOUT_S])[-1]), _CONN_TIMEOUT_S)
        except ValueError:
            return 400, "Invalid timeout_sec\n", "text/html; charset=UTF-8", {}
        last = query.get("last_etag", [answer[3]["ETag"]])[-1]
        deadline = time.monotonic() + timeout
        while answer[0] == 200 and answer[3]["ETag"] == last and time.monotonic() < deadline \
                and not self.listener.closed:
            time.sleep(_CHANGE_POLL_S)
            answer = self._answer(url, query)
        return answer

    do_HEAD = do_GET

    def do_POST(self) -> None:  # noqa: N802
        self._send(405, "Method Not Allowed\n", "text/html; charset=UTF-8")


class _Listener:
    """One worker's port: a thread accepting connections, a thread per request (HTTP/1.0, one per connection)."""

    def __init__(self, tree: Callable[[int], Tree | None], index: int) -> None:
        self._tree = tree
        self._index = index
        self._sock = socket.create_server((LOOPBACK, 0))
        self._sock.settimeout(_ACCEPT_POLL_S)
        self.port = self._sock.getsockname()[1]
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name=f"metadata-{self.port}", daemon=True).start()

    def answer(self) -> Tree:
        return self._tree(self._index) or {}

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, addr = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, addr), daemon=True).start()

    def _serve(self, conn: socket.socket, addr) -> None:
        conn.settimeout(_CONN_TIMEOUT_S)
        try:
            _Handler(conn, addr, self)
        except OSError:
            pass  # the guest hung up
        finally:
            conn.close()

    def close(self) -> None:
        """Stop accepting at once; the accept thread notices within `_ACCEPT_POLL_S` and ends."""
        self._closed.set()
        self._sock.close()


class MetadataServer:
    """Per-worker metadata endpoints, keyed like the worker pool ("node key", worker index). Thread-safe."""

    def __init__(self) -> None:
        self._nodes: dict[str, list[_Listener]] = {}
        self._lock = threading.Lock()

    def attach(self, key: str, count: int, tree: Callable[[int], Tree | None]) -> list[str]:
        """Serve `tree(i)` to worker i of `key`; returns each worker's `GCE_METADATA_HOST` ("127.0.0.1:PORT").

        Idempotent: a node already attached keeps its ports (its workers' environments name them).
        """
        with self._lock:
            listeners = self._nodes.get(key)
            if listeners is None or len(listeners) != count:
                for listener in listeners or []:
                    listener.close()
                listeners = self._nodes[key] = [_Listener(tree, i) for i in range(count)]
            return [f"{LOOPBACK}:{listener.port}" for listener in listeners]

    def detach(self, key: str) -> None:
        """Stop serving `key`'s workers. Idempotent."""
        with self._lock:
            for listener in self._nodes.pop(key, []):
                listener.close()

    def close(self) -> None:
        with self._lock:
            for listeners in self._nodes.values():
                for listener in listeners:
                    listener.close()
            self._nodes.clear()
