"""The one HTTP front end: TPU, Compute, Resource Manager, Billing and the `/_localcloud/` admin API.

Routes come from the discovery documents themselves (each method's `flatPath`), so a path the real API
does not have cannot be served by accident. Per request: admin or legacy-v1 check -> route -> request
faults (quota 429, unavailable 503) -> JSON body -> integer enums to names (TPU, CRM and Billing clients
send `$alt=json;enum-encoding=int`) -> strict request check -> handler -> response fault (odd-response) ->
strict response check -> names back to integers when the client asked for them.
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

from . import quotas
from .core import ApiError, World
from .schema import load_document, validator
from .tpu import tpu_spelling

# (discovery doc, short-method prefix to strip, error style, proto types module for int enums)
_APIS = (
    ("tpu.v2", "tpu.projects.locations.", "google", "google.cloud.tpu_v2.types"),
    # v2alpha1 only for what v2 lacks: flex-start queued resources (provisioningModel, runDuration).
    ("tpu.v2alpha1", "tpu.projects.locations.", "google", None),
    ("compute.v1", "compute.", "compute", None),
    ("cloudresourcemanager.v3", "cloudresourcemanager.", "google", "google.cloud.resourcemanager_v3.types"),
    ("cloudbilling.v1", "cloudbilling.", "google", "google.cloud.billing_v1.types"),
    ("serviceusage.v1", "serviceusage.", "google", "google.cloud.service_usage_v1.types"),
    ("iam.v1", "iam.", "google", None),
    ("oslogin.v1", "oslogin.", "google", "google.cloud.oslogin_v1.types"),
    ("orgpolicy.v2", "orgpolicy.", "google", None),
    ("cloudquotas.v1", "cloudquotas.projects.locations.", "google", None),
)
SERVICE_OF_DOC = {"tpu.v2": "tpu", "tpu.v2alpha1": "tpu", "compute.v1": "compute", "cloudresourcemanager.v3": "cloudresourcemanager",
                  "cloudbilling.v1": "cloudbilling", "serviceusage.v1": "serviceusage", "iam.v1": "iam",
                  "oslogin.v1": "oslogin", "orgpolicy.v2": "orgpolicy", "cloudquotas.v1": "cloudquotas"}
# Methods served from these documents, by method id prefix (the rest of the document is not served).
_ONLY = {"tpu.v2alpha1": ("tpu.projects.locations.queuedResources.", "tpu.projects.locations.operations.get")}
# Versions whose resources may have been made through another version: answers leave out what only that one has.
_PRUNED = {"tpu.v2": "tpu.v2alpha1"}
# Request bodies of these methods may carry output-only fields: clients send back what they read.
_UPDATE_METHODS = {"tpu.projects.locations.nodes.patch"}


class Route:
    def __init__(self, doc: str, method_id: str, verb: str, pattern: re.Pattern, request: str | None,
                 response: str | None, short: str, style: str, types_module: str | None):
        self.doc, self.method_id, self.verb, self.pattern = doc, method_id, verb, pattern
        self.request, self.response, self.short, self.style = request, response, short, style
        self.types_module = types_module
        self.service = SERVICE_OF_DOC[doc]


def build_routes() -> list[Route]:
    routes = []
    for doc_name, prefix, style, types_module in _APIS:
        doc = load_document(doc_name)
        base = "/" + (doc.get("servicePath") or "")

        def walk(resources: dict) -> None:
            for res in resources.values():
                for m in (res.get("methods") or {}).values():
                    if doc_name in _ONLY and not m["id"].startswith(_ONLY[doc_name]):
                        continue
                    path = m.get("flatPath") or m["path"]
                    regex = re.sub(r"\{[+]?(\w+)\}", r"(?P<\1>[^/:]+)", re.escape(base + path).replace(r"\{", "{").replace(r"\}", "}"))
                    routes.append(Route(doc_name, m["id"], m["httpMethod"], re.compile(regex + "$"),
                                        (m.get("request") or {}).get("$ref"), (m.get("response") or {}).get("$ref"),
                                        m["id"][len(prefix):], style, types_module))
                walk(res.get("resources") or {})

        walk(doc.get("resources") or {})
    return routes


# ------------------------------------------------------------------------------------------ enum codec

class EnumCodec:
    """Converts enum fields between names (discovery form) and numbers (the clients' wire form), guided
    by the official protobuf descriptors: the numbers are not list positions (V3=4, V4=7, ...)."""

    def __init__(self, types_module: str):
        import importlib

        self._types = importlib.import_module(types_module)

    def descriptor(self, schema_name: str):
        cls = getattr(self._types, schema_name, None)
        return cls.pb().DESCRIPTOR if cls is not None and hasattr(cls, "pb") else None

    def convert(self, schema_name: str | None, body: Any, *, to_numbers: bool) -> Any:
        if schema_name == "Operation" and isinstance(body, dict):
            return self._operation(body, to_numbers)
        desc = self.descriptor(schema_name) if schema_name else None
        return _walk(desc, body, to_numbers) if desc is not None else body

    def _operation(self, op: dict, to_numbers: bool) -> dict:
        out = dict(op)
        inner = out.get("response")
        if isinstance(inner, dict) and "@type" in inner:
            desc = self.descriptor(inner["@type"].rsplit(".", 1)[-1])
            if desc is not None:
                out["response"] = {"@type": inner["@type"], **_walk(desc, {k: v for k, v in inner.items() if k != "@type"}, to_numbers)}
        return out


def _enum_value(enum_type, value, to_numbers: bool):
    if to_numbers and isinstance(value, str) and value in enum_type.values_by_name:
        return enum_type.values_by_name[value].number
    if not to_numbers and isinstance(value, int) and not isinstance(value, bool) and value in enum_type.values_by_number:
        return enum_type.values_by_number[value].name
    return value


def _walk(desc, data: Any, to_numbers: bool) -> Any:
    if not isinstance(data, dict):
        return data
    out = {}
    for key, value in data.items():
        field = desc.fields_by_camelcase_name.get(key)
        if field is None:
            out[key] = value
        elif field.enum_type is not None:
            out[key] = ([_enum_value(field.enum_type, v, to_numbers) for v in value] if isinstance(value, list)
                        else _enum_value(field.enum_type, value, to_numbers))
        elif field.message_type is not None:
            mt = field.message_type
            if mt.GetOptions().map_entry:
                vfield = mt.fields_by_name["value"]
                if vfield.message_type is not None and isinstance(value, dict):
                    out[key] = {k: _walk(vfield.message_type, v, to_numbers) for k, v in value.items()}
                elif vfield.enum_type is not None and isinstance(value, dict):
                    out[key] = {k: _enum_value(vfield.enum_type, v, to_numbers) for k, v in value.items()}
                else:
                    out[key] = value
            elif isinstance(value, list):
                out[key] = [_walk(mt, v, to_numbers) for v in value]
            else:
                out[key] = _walk(mt, value, to_numbers)
        else:
            out[key] = value
    return out


# ------------------------------------------------------------------------------------------ the server

class Api:
    """Dispatch for the Google APIs; `handlers` maps discovery method ids to `fn(params, query, body)`."""

    def __init__(self, world: World, handlers: dict[str, Callable], admin: Callable[[str, str, dict, Any], tuple[int, Any]],
                 guard: Callable[[str, dict], None] | None = None):
        self.w = world
        self.guard = guard  # (service, path params) -> raises ApiError for a project that cannot call it
        self.handlers = handlers
        self.admin = admin
        self.routes = build_routes()
        self._codecs: dict[str, EnumCodec] = {}
        self._codec_lock = threading.Lock()

    def codec(self, module: str) -> EnumCodec:
        with self._codec_lock:
            if module not in self._codecs:
                self._codecs[module] = EnumCodec(module)
            return self._codecs[module]

    def match(self, verb: str, path: str) -> tuple[Route, dict] | None:
        for route in self.routes:
            if route.verb == verb:
                m = route.pattern.match(path)
                if m:
                    return route, m.groupdict()
        return None

    def handle(self, verb: str, raw_path: str, raw_body: bytes) -> tuple[int, dict]:
        self.w.last_request = time.time()
        url = urlsplit(raw_path)
        path = url.path
        # A repeated parameter (Service Usage `names=A&names=B`) stays a list; every other one is a string.
        query = {k: v[0] if len(v) == 1 else v for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        if path.startswith("/_localcloud/"):
            try:
                body = json.loads(raw_body) if raw_body.strip() else {}
            except ValueError as exc:
                return 400, {"error": f"the admin API takes a JSON body: {exc}"}
            if not isinstance(body, dict):
                return 400, {"error": "the admin API takes a JSON object"}
            return self.admin(verb, path[len("/_localcloud/"):].strip("/"), query, body)
        # (Cloud Quotas' v1 paths, .../locations/global/services/..., are not the TPU API's.)
        if re.match(r"^/v1(alpha1)?/projects/[^/]+/locations/(?![^/]+/services/)", path):
            err = ApiError("FAILED_PRECONDITION", "TPU Nodes and the Cloud TPU v1 API were retired on 2025-04-15: "
                           "create TPU VMs with the v2 API (tpu_v2.TpuClient).", http=400)
            return err.http, err.body("google")
        found = self.match(verb, path)
        if found is None:
            err = ApiError("NOT_FOUND", f"localcloud serves no {verb} {path}", http=404)
            return err.http, err.body("compute" if path.startswith("/compute/") else "google")
        route, params = found
        try:
            return 200, self._call(route, params, query, raw_body)
        except ApiError as err:
            return err.http, err.body(route.style)

    def _call(self, route: Route, params: dict, query: dict, raw_body: bytes) -> dict:
        zone = params.get("locationsId") or params.get("zone")
        if self.w.faults.take("unavailable", route.service, route.short, zone):
            raise ApiError("UNAVAILABLE", "The service is currently unavailable.")
        fault = self.w.faults.take("quota", route.service, route.short, zone, where=lambda f: not f.in_operation)
        if fault:
            raise quota_error(fault, route.service, zone, params.get("projectsId") or params.get("project"))
        if self.guard is not None:
            self.guard(route.service, params, query)
        handler = self.handlers.get(route.method_id)
        if handler is None:
            raise ApiError("UNIMPLEMENTED", f"localcloud does not implement {route.method_id}.")
        int_enums = "enum-encoding=int" in query.get("$alt", "")
        body = None
        if route.request:
            try:
                body = json.loads(raw_body) if raw_body.strip() else {}
            except ValueError as exc:
                raise ApiError("INVALID_ARGUMENT", f"Invalid JSON payload received. {exc}") from None
            if route.types_module:
                body = self.codec(route.types_module).convert(route.request, body, to_numbers=False)
            if self.w.strict:
                check = validator(route.doc)
                problems = (check.check_response if route.method_id in _UPDATE_METHODS else check.check_request)(route.request, body)
                if problems:
                    raise ApiError("INVALID_ARGUMENT", "Invalid JSON payload received (localcloud strict schema): " + "; ".join(problems))
        if route.doc == "tpu.v2alpha1":
            body = tpu_spelling(body, alpha=False)
        result = handler(params, query, body)
        if route.doc == "tpu.v2alpha1":
            result = tpu_spelling(result, alpha=True)
        if route.doc in _PRUNED and route.response:
            result = validator(route.doc).prune(route.response, result, validator(_PRUNED[route.doc]))
        odd = self.w.faults.take("odd-response", route.service, route.short, zone)
        if odd:
            result = odd_response(result, odd.field or "", empty=bool(odd.empty))
        if self.w.strict and route.response:
            problems = validator(route.doc).check_response(route.response, result)
            if problems:
                raise ApiError("INTERNAL", "localcloud produced a response that violates the discovery schema: " + "; ".join(problems))
        if int_enums and route.types_module:
            result = self.codec(route.types_module).convert(route.response, result, to_numbers=True)
        return result


def odd_response(result: dict, path: str, *, empty: bool) -> dict:
    """`result` without the field at dotted `path` (through every element of a list on the way), or with it an
    empty list: still valid for the discovery schema (the strict check runs after), since a response field is
    optional there, but not what a client expects. A test device of localcloud's, not a Google behaviour."""
    out = json.loads(json.dumps(result))
    head, _, rest = path.partition(".")
    nodes = [out]
    while rest:
        nodes = [n for parent in nodes for n in _each(parent.get(head) if isinstance(parent, dict) else None)]
        head, _, rest = rest.partition(".")
    for n in nodes:
        if isinstance(n, dict) and (head in n or empty):
            if empty:
                n[head] = []
            else:
                del n[head]
    return out


def _each(value) -> list:
    return value if isinstance(value, list) else [value] if isinstance(value, dict) else []


def quota_error(fault, service: str, zone: str | None, project: str | None) -> ApiError:
    """A quota refusal as each API sends it. Compute: HTTP 403 with `errors[].reason` "quotaExceeded" and no
    google.rpc details. Cloud TPU: HTTP 429 RESOURCE_EXHAUSTED "Quota limit '...' has been exceeded", with
    a google.rpc.QuotaFailure (and ErrorInfo) detail unless the fault says `details: false`."""
    if service == "compute":
        return quotas.compute_exceeded(fault.quota or "CPUS", zone.rsplit("-", 1)[0] if zone else "global", 0)
    quota = fault.quota or {"tpu": "TPUV3sPerProjectPerZoneForTPUAPI"}.get(service, f"{service}.googleapis.com/requests")
    return quotas.exceeded(quota, zone or None, 0, project=project, service=f"{service}.googleapis.com",
                           details=fault.details is not False)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    api: Api  # set on the subclass made per server

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            status, body = self.api.handle(self.command, self.path, raw)
        except Exception as exc:  # a localcloud bug must surface as a 500 with the reason, not a hang
            status, body = 500, ApiError("INTERNAL", f"localcloud internal error: {type(exc).__name__}: {exc}").body("google")
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

    def log_message(self, format: str, *args) -> None:  # quiet: tests and the daemon log elsewhere
        return None


class _Listener(ThreadingHTTPServer):
    # The listen() backlog: the default 5 drops connections when a few dozen tpuctl processes start at once,
    # and a client's retry of a create whose request did get through then meets 409. Must be a class
    # attribute: the constructor calls listen().
    request_queue_size = 256
    daemon_threads = True


class HttpServer:
    """Serves `api` on 127.0.0.1:port (0 = ephemeral) from a background thread."""

    def __init__(self, api: Api, port: int = 0):
        handler = type("Handler", (_Handler,), {"api": api})
        self.httpd = _Listener(("127.0.0.1", port), handler)
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="localcloud-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)
