"""Strict schema mode: request and response bodies checked against Google's discovery documents.

The discovery documents shipped with google-api-python-client describe every body the real APIs accept
and return. Each `schemas` entry is converted to JSON Schema once and compiled lazily with fastjsonschema
(the compute document is 5 MB; only the schemas a test touches are ever compiled):

- `$ref: X` becomes `#/$defs/X`; every object is closed (unknown properties rejected) unless the
  discovery document declares `additionalProperties` (a map);
- int64/uint64 (strings on the wire) must be digit strings (requests may send integers),
  enums must be one of the declared names;
- in requests, output-only fields (`readOnly`, or a description starting "[Output Only]" / "Output
  only.") are forbidden; responses may carry them.

A check returns a list of violations ("node.acceleratorTypo: unknown field"); empty means valid. The
validator expects enums as names: the server converts the TPU/CRM/Billing clients' integer enums
(`enum-encoding=int`) before checking.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from pathlib import Path
from typing import Any

import fastjsonschema

_DOC_FILES = {
    "tpu.v2": "tpu.v2.json",
    "tpu.v2alpha1": "tpu.v2alpha1.json",
    "compute.v1": "compute.v1.json",
    "storage.v1": "storage.v1.json",
    "cloudresourcemanager.v3": "cloudresourcemanager.v3.json",
    "cloudbilling.v1": "cloudbilling.v1.json",
    "serviceusage.v1": "serviceusage.v1.json",
    "iam.v1": "iam.v1.json",
    "oslogin.v1": "oslogin.v1.json",
    "orgpolicy.v2": "orgpolicy.v2.json",
}
# Discovery documents googleapiclient does not ship, transcribed beside this file (each says from what).
_OWN_DOCS = {"cloudquotas.v1": "cloudquotas.v1.json"}

_INT64_FORMATS = {"int64", "uint64"}
_OUTPUT_ONLY_PREFIXES = ("[Output Only]", "Output only.", "Output Only.")


def discovery_dir() -> Path:
    import googleapiclient

    return Path(os.path.dirname(googleapiclient.__file__)) / "discovery_cache" / "documents"


@functools.lru_cache(maxsize=None)
def load_document(name: str) -> dict:
    """The parsed discovery document `name` ("tpu.v2", "compute.v1", ...); parsed once per process."""
    if name in _OWN_DOCS:
        return json.loads((Path(__file__).parent / _OWN_DOCS[name]).read_text())
    if name not in _DOC_FILES:
        raise KeyError(f"no discovery document {name!r}; known: {', '.join([*_DOC_FILES, *_OWN_DOCS])}")
    return json.loads((discovery_dir() / _DOC_FILES[name]).read_text())


def is_output_only(prop: dict) -> bool:
    if prop.get("readOnly"):
        return True
    return str(prop.get("description", "")).lstrip().startswith(_OUTPUT_ONLY_PREFIXES)


class Validator:
    """Validates bodies against one discovery document. Thread-safe; compiled schemas are cached."""

    def __init__(self, doc: dict | str):
        self.doc = load_document(doc) if isinstance(doc, str) else doc
        self.name = f"{self.doc.get('name')}.{self.doc.get('version')}"
        self._schemas: dict[str, dict] = self.doc["schemas"]
        self._compiled: dict[tuple[str, bool], Any] = {}
        self._lock = threading.Lock()

    def check_request(self, schema_name: str, body: Any) -> list[str]:
        """Violations of `body` as a request of type `schema_name` (output-only fields forbidden)."""
        return self._check(schema_name, body, request=True)

    def check_response(self, schema_name: str, body: Any) -> list[str]:
        """Violations of `body` as a response of type `schema_name`."""
        return self._check(schema_name, body, request=False)

    def _check(self, schema_name: str, body: Any, *, request: bool) -> list[str]:
        validate = self._validator(schema_name, request)
        try:
            validate(body)
        except fastjsonschema.JsonSchemaValueException as exc:
            return [_describe(exc, schema_name)]
        return []

    def prune(self, schema_name: str, body: Any, sibling: Validator) -> Any:
        """`body` as a client of this API version sees it when the resource was made through `sibling` (another
        version of the API, e.g. a v2alpha1 flex-start queued resource read through v2): fields `sibling`
        declares and this version does not are left out. Fields neither declares stay, so strict mode still
        reports them."""
        return self._prune(self._schemas[schema_name], sibling._schemas.get(schema_name) or {}, sibling, body)

    def _prune(self, node: dict, other: dict, sibling: Validator, body: Any) -> Any:
        if "$ref" in node:
            return self._prune(self._schemas[node["$ref"]], other, sibling, body)
        if "$ref" in other:
            return self._prune(node, sibling._schemas.get(other["$ref"]) or {}, sibling, body)
        if isinstance(body, dict) and node.get("properties"):
            props, theirs = node["properties"], other.get("properties") or {}
            return {k: self._prune(props[k], theirs.get(k) or {}, sibling, v) if k in props else v
                    for k, v in body.items() if k in props or k not in theirs}
        if isinstance(body, list) and node.get("type") == "array":
            return [self._prune(node.get("items") or {}, other.get("items") or {}, sibling, v) for v in body]
        return body

    def _validator(self, schema_name: str, request: bool):
        key = (schema_name, request)
        with self._lock:
            fn = self._compiled.get(key)
            if fn is None:
                if schema_name not in self._schemas:
                    raise KeyError(f"{self.name} has no schema {schema_name!r}")
                fn = fastjsonschema.compile(self.json_schema(schema_name, request=request))
                self._compiled[key] = fn
            return fn

    def json_schema(self, schema_name: str, *, request: bool) -> dict:
        """JSON Schema for `schema_name` with only the definitions it reaches."""
        defs: dict[str, dict] = {}
        pending = [schema_name]
        while pending:
            name = pending.pop()
            if name in defs:
                continue
            refs: set[str] = set()
            defs[name] = self._convert(self._schemas[name], request, refs)
            pending.extend(refs - defs.keys())
        return {"$ref": f"#/$defs/{schema_name}", "$defs": defs}

    def _convert(self, node: dict, request: bool, refs: set[str]) -> dict:
        if "$ref" in node:
            refs.add(node["$ref"])
            return {"$ref": f"#/$defs/{node['$ref']}"}
        kind = node.get("type")
        if kind == "object" or "properties" in node:
            out: dict[str, Any] = {"type": "object"}
            props = node.get("properties") or {}
            if props:
                out["properties"] = {}
                for pname, pnode in props.items():
                    if request and is_output_only(pnode):
                        # `not: {}` rejects any value; _describe turns it into a readable message.
                        out["properties"][pname] = {"not": {}}
                    else:
                        out["properties"][pname] = self._convert(pnode, request, refs)
            if "additionalProperties" in node:
                out["additionalProperties"] = self._convert(node["additionalProperties"], request, refs)
            elif props:
                out["additionalProperties"] = False
            return out
        if kind == "array":
            return {"type": "array", "items": self._convert(node.get("items") or {}, request, refs)}
        if kind == "string":
            if "enum" in node:
                return {"type": "string", "enum": list(node["enum"])}
            if node.get("format") in _INT64_FORMATS:
                digits = {"type": "string", "pattern": r"^-?[0-9]+$"}
                # Google's JSON parsers accept an int64 as a number too (proto3 JSON mapping), and
                # google-cloud-storage sends softDeletePolicy.retentionDurationSeconds that way; responses
                # always carry strings.
                return {"anyOf": [digits, {"type": "integer"}]} if request else digits
            return {"type": "string"}
        if kind == "integer":
            return {"type": "integer"}
        if kind == "number":
            return {"type": "number"}
        if kind == "boolean":
            return {"type": "boolean"}
        return {}  # "any"


_PROPS_RE = re.compile(r"must not contain \{(.*)\} properties")


def _describe(exc: fastjsonschema.JsonSchemaValueException, schema_name: str) -> str:
    path = (exc.name or "data").replace("data", schema_name[:1].lower() + schema_name[1:], 1)
    if exc.rule == "not":
        return f"{path}: output-only field is not allowed in a request"
    if exc.rule == "additionalProperties":
        m = _PROPS_RE.search(exc.message)
        names = m.group(1).replace("'", "") if m else "?"
        return f"{path}: unknown field(s) {names}"
    message = exc.message.replace(exc.name or "data", "value", 1) if exc.name else exc.message
    return f"{path}: {message}"


@functools.lru_cache(maxsize=None)
def validator(doc_name: str) -> Validator:
    """The shared, cached Validator for a discovery document name ("storage.v1", ...)."""
    return Validator(doc_name)
