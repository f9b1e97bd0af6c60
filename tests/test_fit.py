"""`tpuctl fit` and the fit check of `run`/`up`: the template's own step compiled by the TPU compiler (libtpu,
the `tpu` extra) for slices that are not there, cached; refused before anything exists when it cannot fit;
an analytic estimate, one line and no traceback, without the compiler."""

from __future__ import annotations

import importlib.metadata
import io
import importlib.util
import inspect
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import tpuctl
from tpuctl import fitting
from tpuctl import spec as spec_mod
from tpuctl.errors import BadInput, TpuctlError

from conftest import on_jax, on_jax_each
from conftest import tpuctl as tpuctl_cli

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
needs_compiler = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                    reason="the TPU compiler (libtpu, `pip install 'tpuctl[tpu]'`) is not installed")
JSON_KEYS = {"fits", "hbm_per_chip_bytes", "hbm_capacity_bytes", "max_per_chip_batch", "model_flops_per_step",
             "compiled_flops_per_step", "bytes_accessed_per_step", "est_step_s", "est_mfu", "est_run_s",
             "est_cost_usd", "topology", "jax", "libtpu"}


def test_the_benchs_ablations_each_take_their_part_out_of_todays_templates(monkeypatch, tmp_path):
    # bench/tpu_compile.py --ablate applies diffs to a copy of the templates: one that no longer applies (or no
    # longer changes anything) would leave RESULTS' "where the bytes go" unreproducible without saying so.
    spec = importlib.util.spec_from_file_location("tpu_compile", EXAMPLES.parent / "bench" / "tpu_compile.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "CACHE", tmp_path / "cache" / "tpu_compile")
    templates = EXAMPLES.parent / "templates"
    names = sorted(p.stem for p in bench.ABLATIONS.glob("*.patch"))
    assert names == ["adamw", "attention", "ffn", "norms", "splash"]
    for name in names:
        ablated = Path(bench.ablated_templates(str(templates), name))
        changed = [f.relative_to(ablated) for f in ablated.rglob("*.py")
                   if f.read_bytes() != (templates / f.relative_to(ablated)).read_bytes()]
        assert len(changed) == 1, (name, changed)
    with pytest.raises(SystemExit, match="no .*nothing.patch; there are: adamw, attention"):
        bench.ablated_templates(str(templates), "nothing")


def test_without_the_compiler_an_analytic_estimate_and_one_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "libtpu", None)  # `import libtpu` raises ImportError, as where it is absent
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path))
    notes = []
    r = tpuctl.fit(EXAMPLES / "gpt2-tiny.yaml", accelerator="v5litepod-4", on_event=notes.append)
    assert r.method == "analytic" and r.fits and r.libtpu is None and r.compiled_flops_per_step is None
    assert r.compiler_cycles_per_step is None
    assert r.topology == "v5e:2x2" and r.hbm_capacity_bytes == 16 * 10**9 and r.per_chip_batch == 16
    assert 0 < r.hbm_per_chip_bytes < r.hbm_capacity_bytes and r.max_per_chip_batch > r.per_chip_batch
    assert r.model_flops_per_step > 6 * r.params * 16 * 128 and r.est_step_s > 0 and 0 < r.est_mfu <= 1
    assert r.est_run_s == pytest.approx(100 * r.est_step_s)  # the example's max_steps
    assert r.est_cost_usd == pytest.approx(r.est_run_s / 3600 * r.price_per_hour) and r.price_per_hour > 0
    assert notes == [] and r.not_compiled == f"the TPU compiler is not installed ({fitting.INSTALL_HINT})"
    assert fitting.note(r).message.startswith("fit: ") and fitting.INSTALL_HINT in fitting.note(r).message
    from tpuctl.cli import cli

    out = CliRunner().invoke(cli, ["fit", str(EXAMPLES / "gpt2-tiny.yaml"), "--json"])
    assert out.exit_code == 0 and out.exception is None, out.output
    data = json.loads(out.stdout)
    assert JSON_KEYS <= set(data) and data["method"] == "analytic" and data["libtpu"] is None
    assert data["topology"] == "v3:2x2" and data["hbm_capacity_bytes"] == 32 * 2**30  # the spec's v3-8
    from rich.console import Console

    from tpuctl import console

    shown_buf = io.StringIO()  # the console holds its own streams, bound when it was imported
    for stream in ("out", "err"):
        monkeypatch.setattr(console, stream, Console(file=shown_buf, width=1000, no_color=True))
    human = CliRunner().invoke(cli, ["fit", str(EXAMPLES / "gpt2-tiny.yaml"), "--accelerator", "v6e-4"])
    shown = human.output + shown_buf.getvalue()
    assert human.exit_code == 0 and "Traceback" not in shown and "v6e-4 (4 chips, topology v6e:2x2)" in shown
    assert f"analytic estimate (the TPU compiler is not installed ({fitting.INSTALL_HINT}))" in shown
    assert re.search(r"compiler's cycles / step +│? *- ", shown), shown  # no compiler, no estimate of its own
    big = tmp_path / "big.yaml"  # over the HBM by the estimate: the check says so, and passes it (it errs high)
    big.write_text("accelerator: v5litepod-4\njob: {template: gpt2, preset: gpt2-small, "
                   "config: {trainer: {per_replica_batch_size: 512}}}\n")
    over = fitting.check(spec_mod.from_mapping(spec_mod.read_file(big)), spec_dir=tmp_path)
    assert not over.fits and "over the chip's HBM by this deliberately high estimate, not enforced" in (
        fitting.note(over).message)


# bert-tiny: 2 layers 128 wide (feed-forward 512), a vocabulary of 8000, 20 predicted positions of 128.
BERT_TINY_EVERY_TOKEN = 2 * (4 * 128 * 128 + 2 * 128 * 512 + 9 * 128 + 512) + 2 * 128  # layers, embedding norm
BERT_TINY_HEAD = 128 * 128 + 3 * 128 + 8000  # the MLM transform, its norm, the tied decoder's bias
BERT_TINY_FLOP_PARAMS = BERT_TINY_EVERY_TOKEN + (BERT_TINY_HEAD + 8000 * 128) * 20 / 128


def test_a_masked_lms_model_flops_count_its_head_on_the_predicted_positions_only(monkeypatch, tmp_path):
    # 6·N·tokens with N every weight counted bert-tiny's head (its tied 8000 x 128 decoder: 70% of the weights)
    # over all 128 positions, where it runs on 20: an estimated MFU of 98% on a v2-8.
    monkeypatch.setitem(sys.modules, "libtpu", None)
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path))
    r = tpuctl.fit(EXAMPLES / "bert-tiny.yaml", accelerator="v2-8")
    assert r.params == 8000 * 128 + 128 * 128 + BERT_TINY_EVERY_TOKEN + BERT_TINY_HEAD == 1_461_952  # as compiled
    assert r.flop_params == int(BERT_TINY_FLOP_PARAMS)
    tokens = r.per_chip_batch * 128
    assert r.model_flops_per_step == pytest.approx((6 * BERT_TINY_FLOP_PARAMS + 12 * 2 * 128 * 128) * tokens)
    assert r.est_mfu < 0.5
    gpt2 = tpuctl.fit(EXAMPLES / "gpt2-tiny.yaml", accelerator="v2-8")  # a causal LM's tied head runs on every token
    assert gpt2.flop_params == gpt2.params


def masked_lm_flop_params() -> str:
    """(In a fresh JAX interpreter.) BERT's objective counts the weights a matmul applies per token from its
    model's variables as the analytic estimate does from the config: the head on the predicted positions only."""
    import keras

    from tpuctl.templates.bert import train

    cfg = train.MASKED_LM.config.build({"preset": "bert-tiny"})
    keras.config.set_dtype_policy("float32")
    trainer, _ = train.MASKED_LM.trainer(train.MASKED_LM.build_model(cfg.task, 8000))
    got = train.MASKED_LM.flop_params(trainer, cfg.task)
    assert got == pytest.approx(BERT_TINY_FLOP_PARAMS), (got, BERT_TINY_FLOP_PARAMS)
    return "jax"


def test_largest_batch_search_stays_within_its_compiles():
    """Memory = 1 GB of state + 10 MB a batch example, 2 GB available: 96 fits, 104 does not. The compiler
    accepts up to 2.1 GB (it compiles somewhat past a chip's published HBM) and refuses beyond."""
    compiled = []

    def measure(b):
        compiled.append(b)
        need = 1e9 + 1e7 * b
        return need, need <= 2.1e9

    assert fitting._largest(measure, 16, 2e9, 1e9, 0, grow=False) == (16, "at least")
    assert fitting._largest(measure, 64, 2e9, 1e9, 0, grow=True) == (96, "predicted")
    assert fitting._largest(measure, 16, 2e9, 1e9, 0, grow=True) == (16, "at least")  # 96 > 4 x 16: not a guess
    compiled.clear()  # 104 compiles but needs 2.04 GB: it does not fit, so 96 is the answer, checked both ways
    assert fitting._largest(measure, 16, 2e9, 1e9, 3, grow=True) == (96, "compiled")
    assert compiled == [16, 64, 96, 104]
    compiled.clear()  # one compile short of checking 104: 96 fits, and nothing says more does not
    assert fitting._largest(measure, 16, 2e9, 1e9, 2, grow=True) == (96, "at least") and compiled == [16, 64, 96]
    compiled.clear()
    assert fitting._largest(measure, 512, 2e9, 1e9, 2, grow=True) == (96, "compiled")
    assert compiled == [512, 96, 104]  # the line through the refused point meets the capacity at 96


def test_largest_batch_search_goes_past_the_compilers_own_remat_to_its_refusal():
    """As the TPU compiler does near a chip's HBM (bert-base keras-hub on a v5e: 15.75 GB at 416 a chip, 15.71
    at 512, 15.88 at 640): memory grows 10 MB an example to 95, then 0.1 MB (the compiler recomputes instead of
    keeping) until it refuses past 200. 1 GB of state, 2 GB available."""
    compiled = []

    def measure(b):
        compiled.append(b)
        if b > 200:
            return 1e9 + 1e7 * b, False
        return 1e9 + min(1e7 * b, 0.95e9 + 1e5 * (b - 95)), True

    assert fitting._largest(measure, 32, 2e9, 1e9, 8, grow=True) == (200, "compiled")
    assert compiled == [32, 96, 104, 120, 152, 216, 184, 200, 208]  # the line, a check, a gallop, halving


def test_remat_is_tried_only_for_a_batch_within_reach():
    """1 GB of state, 16 GB available; a policy's bytes are what `measure` says."""
    tried = []

    def measure(policy):
        tried.append(policy)
        need = {"minimal_with_context": 17e9, "minimal": 12e9}[policy]
        return need, need <= 16e9

    assert fitting._first_remat(measure, ["minimal_with_context", "minimal"], 30e9, 1e9, 16e9) == ("minimal", 12e9)
    assert tried == ["minimal_with_context", "minimal"]  # least recomputation first
    tried.clear()  # 60 GB of activations against 15 GB of room: no policy recomputes 4x of it away
    assert fitting._first_remat(measure, ["minimal_with_context", "minimal"], 61e9, 1e9, 16e9) is None and not tried


def test_a_remat_policy_is_one_of_the_templates_and_needs_jax():
    from tpuctl.templates.gpt2 import config

    jax = {"preset": "gpt2-tiny", "runtime": {"framework": "jax"}}
    assert config.build({**jax, "trainer": {"remat_policy": "minimal"}}).trainer.remat_policy == "minimal"
    with pytest.raises(config.ConfigError) as bad:
        config.build({**jax, "trainer": {"remat_policy": "everything"}})
    assert bad.value.field == "trainer.remat_policy" and "none, minimal_with_context, minimal" in bad.value.rule
    with pytest.raises(config.ConfigError, match="needs runtime.framework jax"):
        config.build({"preset": "gpt2-tiny", "trainer": {"remat_policy": "minimal"}})  # TensorFlow by default


def remat_trains_the_same() -> str:
    """(In a fresh JAX interpreter, on the CPU.) A tiny GPT-2 with dropout 0.1 trains to the same losses and
    weights under each remat policy as without: remat recomputes (dropout masks included: they are a hash of
    the seed), it changes no value; and "full" and "save_residuals" keep what they say."""
    import keras
    import numpy as np

    from tpuctl.templates.gpt2 import config
    from tpuctl.templates.gpt2.model import CausalLMTrainer, TokenLoss, build_model
    from tpuctl.templates.lmkit import layers

    task = config.with_overrides(config.build({"preset": "gpt2-tiny"}), task={
        "seq_len": 16, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64,
        "dropout": 0.1}).task
    ids = np.random.default_rng(3).integers(0, 50, size=(8, 16)).astype("int32")
    runs = {}
    for policy in layers.REMAT:
        keras.utils.set_random_seed(0)
        trainer = CausalLMTrainer(build_model(task, vocab_size=50))
        layers.use_remat(trainer, policy)
        trainer.compile(optimizer=layers.AdamW(1e-2), loss=TokenLoss())
        losses = trainer.fit({"input_ids": ids}, np.roll(ids, -1, axis=1), batch_size=4, epochs=3, shuffle=False,
                             verbose=0).history["loss"]
        runs[policy] = losses, [np.asarray(w) for w in trainer.weights]
    (want, want_weights) = runs.pop("none")
    assert want[-1] < want[0]
    remat_keeps_only_what_its_policy_names(task)
    for policy, (got, got_weights) in runs.items():
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=policy)
        for a, b in zip(got_weights, want_weights):
            # Recomputing reorders float32 sums: a weight near 0 may move by ~1e-6 after 6 AdamW steps.
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=policy)
    return keras.backend.backend()


def remat_keeps_only_what_its_policy_names(task) -> None:
    """What a transformer layer keeps for the backward pass (the residuals of a model one layer deeper, less the
    model's): under "full" its input alone (its checkpoint's, unnamed) and its dropout seeds; under
    "save_residuals" its two LayerNormalizations' inputs instead. Every matmul, attention and GELU output is
    recomputed, under "full" each sublayer's last matmul too. Each layer is its own checkpoint, the embeddings and
    the head are in none (use_remat)."""
    import collections
    import contextlib
    import dataclasses
    import io

    import jax
    import numpy as np

    from tpuctl.templates.gpt2.model import CausalLMTrainer, build_model
    from tpuctl.templates.lmkit import layers

    def kept(task, policy):
        trainer = CausalLMTrainer(build_model(task, vocab_size=50))
        layers.use_remat(trainer, policy)
        weights = [v.value for v in trainer.trainable_variables]
        others = [v.value for v in trainer.non_trainable_variables]

        def hidden(weights, ids):
            return trainer.stateless_call(weights, others, {"input_ids": ids}, training=True)[0]["hidden"]

        ids = np.zeros((4, task.seq_len), "int32")
        forward = jax.make_jaxpr(hidden)(weights, ids).jaxpr
        assert sum("policy" in e.params for e in forward.eqns) == task.num_layers, policy  # jax.checkpoint's
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):  # JAX says what a vjp keeps only by printing it
            jax.ad_checkpoint.print_saved_residuals(hidden, weights, ids)
        return [line for line in printed.getvalue().splitlines() if "from the argument" not in line]

    deeper = dataclasses.replace(task, num_layers=task.num_layers + 1)
    for policy, named, count in (("full", None, 1), ("save_residuals", "norm_input", 2)):
        less, more = kept(task, policy), kept(deeper, policy)
        added = [line for line in (collections.Counter(more) - collections.Counter(less)).elements()
                 if not line.startswith("u32[2] ")]  # not the layer's dropout seeds
        assert len(added) == count, (policy, added)
        assert all(f"[4,{task.seq_len},{task.hidden_size}]" in line for line in added), (policy, added)
        assert all((f"named '{named}'" in line) if named else (" named " not in line) for line in added), added


@pytest.mark.slow  # four tiny trainings, each jit-compiled for the CPU: about a minute on 2 idle cores
def test_remat_policies_train_exactly_as_without():
    assert on_jax("test_fit", "remat_trains_the_same", timeout=600) == "jax"


class _Compiler:
    """tpuctl's side of templates/aot.py with the TPU compiler's answers made up: 1 GB of state and 1.25 GB a
    per-device example without remat, 1.0 under "minimal_with_context", 0.5 under "minimal" (v5e: 16 GB)."""

    compiled: list = []
    requests: list = []  # (runtime.framework, sharding) of each request the fit started a compiler for

    def __init__(self, req, topology, options, log):
        self.requests.append((req.config["runtime"]["framework"], req.sharding))
        policies = (["none"] if req.config["runtime"]["framework"] == "tensorflow"  # no remat there (compile_target)
                    else ["none", "minimal_with_context", "minimal"])
        self.model = {"model": {"per_device_batch": 16, "max_steps": 100, "params": 10**6, "layers": 2,
                                "hidden": 128, "seq_len": 128, "precision": "mixed_bfloat16", "remat_policy": "none",
                                "remat_policies": policies}, "state_bytes": 10**9}

    def compile(self, batch, remat=None):
        self.compiled.append((batch, remat))
        need = 10**9 + batch * {None: 1.25e9, "minimal_with_context": 1.0e9, "minimal": 0.5e9}[remat]
        if need > 16e9:
            return {"batch": batch, "oom": need - 10**9, "message": "RESOURCE_EXHAUSTED"}
        memory = dict.fromkeys(("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes"), 0)
        return {"batch": batch, "memory": {**memory, "temp_size_in_bytes": int(need)},
                "cost": {"flops": 1e12, "bytes": 2 * need, "estimated_cycles": 7 * 10**6}}

    def close(self):
        pass


@needs_compiler  # fit compiles only where libtpu imports
def test_a_batch_that_fits_only_with_remat_names_the_policy_and_the_check_refuses_it(monkeypatch, tmp_path):
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path))
    monkeypatch.setattr(fitting, "_Compiler", _Compiler)
    _Compiler.compiled = []
    jax_tiny = tmp_path / "tiny.yaml"  # remat is JAX's (on a v5e `auto` would train with TensorFlow)
    jax_tiny.write_text((EXAMPLES / "gpt2-tiny.yaml").read_text() + "  framework: jax\n")
    r = tpuctl.fit(jax_tiny, accelerator="v5litepod-4", max_compiles=1)
    assert r.fits and r.remat_policy == "minimal" and r.remat_chosen and r.hbm_per_chip_bytes == 9 * 10**9
    assert _Compiler.compiled == [(16, None), (16, "minimal_with_context"), (16, "minimal")]
    assert r.bytes_accessed_per_step == 18e9 and "remat policy minimal" in r.hbm_line()
    assert "largest per-chip batch that fits without it: " in r.hbm_line()  # searched under the config's policy
    assert r.compiler_cycles_per_step == 7 * 10**6  # the compiler's own estimate, beside the roofline
    again = tpuctl.fit(jax_tiny, accelerator="v5litepod-4", max_compiles=1)
    assert again.compiles == 0 and again.remat_policy == "minimal"  # the policies' compiles are cached too
    spec = tmp_path / "big.yaml"  # the check's screen compiles only past a quarter of the HBM: a larger model
    spec.write_text("accelerator: v5litepod-4\njob: {template: gpt2, preset: gpt2-small, framework: jax}\n")
    with pytest.raises(BadInput) as refused:
        fitting.check(spec_mod.from_mapping(spec_mod.read_file(spec)), spec_dir=tmp_path)
    assert refused.value.field == "job.config.trainer.remat_policy"
    assert "set trainer.remat_policy: minimal" in refused.value.hint


@needs_compiler
def test_a_run_that_trains_with_tensorflow_is_fit_as_tensorflows_step(monkeypatch, tmp_path):
    # On a v5e `framework: auto` trains with TensorFlow (run's plan), whose step has none of the JAX step's
    # kernels, remat or split state: the fit answers for that one, whoever asks (fit, up, run), and where it does
    # not fit it says what would (JAX), not what TensorFlow cannot do.
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path))
    monkeypatch.setattr(fitting, "_Compiler", _Compiler)
    _Compiler.requests, _Compiler.compiled = [], []
    r = tpuctl.fit(EXAMPLES / "gpt2-tiny.yaml", accelerator="v5litepod-4", max_compiles=1)
    assert r.framework == "tensorflow" and _Compiler.requests == [("tensorflow", "data")]
    assert r.remat_policy == "none" and not r.remat_chosen and _Compiler.compiled == [(16, None)]
    assert "TensorFlow's step as its XLA program through JAX" in fitting.note(r).message
    _Compiler.requests = []
    assert tpuctl.fit(EXAMPLES / "gpt2-tiny.yaml", accelerator="v6e-8", max_compiles=1).framework == "jax"
    assert _Compiler.requests == [("jax", "data")]  # no TensorFlow from v6e on: auto is JAX there
    big = tmp_path / "big.yaml"  # a model the check's screen compiles; the made-up answer is 21 of 16 GB
    big.write_text("accelerator: v5litepod-4\njob: {template: gpt2, preset: gpt2-small, sharding: auto}\n")
    _Compiler.requests = []
    with pytest.raises(BadInput) as refused:
        fitting.check(spec_mod.from_mapping(spec_mod.read_file(big)), spec_dir=tmp_path)
    assert _Compiler.requests == [("tensorflow", "data")]  # auto splits nothing on TensorFlow
    assert refused.value.field == "job" and "job.framework: jax" in refused.value.hint
    assert "zero1" not in refused.value.hint and "remat" not in str(refused.value)
    with pytest.raises(BadInput, match="not offered in zone 'mars-1a'") as zone:  # what run and up refuse
        tpuctl.fit(EXAMPLES / "gpt2-tiny.yaml", zone="mars-1a", max_compiles=1)
    assert zone.value.field == "zone"


@needs_compiler
def test_a_cache_file_that_is_not_an_answer_is_compiled_again(monkeypatch, tmp_path):
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path))
    monkeypatch.setattr(fitting, "_Compiler", _Compiler)
    _Compiler.compiled = []
    first = tpuctl.fit(EXAMPLES / "gpt2-tiny.yaml", accelerator="v5litepod-4", max_compiles=1)
    (cached,) = (tmp_path / "fit").glob("*.json")
    for torn in ("{}", "null", '{"model": null}', '{"model": 3, "points": {}}'):
        cached.write_text(torn)
        again = tpuctl.fit(EXAMPLES / "gpt2-tiny.yaml", accelerator="v5litepod-4", max_compiles=1)
        assert again.compiles == 1 and again.hbm_per_chip_bytes == first.hbm_per_chip_bytes, torn


def test_fit_compiles_with_the_compiler_flags_a_runs_workers_give_it(monkeypatch):
    # `fit` describes the program that runs only if libtpu compiles it under the same flags on the laptop
    # (aot.py) as on the workers (an lmkit template's strategy.resolve_jax; no flags of ours for a template that
    # does not train with lmkit); one the environment sets already wins.
    from tpuctl.templates import aot, contract
    from tpuctl.templates.lmkit import strategy

    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    aot.use_the_workers_compiler_flags(contract.find("linreg", base_dir=Path(__file__).parent / "job_templates"))
    assert "LIBTPU_INIT_ARGS" not in os.environ
    own = ("--xla_tpu_enable_windowed_einsum_for_all_gather=true "
           "--xla_jf_rematerialization_percent_shared_memory_limit=90")
    monkeypatch.setenv("LIBTPU_INIT_ARGS", own)
    aot.use_the_workers_compiler_flags(contract.find("bert"))
    assert os.environ["LIBTPU_INIT_ARGS"] == f"{own} --xla_tpu_enable_windowed_einsum_for_reduce_scatter=false"
    strategy.use_libtpu_flags()  # idempotent
    assert os.environ["LIBTPU_INIT_ARGS"] == f"{own} --xla_tpu_enable_windowed_einsum_for_reduce_scatter=false"
    monkeypatch.delenv("LIBTPU_INIT_ARGS")
    strategy.use_libtpu_flags()
    assert os.environ["LIBTPU_INIT_ARGS"].split() == list(strategy.LIBTPU_FLAGS)
    assert "use_libtpu_flags()" in inspect.getsource(strategy.resolve_jax).split("import jax")[0]


@needs_compiler
def test_fit_compiles_under_the_jobs_own_libtpu_flags_not_the_laptops(monkeypatch, tmp_path):
    # The workers' libtpu reads the job's LIBTPU_INIT_ARGS (job.env): fit's compiler must too. libtpu refuses a
    # flag it does not know as it loads, before any compile, so a bogus one in job.env must stop the fit...
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path))
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_not_a_flag_of_the_laptop=1")  # ...and this one not reach it
    spec = tmp_path / "tiny.yaml"
    spec.write_text("accelerator: v5litepod-4\njob: {template: bert, preset: bert-tiny, "
                    "env: {LIBTPU_INIT_ARGS: --xla_tpu_not_a_flag_of_the_job=1}}\n")
    with pytest.raises(TpuctlError, match="compiling the training step failed"):
        tpuctl.fit(spec, max_compiles=1)
    log = next((tmp_path / "fit").glob("*.log")).read_text()
    assert "xla_tpu_not_a_flag_of_the_job" in log and "laptop" not in log, log[-2000:]


# bert-tiny cut to one layer: the TPU compiler's time grows with the program, and CI compiles on 2 cores.
ONE_LAYER = "{task: {num_layers: 1}, trainer: {per_replica_batch_size: 16, max_steps: 50}}"


@pytest.mark.slow
@pytest.mark.timeout(1800)
@needs_compiler
def test_the_template_step_compiles_for_two_topologies_and_a_repeat_is_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path))
    spec = tmp_path / "tiny.yaml"
    spec.write_text(f"accelerator: v3-8\njob: {{template: bert, preset: bert-tiny, config: {ONE_LAYER}}}\n")
    v5e = tpuctl.fit(spec, accelerator="v5litepod-4", max_compiles=1)
    v6e = tpuctl.fit(spec, accelerator="v6e-4", max_compiles=1)
    for r, topology in ((v5e, "v5e:2x2"), (v6e, "v6e:2x2")):
        assert r.method == "compiled" and r.compiles == 1 and r.fits and r.topology == topology
        assert r.libtpu == importlib.metadata.version("libtpu")
        # The state alone (float32 weights, two Adam slots) is 12 bytes a weight, replicated on each chip.
        assert 12 * r.params < r.hbm_per_chip_bytes < r.hbm_capacity_bytes
        assert r.compiled_flops_per_step > 0 and r.bytes_accessed_per_step > 0 and r.per_chip_batch == 16
        assert r.compiler_cycles_per_step > 0
    assert v6e.est_step_s < v5e.est_step_s  # v6e's FLOP/s and bandwidth are both higher
    started = time.monotonic()
    again = tpuctl.fit(spec, accelerator="v5litepod-4", max_compiles=1)
    assert time.monotonic() - started < 1.0 and again.compiles == 0
    assert again.to_json() == {**v5e.to_json(), "compiles": 0}


@pytest.mark.slow
@pytest.mark.timeout(1800)
@needs_compiler
def test_a_run_that_cannot_fit_is_refused_before_anything_exists(env, tmp_path):
    # 32768 sequences a chip: 8192 fit (7.99 of 16 GB) once GPT-2's head blocked by tokens (tpu28), and the run
    # went on to train them on the CPU.
    spec = tmp_path / "over.yaml"
    spec.write_text("name: over\nzone: us-central1-a\naccelerator: v5litepod-1\n"
                    "job: {template: gpt2, preset: gpt2-tiny, framework: jax,\n"
                    "      config: {task: {num_layers: 1}, trainer: {per_replica_batch_size: 32768}}}\n")
    out = tpuctl_cli(env, "run", str(spec), "--yes", timeout=1500)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1, out.stderr
    assert "does not fit" in errors[0] and "16.00 GB available on v5litepod-1" in errors[0]
    assert "largest per-chip batch that fits" in errors[0] and "Traceback" not in out.stderr
    listed = json.loads(tpuctl_cli(env, "list", "--json").stdout)
    assert listed["runs"] == []
    skipped = tpuctl_cli(env, "up", str(spec), "--dry-run", "--no-fit-check")
    assert skipped.returncode == 0 and "fit:" not in skipped.stderr


def attention_lowered_for_a_tpu() -> str:
    """(In a fresh JAX interpreter.) SelfAttention with dropout 0.1, training, lowered for a v5e 2x2 that is not
    there: on a TPU it runs the splash kernel (a Mosaic custom call), so no [B, heads, L, L] tensor appears in the
    forward or backward program, and reads q, k, v sequence-minor; its hidden-state dropout is the Dropout
    layers', not this layer's."""
    from tpuctl.templates import aot

    aot.compile_only()
    import jax
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from tpuctl.templates.lmkit import layers

    devices = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu").devices
    mesh = Mesh(np.array(devices), ("batch",))
    batch, length, heads = 8, 256, 4
    layer = layers.SelfAttention(heads, 32, dropout=0.1, causal=True)
    layer.build((batch, length, heads * 32))
    layers.use_tpu_kernels(mesh)

    def loss(weights, seeds, x):
        out, _ = layer.stateless_call(weights, seeds, x, training=True)
        return out.astype("float32").sum()

    weights = [v.value for v in layer.trainable_variables]
    seeds = [v.value for v in layer.non_trainable_variables]
    x = jax.ShapeDtypeStruct((batch, length, heads * 32), "float32",
                             sharding=NamedSharding(mesh, PartitionSpec("batch")))
    lowered = jax.jit(jax.grad(loss, argnums=(0, 2))).lower(weights, seeds, x)
    text = lowered.as_text()
    assert "tpu_custom_call" in text, "no splash kernel in the program"
    scores = f"{batch // len(devices)}x{heads}x{length}x{length}"
    assert scores not in text and f"{batch}x{heads}x{length}x{length}" not in text, "[B, heads, L, L] in the program"
    # The projections write and read the kernel's heads-first layout themselves: the TPU program moves no
    # activation between layouts (the split-reshape-transpose form copied [B, L, hidden] twelve times).
    compiled = lowered.compile().as_text()
    copies = [shape for shape, dims in re.findall(r"= ((?:bf16|f32)\[([\d,]+)\])\S* (?:copy|transpose)\(", compiled)
              if math.prod(int(d) for d in dims.split(",")) >= batch // len(devices) * length * heads * 32 // 2]
    assert not copies, f"layout copies of activations: {copies}"
    # The kernel reads q, k and v sequence-minor, [.., head_dim, L]: with head_dim (32) last a TPU pads each to
    # its 128 lanes, and those padded arrays are what the backward pass keeps.
    seq_minor = re.findall(rf"= f32\[{batch // len(devices)},{heads},32,{length}\]", compiled)
    assert len(seq_minor) >= 3, "q, k, v are not laid out sequence-minor"
    return "jax"


def projection_gradients_are_autodiffs() -> str:
    """(In a fresh JAX interpreter.) lmkit's `projection` as a TPU runs it under remat (its gradients computed
    together behind an optimization barrier) differentiates to autodiff's gradients of einsum + bias, to the bit,
    for every operand; and of the einsum alone without a bias (SelfAttention's keys)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tpuctl.templates.lmkit import layers

    rng = np.random.default_rng(0)
    x, kernel, bias = (jnp.asarray(rng.standard_normal(shape), "float32")
                       for shape in ((2, 5, 6), (6, 3, 4), (3, 1, 4)))
    early = layers._projection_with_early_gradients()

    def loss(project):
        return lambda *operands: (project("blc,cnd->bnld", *operands) ** 2).sum()

    ours = jax.grad(loss(early), argnums=(0, 1, 2))(x, kernel, bias)
    autodiff = jax.grad(loss(lambda eq, x, k, b: jnp.einsum(eq, x, k) + b), argnums=(0, 1, 2))(x, kernel, bias)
    for got, want in zip(ours, autodiff):
        np.testing.assert_array_equal(got, want)
    ours = jax.grad(loss(early), argnums=(0, 1))(x, kernel, None)
    autodiff = jax.grad(loss(lambda eq, x, k, b: jnp.einsum(eq, x, k)), argnums=(0, 1))(x, kernel, None)
    for got, want in zip(ours, autodiff):
        np.testing.assert_array_equal(got, want)
    return "jax"


def tensorflows_step_lowered_for_a_tpu() -> str:
    """(In a fresh JAX interpreter.) The fit target of a run that trains with TensorFlow, lowered for a v5e 2x2
    that is not there: TensorFlow has no Pallas kernel and no remat, so its step is the Keras model's plain XLA
    program (no Mosaic custom call) with "none" its one remat policy, where the same job on JAX runs splash
    attention and the fused head."""
    from tpuctl.templates import aot

    aot.compile_only()
    from jax.experimental import topologies

    from tpuctl.jobs import bundle
    from tpuctl.templates import contract

    devices = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu").devices
    template = contract.find("gpt2")
    for framework, kernels in (("tensorflow", False), ("jax", True)):
        config = bundle.job_config({"task": {"num_layers": 1}}, preset="gpt2-tiny", bucket="fit", run="fit",
                                   data_url=None, framework=framework)
        target = template.fit_target(config, devices=devices, vocab_size=512)
        text = target["step"].lower(target["state"], target["batch"](8)).as_text()
        assert ("tpu_custom_call" in text) is kernels, (framework, "Pallas kernels" if kernels else "none")
        assert (target["remat_policies"] == ["none"]) is not kernels, target["remat_policies"]
    return "jax"


# lmkit as a TPU run builds it, each checked in the fresh JAX interpreter of `tpu_layers` (its docstring says what).
TPU_CHECKS = ("attention_lowered_for_a_tpu", "projection_gradients_are_autodiffs", "tensorflows_step_lowered_for_a_tpu",
              "masked_lm_flop_params")


@pytest.fixture(scope="module")
def tpu_layers():
    """The checks of lmkit's layers as a TPU runs them, in one fresh JAX interpreter: check -> its answer."""
    return on_jax_each("test_fit", TPU_CHECKS)


@needs_compiler
@pytest.mark.parametrize("check", TPU_CHECKS)
def test_lmkit_as_a_tpu_runs_it(tpu_layers, check):
    assert tpu_layers[check] == "jax", tpu_layers[check]


def bias_gradients_scheduled_for_a_tpu_under_remat() -> str:
    """(In a fresh JAX interpreter.) bert-tiny's training step (3 layers) under remat `full`, compiled for a v5e 2x2
    that is not there: its bias gradients come in the order of the backward pass, each attention layer's before
    the layer below it (lmkit's `projection`). Left to itself, libtpu computes them all at the end, together, and
    keeps every layer's query, key and value gradients in HBM until then (bert-128 on a v5e: 17.0 MB a sequence
    instead of 9.5). The head's loss, its bias's gradient included, is the fused kernels' (fused_head): two
    Pallas calls, and no [tokens, vocab] tensor in the program; without remat, XLA's head."""
    from tpuctl.templates import aot

    aot.compile_only()
    import itertools
    import re

    from jax.experimental import topologies

    from tpuctl.templates.bert import train
    from tpuctl.templates.lmkit.trainer import compile_target

    devices = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu").devices
    # Dropout 0, as bench/tpu_compile.py compiles: at the presets' 0.1 the head's bias gradient is no reduce of
    # its own in the scheduled program, which is what this check reads.
    config = {"preset": "bert-tiny", "task": {"num_layers": 3, "seq_len": 128, "max_predictions_per_seq": 20,
                                              "dropout": 0.0},
              "trainer": {"remat_policy": "full"}, "runtime": {"framework": "jax"}}
    target = compile_target(config, devices=devices, vocab_size=1024, objective=train.MASKED_LM)
    program = target["step"].lower(target["state"], target["batch"](16)).compile().as_text()
    entry = program[program.index("\nENTRY"):].splitlines()  # scheduled: instructions in the order they run
    # A bias's gradient is the sum of its upstream gradient (autodiff's reduce_sum), fused with its kernel's
    # gradient: the instructions that compute it or hand it on, wherever the compiler fused it.
    reduced = [found.group(1) for line in entry
               for found in [re.search(r'op_name="[^"]*?(layer\d+_attention)/transpose\(jvp\(\)\)/reduce_sum', line)]
               if found]
    # Each owner's bias gradients together, the owners in the backward pass's order.
    order = [owner for owner, _ in itertools.groupby(reduced)]
    assert order == ["layer2_attention", "layer1_attention", "layer0_attention"], reduced
    head = [line for line in entry
            if 'custom_call_target="tpu_custom_call"' in line and "shard_map/pallas_call" in line]
    assert len(head) == 2 and "f32[8,1024]" in head[1], head  # the forward; the embeddings' and bias's gradients
    logits = re.compile(r"\[16,20,1024\]|\[320,1024\]")  # [B, predictions, vocab] a device, or flattened
    assert not any(logits.search(line) for line in entry), "the logits are in the program"
    # Without remat BERT's head stays XLA's (its kernels would save bytes there, not HBM: TiedHeadTrainer).
    unrematted = target["step_for"]("none").lower(target["state"], target["batch"](16)).compile().as_text()
    assert "shard_map/pallas_call" not in unrematted and logits.search(unrematted)
    return "jax"


@pytest.mark.slow  # a fresh JAX interpreter and a TPU compile, ~40 s; the projection's parity stays fast
@needs_compiler
def test_on_a_tpu_under_remat_bias_gradients_free_their_layers_gradients():
    assert on_jax("test_fit", "bias_gradients_scheduled_for_a_tpu_under_remat", timeout=300) == "jax"


def feed_forward_compiled_for_a_v4() -> str:
    """(In a fresh JAX interpreter.) Two feed-forward blocks (Dense, GELU, Dense) under mixed bfloat16, their gradient
    compiled for a v4 2x2x1 that is not there: between the forward and the backward pass the TPU program keeps
    no float32 copy of the [tokens, intermediate] pre-activation, only bfloat16 tensors (autodiff's float32
    GELU had libtpu write one out beside the matmul's result, in every layer)."""
    from tpuctl.templates import aot

    aot.compile_only()
    import jax
    import keras
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from tpuctl.templates.lmkit import layers

    keras.config.set_dtype_policy("mixed_bfloat16")
    devices = topologies.get_topology_desc(topology_name="v4:2x2x1", platform="tpu",
                                           chip_config_name="megacore").devices
    mesh = Mesh(np.array(devices), ("batch",))
    batch, length, hidden, inner = 32, 128, 256, 1024
    inputs = x = keras.Input((length, hidden))
    for _ in range(2):  # as in BERT: x + FFN(x), normalised (one lone block kept no float32 copy)
        x = keras.layers.LayerNormalization()(x + keras.layers.Dense(hidden)(
            keras.layers.Dense(inner, activation=layers.gelu)(x)))
    model = keras.Model(inputs, x)
    layers.use_tpu_kernels(mesh)

    def loss(weights, x):
        out, _ = model.stateless_call(weights, [], x, training=True)
        return out.astype("float32").sum()

    x = jax.ShapeDtypeStruct((batch, length, hidden), "float32", sharding=NamedSharding(mesh, PartitionSpec("batch")))
    program = jax.jit(jax.grad(loss)).lower([v.value for v in model.trainable_variables], x).compile().as_text()
    # What the program writes to memory: results of the instructions outside fused computations.
    result = re.compile(r"= (.+?) [\w-]+\(")
    kept = [found.group(1) for computation in re.split(r"\n(?=\S)", program) if not computation.startswith("%fused")
            for found in map(result.search, computation.splitlines()[1:]) if found]
    activation = f"f32[{batch // len(devices)},{length},{inner}]"
    assert f"bf16[{batch // len(devices)},{length},{inner}]" in " ".join(kept), "the check would find nothing"
    assert not [shape for shape in kept if activation in shape], f"a float32 {activation} between the passes"
    return "jax"


@needs_compiler
def test_on_a_v4_the_feed_forward_keeps_no_float32_activation():
    assert on_jax("test_fit", "feed_forward_compiled_for_a_v4", timeout=300) == "jax"


# gpt2-small on v5p-8 (4 chips, one host; the zone sells it): the weak-scaling case bench/weak_scaling.py records.
GPT2_SMALL_V5P = ("name: ws\nzone: us-east5-a\naccelerator: v5p-8\n"
                  "job: {template: gpt2, preset: gpt2-small, framework: jax}\n")


def test_slices_add_the_gradient_all_reduce_over_dcn(monkeypatch, tmp_path):
    """Weak scaling: each slice runs the same per-chip batch; the step adds a ring all-reduce of the float32
    gradients across the slices over DCN, each of the slice's 4 chips moving its share at Google's 50 Gbps a
    v5p chip (cloud.google.com/tpu/docs/v5p)."""
    monkeypatch.setitem(sys.modules, "libtpu", None)
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path))
    spec = tmp_path / "ws.yaml"
    spec.write_text(GPT2_SMALL_V5P)
    one, two, four = (tpuctl.fit(spec_mod.from_mapping({**spec_mod.read_file(spec), "slices": n}), spec_dir=tmp_path)
                      for n in (1, 2, 4))
    assert one.slices == 1 and one.dcn_s == 0.0
    for r, n in ((two, 2), (four, 4)):
        gradient = 4 * r.params  # bytes: float32
        assert r.slices == n and r.dcn_s == pytest.approx(2 * (n - 1) / n * gradient / (4 * 50e9 / 8))
        assert r.est_step_s == pytest.approx(one.est_step_s + r.dcn_s)
        assert r.global_batch == n * one.global_batch and r.per_chip_batch == one.per_chip_batch
        assert r.hbm_per_chip_bytes == one.hbm_per_chip_bytes and r.chips == one.chips == 4
        assert r.est_tokens_per_s == pytest.approx(n * one.global_batch * 1024 / r.est_step_s)
        assert r.est_mfu == pytest.approx(one.est_mfu * one.est_step_s / r.est_step_s)
        assert r.price_per_hour == pytest.approx(n * one.price_per_hour)
        assert r.est_cost_usd == pytest.approx(r.est_run_s / 3600 * r.price_per_hour)
    assert four.dcn_s == pytest.approx(1.5 * two.dcn_s)  # 2(N-1)/N: 1 at two slices, 1.5 at four


def test_fit_json_reports_the_slices_and_refuses_a_multislice_google_does_not_make(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "libtpu", None)
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path))
    from tpuctl.cli import cli

    spec = tmp_path / "ws.yaml"
    spec.write_text(GPT2_SMALL_V5P)
    out = CliRunner().invoke(cli, ["fit", str(spec), "--slices", "2", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["slices"] == 2 and data["dcn_s"] > 0 and data["global_batch"] == 2 * 4 * data["per_chip_batch"]
    assert data["est_step_s"] > data["dcn_s"] and data["est_tokens_per_s"] > 0 and data["est_cost_usd"] > 0
    from rich.console import Console

    from tpuctl import console

    table, errors = io.StringIO(), io.StringIO()  # the console's streams were bound at its import, not CliRunner's
    monkeypatch.setattr(console, "out", Console(file=table, width=1000, no_color=True))
    monkeypatch.setattr(console, "err", Console(file=errors, width=1000, no_color=True))
    human = CliRunner().invoke(cli, ["fit", str(spec), "--slices", "2"])
    assert human.exit_code == 0 and "2 x v5p-8, data parallel across them over DCN" in table.getvalue()
    assert "the gradient all-reduce over DCN, an estimate" in table.getvalue()
    refused = CliRunner().invoke(cli, ["fit", str(spec), "--slices", "2", "--accelerator", "v3-8",
                                       "--zone", "us-central1-a"])
    assert refused.exit_code == 2 and "error: slices: Google's multislice is for TPU v4 and later" in errors.getvalue()


# Two kernels as libtpu's optimized HLO writes them (abridged from a gpt2-small step compiled for a v5e 2x2):
# splash attention's forward, which declares no cost, and fused_head's forward, which does.
KERNEL_HLO = (
    '  %splash_mha_fwd_residuals.2 = (f32[8,512,128]{2,1,0:T(8,128)}, bf16[8,12,1024,64]{3,2,1,0:T(8,128)(2,1)S(1)})'
    ' custom-call(%copy-done.225, %bitcast.340), custom_call_target="tpu_custom_call", operand_layout_constraints='
    '{s32[8,1024]{1,0}, bf16[8,12,1024,64]{3,2,1,0}}, frontend_attributes={kernel_metadata={}}, backend_config='
    '{"custom_call_config":{"body":"TUzvUgFN"}}\n'
    '  %shard_map.444 = (f32[8192,1]{1,0:T(8,128)}, f32[8192,768]{1,0:T(8,128)S(1)}) custom-call(%bitcast.367, '
    '%bitcast.353), custom_call_target="tpu_custom_call", operand_layout_constraints={bf16[8192,768]{1,0}, '
    'bf16[50688,768]{1,0}}, backend_config={"custom_call_config":{"body":"TUzv","cost_estimate":{"flops":"1"}}}\n'
    '  %fusion.1 = bf16[8192,768]{1,0} fusion(%p), kind=kLoop, calls=%fused_computation.1\n')


def test_a_kernel_that_declares_no_cost_counts_its_operands_and_results_once():
    """The compiler's cost analysis counts a Pallas kernel's bytes only when the kernel declares them (splash
    attention does not: a step of it alone reported no bytes at all), so the fit adds, for each such kernel,
    its operands read once and results written once; a kernel with a cost estimate is the compiler's."""
    from tpuctl.templates import aot

    splash = 4 * 8 * 512 * 128 + 2 * 8 * 12 * 1024 * 64 + 4 * 8 * 1024 + 2 * 8 * 12 * 1024 * 64
    assert aot.undeclared_kernel_bytes(KERNEL_HLO) == splash
    assert aot.undeclared_kernel_bytes(KERNEL_HLO.split("\n", 1)[1]) == 0


# Three instructions and the compiler's estimates of them, as libtpu's optimized HLO writes them (abridged: two of
# bert-128's step for a v5p, and tpu7x's token gather offloaded to its SparseCores, which it does not estimate).
CYCLES_HLO = (
    '  %reduce.306 = bf16[12,64]{1,0:T(8,128)(2,1)} reduce(%get-tuple-element.302, %constant.240.clone), '
    'dimensions={0,1,3}, backend_config={"flag_configs":[],"window_config":{"kernel_window_bounds":[],'
    '"output_window_bounds":["8","1","1","16","1"],"input_window_bounds":[],"estimated_cycles":"78920"}}\n'
    '  ROOT %gather_offload_custom_fusion.3 = bf16[2048,768]{1,0:T(16,128)(2,1)} fusion(%param_0.12021), '
    'kind=kCustom, backend_config={"flag_configs":[],"window_config":{"kernel_window_bounds":[],'
    '"estimated_cycles":"9223372036854775807","cost_model_type":"COST_MODEL_TYPE_INVALID"}}\n'
    '  %fusion = bf16[8192,768]{1,0} fusion(%x.1, %copy-done), kind=kOutput, calls=%fused_computation, '
    'backend_config={"flag_configs":[],"window_config":{"kernel_window_bounds":["384","6"],'
    '"estimated_cycles":"159850","iteration_bounds":["1","32","1"]}}\n')


def test_the_compilers_cycle_estimates_are_summed_without_the_ones_it_could_not_make():
    """bench/tpu_compile.py sets the sum of the compiler's per-instruction cycle estimates beside the roofline: an
    instruction it could not estimate (INT64_MAX) is left out, and a Pallas kernel carries none."""
    from tpuctl.templates import aot

    assert aot.estimated_cycles(CYCLES_HLO) == 78920 + 159850
    assert aot.estimated_cycles(KERNEL_HLO) == 0


def test_the_step_estimate_takes_the_compiled_flops_where_the_program_does_more():
    """Recompute (remat, GPT-2's TPU head) costs FLOPs the model's count does not have: the step estimate takes
    the larger of the two; MFU stays the model's FLOPs over the step."""
    chip = fitting.CHIPS["v5e"]
    model = {"params": 124_000_000, "layers": 12, "hidden": 768, "seq_len": 1024}
    model_flops, plain = fitting.roofline(chip, 1, model, 8, 1.0)
    assert fitting.roofline(chip, 1, model, 8, 1.0, compiled_flops_per_chip=model_flops / 2) == (model_flops, plain)
    more = fitting.roofline(chip, 1, model, 8, 1.0, compiled_flops_per_chip=1.5 * model_flops)
    assert more == (model_flops, pytest.approx(1.5 * plain))
