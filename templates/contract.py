"""Templates as a contract: what a training template declares, in one typed place, and where templates are found.

A template is a Python package directory. Its `template.json` declares every part the laptop side uses, and
nothing else: `FIELDS` below is its schema, with what each field is (templates/README.md has the same table). A
field the schema does not know, or a required one that is missing, is refused in one line naming it.

Hooks are "MODULE:ATTR" with MODULE inside the template ("config:build"; "PKG.config" also works), imported from
the template (`tpuctl.templates.NAME.MODULE` for a built-in, the directory itself for a user's); any other name
is imported as installed. A directory with a `train.py`
and no `template.json` is a program-only template: entry `NAME.train`, no presets, BERT's data preparation.

At run time the program's duties (templates/README.md, "Writing your own") include, optionally, the save on a
preemption notice: a checkpoint at the next step boundary when the file `TPUCTL_SAVE_REQUEST` names appears
(the worker agent's answer to the metadata server's notice, jobs/agent.py) or SIGTERM comes (the guest's
shutdown, 30 s before a Spot VM's power off).

`jobs/` and the CLI reach templates only through `find()` / `builtins()` and the `Template` they return.
Loading reads files and imports the hooks' modules (light: no TensorFlow); it creates nothing.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import json
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

from tpuctl.errors import BadInput

MANIFEST = "template.json"
# template.json's schema: section -> {field: what it is}; "" is the top level, "presets.NAME" each preset. A field
# in REQUIRED must be declared; the others may be. Every field here is read by load() below.
FIELDS: dict[str, dict[str, str]] = {
    "": {
        "name": "the template's name (default: the directory's)",
        "description": "one line for `tpuctl templates`",
        "entry_module": "the module the workers run (`python -m MODULE --config CONFIG.json`)",
        "presets": "named model shapes, {} for none",
        "config": "the config schema: {\"validate\": \"PKG.config:build\", \"default_preset\": ...}",
        "data": "data preparation (tokenizer, prepare, upload hooks), or null",
        "outputs": "what the program writes: checkpoints, tensorboard, export",
        "progress": "the program's stdout lines tpuctl parses (regexes; default: Progress's)",
        "exporters": "{\"FORMAT\": \"MODULE:ATTR\"}: hooks that turn a run's checkpoint into FORMAT on the laptop",
        "frameworks": "the Keras backends the workers can run: tensorflow (default), jax",
        "framework": "one framework (the older spelling of frameworks)",
        "keras_by_tensorflow": "TF minor version -> the Keras the template is tested with (the agent pins it)",
        "uses": "other built-in packages shipped beside it in the bundle (lmkit: the built-ins' shared code)",
        "fit": "\"MODULE:ATTR\", (config, devices=, vocab_size=) -> dict: the step `tpuctl fit` compiles",
    },
    "presets.NAME": {
        "description": "one line for `tpuctl templates`",
        "task": "the preset's config task section",
        "trainer": "the preset's config trainer section",
    },
    "config": {
        "validate": "\"PKG.config:build\": raises ValueError (.field, .rule) on a bad config",
        "default_preset": "the preset a spec without job.preset gets",
        "parameters": "\"PKG.config:parameter_count\": preset -> weights, for listings",
    },
    "data": {
        "tokenizer": "the tokenizer's kind, for listings",
        "manifest": "the file written last: its presence means prepared",
        "files": "the prepared directory's files (glob patterns)",
        "options": "\"MODULE:ATTR\": the options class prepare takes",
        "prepare": "\"MODULE:ATTR\": (corpus, out_dir, options, storage_client=, progress=) -> manifest",
        "upload": "\"MODULE:ATTR\": (local_dir, url, storage_client=, progress=), idempotent",
        "error": "\"MODULE:ATTR\": the exception prepare and upload raise on bad input",
        "spec_options": "spec job.data field -> options field",
    },
    "outputs": {
        "checkpoints": "where checkpoints go ({model_dir}/...)",
        "tensorboard": "where TensorBoard files go, \"\" for none",
        "export": "the export's place and files ({export_dir}: ...)",
    },
    "progress": {
        "start_line": "regex of the start line, group max_steps (the ETA's target)",
        "step_line": "regex of a step line, group step; optional loss, examples_per_sec, time (the worker's Unix "
                     "time when the step ended: the run's timeline dates steps by it, not by the line's arrival)",
        "checkpoint_line": "regex of a checkpoint line, groups step and path",
        "done_line": "regex of the last line, group step; optional loss",
        "idle_line": "regex of an idle worker's line (a multi-host TensorFlow slice's workers 1..N-1)",
    },
}
REQUIRED: dict[str, tuple[str, ...]] = {
    "": ("entry_module", "presets", "config", "data", "outputs"),
    "config": ("validate",),
    "data": tuple(FIELDS["data"]),
    "outputs": tuple(FIELDS["outputs"]),
}
FIELD = "job.template"


@dataclass(frozen=True)
class Progress:
    """What the program prints that tpuctl parses (the worker's stdout, one event per line), as compiled regexes
    matched at the start of a line. The defaults are the built-ins' shapes with any other fields: a
    program-only template (or a template.json without `progress`) that prints `step=N loss=X ...` is followed."""

    start_line: re.Pattern = re.compile(r"^start\b.*?\bmax_steps=(?P<max_steps>\d+)")
    step_line: re.Pattern = re.compile(
        r"^step=(?P<step>\d+)\b(?:.*?\bloss=(?P<loss>\S+))?(?:.*?\bexamples_per_sec=(?P<examples_per_sec>\S+))?"
        r"(?:.*?\btime=(?P<time>[\d.]+))?")
    checkpoint_line: re.Pattern = re.compile(r"^checkpoint step=(?P<step>\d+) path=(?P<path>\S+)$")
    done_line: re.Pattern = re.compile(r"^done step=(?P<step>\d+)\b(?:.*?\bloss=(?P<loss>\S+))?")
    idle_line: re.Pattern = re.compile(r"^idle worker=(?P<worker>\d+) reason=(?P<reason>\S+)$")

    # The named groups each line must have: what tpuctl reads from it.
    GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {
        "start_line": ("max_steps",), "step_line": ("step",), "checkpoint_line": ("step", "path"),
        "done_line": ("step",), "idle_line": ("worker",)}


@dataclass(frozen=True)
class Outputs:
    """Where the program writes (formats with {model_dir} / {export_dir}; for people and listings)."""

    checkpoints: str
    tensorboard: str
    export: str


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    task: Mapping[str, Any]
    trainer: Mapping[str, Any]


@dataclass(frozen=True)
class DataPrep:
    """How a corpus becomes the template's training data (laptop side; no TensorFlow).

    `prepare(corpus, out_dir, options, storage_client=, progress=)` blocks and returns a manifest with
    `sequences`, `seq_len`, `vocab_size`, `raw_bytes`, `prepared_bytes`; `upload(local_dir, url, storage_client=,
    progress=)` is idempotent; both raise `error` (with `.path` naming the file at fault) on bad input.
    """

    tokenizer: str
    manifest: str
    files: tuple[str, ...]
    options: Callable[..., Any]
    prepare: Callable[..., Any]
    upload: Callable[..., Any]
    error: type[Exception]
    spec_options: Mapping[str, str]

    def make_options(self, **values: Any) -> Any:
        """The options object from spec-level names (`vocab_size`, `seq_len`, ...); a name this template does
        not take is a BadInput naming `job.data.NAME`."""
        unknown = sorted(set(values) - set(self.spec_options))
        if unknown:
            raise BadInput(f"this template's data preparation has no option {unknown[0]!r}",
                           field=f"job.data.{unknown[0]}", hint=f"it takes {', '.join(sorted(self.spec_options))}")
        return self.options(**{self.spec_options[k]: v for k, v in values.items()})


@dataclass(frozen=True)
class RunFiles:
    """A run's files as an exporter reads them: `read(url)` returns the bytes of a file under `model_dir` or
    `data_dir` (gs:// URLs or local paths) and raises FileNotFoundError for a missing one. An exporter raises
    FileNotFoundError (no checkpoint yet) or ValueError (files it cannot export); it imports no TensorFlow."""

    model_dir: str
    data_dir: str
    read: Callable[[str], bytes]


@dataclass(frozen=True)
class Template:
    name: str
    root: Path
    builtin: bool
    entry_module: str
    description: str = ""
    frameworks: tuple[str, ...] = ("tensorflow",)  # what the workers can run (`frameworks`, else `framework`)
    keras_by_tensorflow: Mapping[str, str] = field(default_factory=dict)  # tested TF minor -> Keras pin
    presets: Mapping[str, Preset] = field(default_factory=dict)
    default_preset: str = ""
    validate_config: Callable[[dict], Any] | None = None
    validate_ref: str = ""  # the hook as declared, for hints
    parameter_count: Callable[[str], int] | None = None
    data: DataPrep | None = None
    outputs: Outputs | None = None  # None for a program-only template
    progress: Progress = Progress()
    uses: tuple[Path, ...] = ()  # package directories shipped beside this one
    exporters: Mapping[str, Callable[..., list[str]]] = field(default_factory=dict)  # format -> hook (RunFiles)
    fit_target: Callable[..., dict] | None = None  # template.json `fit`: the step to compile ahead of time

    def exporter(self, fmt: str) -> Callable[..., list[str]]:
        """The hook that writes `fmt`; a format this template does not declare is a BadInput listing those it does."""
        if fmt not in self.exporters:
            known = ", ".join(sorted(self.exporters)) or "none"
            raise BadInput(f"template {self.name} has no {fmt!r} exporter", field="format",
                           hint=f"formats of {self.name}: {known} (template.json `exporters`)")
        return self.exporters[fmt]

    @property
    def package(self) -> str:
        return self.root.name

    def preset(self, name: str | None) -> Preset | None:
        """The named preset (None for none); an unknown name is a BadInput listing the known ones."""
        if not name:
            return None
        if name not in self.presets:
            known = ", ".join(self.presets) or "none"
            raise BadInput(f"template {self.name} has no preset {name!r}", field="job.preset",
                           hint=f"presets of {self.name}: {known} (`tpuctl templates`)")
        return self.presets[name]

    def check_config(self, config: Mapping) -> None:
        """The template's own config check on a resolved job config, before anything is created. Raises
        BadInput naming `job.config.FIELD` (the template's ConfigError carries `field` and `rule`)."""
        if self.validate_config is None:
            return
        try:
            self.validate_config(json.loads(json.dumps(dict(config))))
        except ValueError as exc:
            field = getattr(exc, "field", None)
            if field is None:
                raise BadInput(str(exc), field="job.config") from exc
            raise BadInput(getattr(exc, "rule", str(exc)), field=f"job.config.{field}" if field else "job.config",
                           hint=f"see the {self.name} template's config schema ({self.validate_ref})") from exc


def _bad(root: Path, what: str, hint: str = "") -> BadInput:
    return BadInput(f"template {root.name} ({root}): {what}", field=FIELD,
                    hint=hint or "see templates/README.md for the parts a template declares")


def _import(root: Path, builtin: bool, module: str):
    first, _, rest = module.partition(".")
    if first == root.name:  # "PKG.mod": the template's own, spelled with its package name
        module = rest
    elif not ((root / f"{first}.py").is_file() or (root / first / "__init__.py").is_file()):
        return importlib.import_module(module)  # an installed module, e.g. tpuctl.templates.bert.prepare
    if builtin:
        return importlib.import_module(f"tpuctl.templates.{root.name}.{module}")
    # A user's directory: imported under a private alias (per path) so it cannot shadow, or be shadowed by, a
    # built-in or another directory of the same name.
    alias = f"_tpuctl_template_{root.name}_{hashlib.sha256(str(root).encode()).hexdigest()[:8]}"
    if alias not in sys.modules:
        if not (root / "__init__.py").is_file():
            raise _bad(root, "has no __init__.py", "a template is a Python package")
        spec = importlib.util.spec_from_file_location(alias, root / "__init__.py", submodule_search_locations=[str(root)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[alias] = mod
        spec.loader.exec_module(mod)
    return importlib.import_module(f"{alias}.{module}" if module else alias)


def _hook(root: Path, builtin: bool, ref: Any, part: str):
    if not isinstance(ref, str) or ":" not in ref:
        raise _bad(root, f"{part} must be \"MODULE:ATTR\", got {ref!r}")
    module, _, attr = ref.partition(":")
    try:
        obj = getattr(_import(root, builtin, module), attr)
    except (ImportError, AttributeError) as exc:
        raise _bad(root, f"{part} {ref!r} cannot be loaded ({exc})") from exc
    return obj


def load(root: Path, *, builtin: bool = False) -> Template:
    """The contract of the template in directory `root`. Raises BadInput naming the missing or broken part."""
    root = Path(root).resolve()
    builtin = builtin or root.parent == builtin_root().resolve()
    if not root.name.isidentifier():
        raise BadInput(f"template directory name {root.name!r} is not a Python package name", field=FIELD,
                       hint="rename the directory to letters, digits and underscores")
    meta_path = root / MANIFEST
    if not meta_path.is_file():
        if not (root / "train.py").is_file() and not (root / "train").is_dir():
            raise _bad(root, f"has neither {MANIFEST} nor train.py",
                       "a template is a Python package run as `python -m NAME.train --config CONFIG.json`")
        # Its corpus, if the spec gives one, is prepared the way tpuctl always has: as BERT's.
        return Template(name=root.name, root=root, builtin=builtin, entry_module=f"{root.name}.train",
                        data=load(builtin_root() / "bert", builtin=True).data)
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise _bad(root, f"{MANIFEST} is not JSON ({exc})") from exc
    meta = _fields(root, "", meta)
    _check_entry(root, meta["entry_module"])
    presets = {}
    for name, p in _object(root, "presets", meta["presets"]).items():
        p = _fields(root, "presets.NAME", p, where=f"presets.{name}")
        presets[name] = Preset(name=name, description=p.get("description", ""), task=p.get("task", {}),
                               trainer=p.get("trainer", {}))
    config = _fields(root, "config", meta["config"])
    default_preset = config.get("default_preset", "")
    if default_preset and default_preset not in presets:
        raise _bad(root, f"config.default_preset {default_preset!r} is not one of its presets")
    data = None
    if meta["data"] is not None:
        d = _fields(root, "data", meta["data"])
        data = DataPrep(tokenizer=d["tokenizer"], manifest=d["manifest"], files=tuple(d["files"]),
                        options=_hook(root, builtin, d["options"], "data.options"),
                        prepare=_hook(root, builtin, d["prepare"], "data.prepare"),
                        upload=_hook(root, builtin, d["upload"], "data.upload"),
                        error=_hook(root, builtin, d["error"], "data.error"), spec_options=dict(d["spec_options"]))
    uses = []
    for name in meta.get("uses", []):
        used = builtin_root() / name
        if not (used / "__init__.py").is_file():
            raise _bad(root, f"uses {name!r}, which is not a built-in template package")
        uses.append(used)
    return Template(
        name=meta.get("name", root.name), root=root, builtin=builtin, entry_module=meta["entry_module"],
        description=meta.get("description", ""), frameworks=tuple(meta.get("frameworks") or [meta.get("framework") or "tensorflow"]),
        keras_by_tensorflow=dict(meta.get("keras_by_tensorflow") or {}), presets=presets, default_preset=default_preset,
        validate_config=_hook(root, builtin, config["validate"], "config.validate"), validate_ref=config["validate"],
        parameter_count=(_hook(root, builtin, config["parameters"], "config.parameters")
                         if "parameters" in config else None),
        data=data, outputs=Outputs(**_fields(root, "outputs", meta["outputs"])),
        progress=_progress(root, meta.get("progress")), uses=tuple(uses),
        exporters={fmt: _hook(root, builtin, ref, f"exporters.{fmt}")
                   for fmt, ref in _object(root, "exporters", meta.get("exporters") or {}).items()},
        fit_target=_hook(root, builtin, meta["fit"], "fit") if meta.get("fit") else None)


def _object(root: Path, where: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise _bad(root, f"{MANIFEST} {where} must be a JSON object, got {type(value).__name__}")
    return value


def _fields(root: Path, section: str, value: Any, *, where: str | None = None) -> dict:
    """`value`, the `section` of template.json, checked against FIELDS: an unknown field (a typo, or one this
    tpuctl does not read) and a missing required one are refused, each naming the field."""
    where = section if where is None else where
    value = _object(root, where or "top level", value)
    known = FIELDS[section]
    prefix = f"{where}." if where else ""
    for name in value:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            raise _bad(root, f"{MANIFEST} has an unknown field {prefix + name!r}"
                             + (f" (did you mean {prefix + close[0]!r}?)" if close else ""),
                       f"remove it; the fields of {where or 'the top level'} are {', '.join(known)} "
                       "(templates/README.md)")
    for name in REQUIRED.get(section, ()):
        if name not in value:
            raise _bad(root, f"{MANIFEST} {where + ' ' if where else ''}does not declare {name!r}: {known[name]}")
    return value


def _progress(root: Path, value: Any) -> Progress:
    """template.json `progress` compiled; a field left out keeps Progress's default."""
    if value is None:
        return Progress()
    patterns = {}
    for name, text in _fields(root, "progress", value).items():
        try:
            patterns[name] = re.compile(text)
        except (re.error, TypeError) as exc:
            raise _bad(root, f"{MANIFEST} progress.{name} is not a regular expression ({exc})") from exc
        lacking = [g for g in Progress.GROUPS[name] if g not in patterns[name].groupindex]
        if lacking:
            raise _bad(root, f"{MANIFEST} progress.{name} has no named group {lacking[0]!r}",
                       f"capture it as (?P<{lacking[0]}>...)")
    return Progress(**patterns)


def _check_entry(root: Path, entry: Any) -> None:
    """The workers run `python -m ENTRY` from the bundle, which holds this package: ENTRY must be one of its
    modules, there now, not a name that fails on a TPU after it was paid for."""
    first, _, rest = str(entry).partition(".")
    module = root.joinpath(*rest.split(".")) if rest else root / "__main__"
    if not isinstance(entry, str) or first != root.name:
        raise _bad(root, f"entry_module {entry!r} is not a module of the package {root.name}",
                   f"name the program {root.name}.MODULE (run as `python -m {root.name}.MODULE --config CONFIG.json`)")
    if not module.with_suffix(".py").is_file() and not (module / "__main__.py").is_file():
        where = module.relative_to(root.parent)
        raise _bad(root, f"entry_module {entry!r} has no {where}.py (nor {where}/__main__.py)",
                   "add that module or name the one the workers should run")


def builtin_root() -> Path:
    return Path(str(resources.files("tpuctl.templates")))


def builtins() -> list[Template]:
    """Every template shipped with tpuctl (a package directory under templates/ with a template.json)."""
    return [load(p, builtin=True) for p in sorted(builtin_root().iterdir())
            if p.is_dir() and (p / MANIFEST).is_file()]


def find(template: str, *, base_dir: Path | None = None) -> Template:
    """A template by name or directory. A directory relative to `base_dir` (the spec's) wins over a built-in of
    the same name; a value with a `/` is only ever looked for as a directory. Raises BadInput."""
    given = Path(template).expanduser()
    local = (base_dir / given) if base_dir is not None and not given.is_absolute() else given
    if local.is_dir():
        return load(local)
    builtin = builtin_root() / template
    if "/" in template or not (builtin / MANIFEST).is_file():
        names = ", ".join(t.name for t in builtins())
        raise BadInput(f"no template {template!r}", field=FIELD,
                       hint=f"use one of {names} or a local directory holding a train.py")
    return load(builtin, builtin=True)
