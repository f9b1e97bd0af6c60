"""Templates as a contract: template.json declares every part; jobs/ and the CLI reach templates only through it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from tpuctl.cli import cli
from tpuctl.errors import BadInput
from tpuctl.templates import contract

from test_data_prepare import console_err  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[1]
BERT = ROOT / "templates" / "bert"


def copy_template(tmp_path: Path, name: str = "mine") -> Path:
    dest = tmp_path / name
    shutil.copytree(BERT, dest, ignore=shutil.ignore_patterns("__pycache__"))
    meta = json.loads((dest / "template.json").read_text())
    # The copy's hooks point into itself (its own package name), not into the built-in bert.
    text = json.dumps(meta).replace('"bert.', f'"{name}.').replace("tpuctl.templates.bert.", f"{name}.")
    (dest / "template.json").write_text(text)
    return dest


def test_builtins_declare_every_part():
    found = {t.name: t for t in contract.builtins()}
    assert {"bert", "gpt2"} <= set(found)
    for t in found.values():
        assert t.entry_module == f"{t.name}.train" and t.presets and t.default_preset in t.presets
        assert t.validate_config is not None and t.data is not None and t.outputs.checkpoints
        assert t.data.manifest == "manifest.json" and callable(t.data.prepare) and callable(t.data.upload)
    assert found["bert"].data.tokenizer == "wordpiece" and found["gpt2"].data.tokenizer == "byte-bpe"
    assert [p.name for p in found["gpt2"].uses] == ["lmkit"]
    assert [p.name for p in found["bert"].uses] == ["lmkit"]


@pytest.mark.parametrize("name", ["bert", "gpt2", "mine"])
def test_a_bundle_ships_the_template_and_lmkit_only_and_its_program_imports_from_them(tmp_path, name):
    """Neither built-in imports the other: each gets what they share from lmkit, as a user's template begun as a
    copy of bert (`mine`) does."""
    import subprocess
    import sys
    import tarfile

    from tpuctl.jobs import bundle

    template = contract.find(str(copy_template(tmp_path / "src", name)) if name == "mine" else name)
    job = bundle.JobDescription(run="b", project="p", bucket="b", module=template.entry_module, config={})
    with tarfile.open(bundle.build(template.root, job, tmp_path, packages=template.uses).path) as tar:
        assert {m.name.split("/")[0] for m in tar.getmembers()} == {"job.json", "tpuctl_agent", name, "lmkit"}
        tar.extractall(tmp_path / "bundle", filter="data")
    # As a worker runs it (the bundle's root on the path, no TensorFlow needed to load the program): the light
    # modules load, every template module from the bundle, lmkit's too, none from the installed tpuctl.
    probe = (f"import sys; sys.path.insert(0, '.'); "
             f"import {name}.config, {name}.train, {name}.prepare, {name}.export; "
             f"{name}.config.build({{'preset': '{template.default_preset}'}}); "
             f"import json; print(json.dumps([m for m in sys.modules if m.split('.')[0] in ('{name}', 'bert', 'gpt2', "
             "'lmkit') or m.startswith('tpuctl.templates')]))")
    r = subprocess.run([sys.executable, "-I", "-c", probe], cwd=tmp_path / "bundle", capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    loaded = json.loads(r.stdout.strip().splitlines()[-1])
    assert {m.split(".")[0] for m in loaded} == {name, "lmkit"}, loaded  # not tpuctl's, nor the other template
    assert {"lmkit.trainer", "lmkit.config", "lmkit.prepare", "lmkit.hf_export"} <= set(loaded), loaded


@pytest.mark.parametrize("part", sorted(contract.REQUIRED[""]))
def test_a_template_missing_a_part_fails_naming_it(tmp_path, part):
    root = copy_template(tmp_path)
    meta = json.loads((root / "template.json").read_text())
    del meta[part]
    (root / "template.json").write_text(json.dumps(meta))
    with pytest.raises(BadInput) as e:
        contract.find(str(root))
    assert e.value.field == "job.template" and f"does not declare {part!r}" in str(e.value)


@pytest.mark.parametrize("part", ["prepare", "tokenizer", "error"])
def test_a_template_missing_a_data_hook_fails_naming_it(tmp_path, part):
    root = copy_template(tmp_path)
    meta = json.loads((root / "template.json").read_text())
    del meta["data"][part]
    (root / "template.json").write_text(json.dumps(meta))
    with pytest.raises(BadInput, match=f"data does not declare {part!r}"):
        contract.find(str(root))


@pytest.mark.parametrize("section, field", [("", "argv"), ("", "pod_slices"), ("config", "paths"),
                                            ("data", "prepard"), ("outputs", "logs"), ("progress", "step"),
                                            ("presets.bert-tiny", "layers")])
def test_an_unknown_field_is_one_line_naming_it(tmp_path, section, field):
    """template.json holds only what tpuctl reads: a field it does not know (a typo, or a part no code reads)
    is refused, not silently ignored."""
    root = copy_template(tmp_path)
    meta = json.loads((root / "template.json").read_text())
    target = meta
    for key in filter(None, section.split(".", 1)):
        target = target[key]
    target[field] = "x"
    (root / "template.json").write_text(json.dumps(meta))
    with pytest.raises(BadInput) as e:
        contract.find(str(root))
    name = f"{section}.{field}" if section else field
    assert e.value.field == "job.template" and f"unknown field {name!r}" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("field", ["progress.step_line", "outputs.export", "config.validate"])
def test_a_missing_or_bad_field_is_one_line_naming_it(tmp_path, field):
    root = copy_template(tmp_path)
    meta = json.loads((root / "template.json").read_text())
    section, name = field.split(".")
    if section == "progress":  # optional, but a regex without the group tpuctl reads is refused
        meta[section][name] = "^step=\\d+"
    else:
        del meta[section][name]
    (root / "template.json").write_text(json.dumps(meta))
    with pytest.raises(BadInput) as e:
        contract.find(str(root))
    assert e.value.field == "job.template" and field.split(".")[1] in str(e.value) and "\n" not in str(e.value)


def test_every_field_is_documented_in_the_readme():
    readme = (ROOT / "templates" / "README.md").read_text()
    for section, fields in contract.FIELDS.items():
        for name in fields:
            assert f"`{name}`" in readme, f"{section}.{name}"


def test_progress_lines_follow_the_template(tmp_path):
    """The run's progress (step, loss, ETA target) comes from the template's own line formats, and a worker line
    another template would take for a step is only a log line here."""
    from tpuctl.jobs.pipeline import Outcome, _Stream

    root = copy_template(tmp_path)
    meta = json.loads((root / "template.json").read_text())
    meta["progress"] = {"start_line": "^begin total=(?P<max_steps>\\d+)$",
                        "step_line": "^it (?P<step>\\d+): (?P<loss>\\S+)$", "done_line": "^finished (?P<step>\\d+)$"}
    (root / "template.json").write_text(json.dumps(meta))
    events = []
    stream = _Stream(Outcome(run="lines"), events.append, contract.find(str(root)).progress)
    for line in ("begin total=40", "step=99 loss=0.1", "it 12: 0.75", "finished 40"):
        stream(0, line)
    metrics = [(e.step, e.loss, e.max_steps) for e in events if type(e).__name__ == "Metrics"]
    assert metrics == [(12, 0.75, 40), (40, None, 40)]
    assert (stream.outcome.step, stream.outcome.loss) == (40, 0.75)


def test_a_hook_that_does_not_load_is_named(tmp_path):
    root = copy_template(tmp_path)
    meta = json.loads((root / "template.json").read_text())
    meta["data"]["prepare"] = "mine.prepare:no_such_function"
    (root / "template.json").write_text(json.dumps(meta))
    with pytest.raises(BadInput, match=r"data.prepare 'mine.prepare:no_such_function' cannot be loaded"):
        contract.find(str(root))


def test_a_user_template_loads_its_own_hooks_not_the_builtin(tmp_path):
    t = contract.find("mine", base_dir=copy_template(tmp_path).parent)
    assert not t.builtin and t.entry_module == "mine.train"
    assert t.data.prepare.__module__.startswith("_tpuctl_template_mine_") and t.data.prepare.__module__.endswith(".prepare")
    assert t.validate_config({"preset": "bert-tiny"}).task.hidden_size == 128


def test_unknown_preset_and_bad_config_are_bad_input():
    bert = contract.find("bert")
    with pytest.raises(BadInput) as e:
        bert.preset("gpt2-tiny")
    assert e.value.field == "job.preset" and "bert-tiny" in e.value.hint
    with pytest.raises(BadInput, match="per_replica_batch_size") as e:
        bert.check_config({"preset": "bert-tiny", "trainer": {"per_replica_batch_size": 12}})
    assert e.value.field == "job.config.trainer.per_replica_batch_size"


def test_no_module_of_jobs_or_the_cli_imports_a_template_by_name():
    pattern = re.compile(r"^\s*(from|import)\s+tpuctl\.templates\.(?!contract\b)\w+", re.M)
    offenders = [str(p.relative_to(ROOT)) for d in ("jobs", "tpuctl") for p in (ROOT / d).rglob("*.py")
                 if pattern.search(p.read_text())]
    assert offenders == []


def test_templates_command_lists_presets_with_sizes():
    result = CliRunner().invoke(cli, ["templates", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["preset"]: r for r in json.loads(result.output)}
    assert 4e6 < rows["bert-tiny"]["parameters"] < 5e6 and 105e6 < rows["bert-base"]["parameters"] < 115e6
    # GPT-2 small is the 124M model (tied embeddings, 50257 tokens, 1024 positions).
    assert rows["gpt2-small"]["parameters"] == 124_439_808
    assert rows["gpt2-tiny"]["seq_len"] == 128 and rows["gpt2-small"]["seq_len"] == 1024


def test_data_prepare_refuses_a_flag_the_template_does_not_take(tmp_path, console_err):
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world\n" * 50)
    result = CliRunner().invoke(cli, ["data", "prepare", str(corpus), "--out", str(tmp_path / "o"),
                                      "--template", "gpt2", "--cased"])
    err = console_err.getvalue()
    assert result.exit_code == 2 and "--lowercase" in err and "has no option lowercase" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("template, seq_len, sample_mib, shard_sequences",
                         [("bert", 128, 64, 65536), ("gpt2", 16, 32, 16384)])
def test_data_prepare_flags_left_out_keep_the_templates_own_defaults(tmp_path, template, seq_len, sample_mib,
                                                                    shard_sequences):
    """A flag not given must not override the template's default (the CLI once forced 64 MiB and 65536 on gpt2)."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n\n" * 400)
    out = tmp_path / "o"
    result = CliRunner().invoke(cli, ["data", "prepare", str(corpus), "--out", str(out), "--template", template,
                                      "--vocab-size", "300", "--seq-len", str(seq_len)])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer"]["sample_bytes"] == sample_mib << 20
    options = contract.find(template).data.options()
    assert options.tokenizer_sample_bytes == sample_mib << 20 and options.shard_sequences == shard_sequences
