"""The plugin system: third-party methods, verifiers and backends through config alone,
method detection, entry-point loading errors, disabling plugins, and the hook contract.

The third-party plugins here are classes defined in this file and passed in-process with
``LLM(..., plugins=[...])`` (nothing is installed). A meta-test checks that every hookspec
is documented and implemented by one of them (datasette's approach).
"""

from __future__ import annotations

import collections
import importlib.metadata as md
import json
import logging

import attrs
import pluggy
import pytest
import torch

import speculum
import speculum.plugins
from speculum import LLM, SamplingParams, hooks, testing
from speculum.backends.torch import TorchBackend
from speculum.config import SpeculativeConfig
from speculum.engine_build import resolve_method
from speculum.errors import ConfigError, PluginError
from speculum.interfaces import Draft
from speculum.plugins import build_registry, make_plugin_manager, validate_options
from speculum.verifiers import GreedyVerifier

#: what the test plugins saw; cleared before every test
CALLS: collections.Counter = collections.Counter()
SEEN: dict = {}

PROMPTS = [{"prompt_token_ids": p} for p in ([5], [30, 31, 32, 30, 31, 32, 30], [10, 11, 12, 13, 14] * 4)]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(autouse=True)
def _clear_records():
    CALLS.clear()
    SEEN.clear()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --------------------------------------------------------------- third-party plugins
@attrs.frozen
class EchoOptions:
    """Options of the echo_last method: draft ``width`` tokens (at most k)."""

    width: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.ge(1)))
    note: str = ""


class EchoLastProposer:
    """Proposes the sequence's last token, repeated: deterministic (probs=None)."""

    def __init__(self, options: EchoOptions):
        self.options = options

    def propose(self, batch):
        CALLS["propose"] += 1
        k = batch.num_speculative_tokens
        if self.options.width is not None:
            k = min(k, self.options.width)
        last = torch.tensor([s.token_ids[-1] for s in batch.seqs], dtype=torch.int64)
        return Draft(token_ids=last.view(-1, 1).repeat(1, k), probs=None)

    def observe(self, feedback):
        CALLS["observe"] += 1


def make_echo_last(ctx) -> EchoLastProposer:
    SEEN["ctx"] = ctx
    return EchoLastProposer(ctx.options)


class EchoPlugin:
    """Registers the ``echo_last`` method."""

    @staticmethod
    @speculum.hookimpl
    def speculum_register_proposers(register):
        register("echo_last", make_echo_last, backends=("torch",), options=EchoOptions,
                 description="repeat the last token")


class MyHeadDetector:
    """Recognises draft checkpoints whose config names the MyHead architecture."""

    @staticmethod
    @speculum.hookimpl
    def speculum_detect_method(model_path, config):
        CALLS["detect"] += 1
        SEEN["detect"] = (model_path, dict(config))
        return "echo_last" if "MyHead" in config.get("architectures", []) else None


class SilentDetector:
    """Answers None for everything (firstresult must go on to the next implementation)."""

    @staticmethod
    @speculum.hookimpl
    def speculum_detect_method(model_path):  # pluggy passes only the arguments named
        CALLS["silent"] += 1
        return None


class CountingVerifier(GreedyVerifier):
    def verify(self, target_logits, draft, sampling):
        CALLS["verify"] += 1
        return super().verify(target_logits, draft, sampling)


class VerifierPlugin:
    @staticmethod
    @speculum.hookimpl
    def speculum_register_verifiers(register):
        register("counting_greedy", CountingVerifier, lossless=True, description="greedy, counted")
        register("sloppy", CountingVerifier, lossless=False, description="pretends to be lossy")


class CountingTorchBackend(TorchBackend):
    name = "counting_torch"

    def load_model(self, path, role="target", max_model_len=None, num_layers=None):
        CALLS[f"load_{role}"] += 1
        return super().load_model(path, role, max_model_len, num_layers)


class BackendPlugin:
    @staticmethod
    @speculum.hookimpl
    def speculum_register_backends(register):
        register("counting_torch", CountingTorchBackend, description="torch, counting model loads")


class NgramImpostor:
    """Registers a method under a name an installed plugin already uses."""

    @staticmethod
    @speculum.hookimpl
    def speculum_register_proposers(register):
        register("ngram", make_echo_last, options=EchoOptions)


class MisspelledPlugin:
    @staticmethod
    @speculum.hookimpl
    def speculum_register_proposer(register):  # missing "s": no such hook
        register("never", make_echo_last)


class TrainerPlugin:
    """A trainer registered by import path (never imported unless used) and one that is broken."""

    @staticmethod
    @speculum.hookimpl
    def speculum_register_trainers(register):
        register("echo", "speculum.train.draft:DraftTrainer", description="the draft trainer under another name")
        register("broken", "no_such_package.train:Trainer", description="cannot be imported")


TEST_PLUGINS = [EchoPlugin, MyHeadDetector, SilentDetector, VerifierPlugin, BackendPlugin, NgramImpostor,
                TrainerPlugin]


# ------------------------------------------------------------------------- fixtures
def make_llm(model, spec=None, **kw) -> LLM:
    kw.setdefault("max_num_seqs", 2)
    return testing.make_llm(model, spec, **kw)


@pytest.fixture(scope="module")
def baseline(tiny_llama) -> list[list[int]]:
    return [o.token_ids for o in make_llm(tiny_llama).generate(PROMPTS, GREEDY)]


@pytest.fixture
def myhead_dir(tmp_path):
    d = tmp_path / "myhead-draft"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["MyHead"], "hidden_size": 64}))
    return d


# -------------------------------------------------- speculum_register_proposers
def test_third_party_method_through_config_alone(tiny_llama, baseline):
    spec = {"method": "echo_last", "num_speculative_tokens": 3, "options": {"width": 2, "note": "hi"}}
    llm = make_llm(tiny_llama, spec, plugins=[EchoPlugin])
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == baseline
    assert CALLS["propose"] > 0 and CALLS["observe"] == CALLS["propose"]
    # the options arrived validated, as an instance of the plugin's options class
    assert SEEN["ctx"].options == EchoOptions(width=2, note="hi")
    assert llm.proposer.options is SEEN["ctx"].options
    assert SEEN["ctx"].config.method == "echo_last" and SEEN["ctx"].vocab_size == 512
    # and they took effect: at most 2 drafts per step
    m = llm.metrics
    assert 0 < m.num_draft_tokens <= 2 * m.num_steps
    assert len(m.accepted_per_position) <= 2
    spec_info = llm.method_spec
    assert (spec_info.name, spec_info.plugin.name, spec_info.plugin.distribution) == (
        "echo_last", "EchoPlugin", "(not installed)")


def test_plugin_options_are_validated():
    reg = build_registry(extra_plugins=[EchoPlugin])
    spec = reg.method("echo_last", "torch")
    assert validate_options(spec, {}) == EchoOptions()
    with pytest.raises(ConfigError, match=r"unknown option\(s\) colour for method 'echo_last'; valid options: width, note"):
        validate_options(spec, {"colour": "red"})
    with pytest.raises(ConfigError, match="invalid options for method 'echo_last'"):
        validate_options(spec, {"width": 0})
    with pytest.raises(ConfigError, match="has no implementation for backend 'jax'; it supports: torch"):
        reg.method("echo_last", "jax")
    ngram = reg.method("ngram", "torch")
    with pytest.raises(ConfigError, match="valid options: search_window"):
        validate_options(ngram, {"width": 2})


def test_invalid_options_fail_at_construction(tiny_llama):
    with pytest.raises(ConfigError, match="valid options: width, note"):
        make_llm(tiny_llama, {"method": "echo_last", "num_speculative_tokens": 2, "options": {"wdth": 2}},
                 plugins=[EchoPlugin])


def test_later_plugin_replaces_a_method_name(caplog):
    with caplog.at_level(logging.WARNING, logger="speculum.plugins"):
        reg = build_registry(extra_plugins=[NgramImpostor])
    assert reg.methods["ngram"].plugin.name == "NgramImpostor"
    assert "speculum_register_proposers 'ngram' from NgramImpostor replaces the one from ngram" in caplog.text


# ------------------------------------------------------- speculum_detect_method
def test_detect_method_picks_the_plugin_method(tiny_llama, baseline, myhead_dir):
    spec = {"model": str(myhead_dir), "num_speculative_tokens": 2}
    llm = make_llm(tiny_llama, spec, plugins=[EchoPlugin, MyHeadDetector, SilentDetector])
    assert llm.speculative_config.method == "echo_last"
    assert isinstance(llm.proposer, EchoLastProposer)
    assert SEEN["detect"] == (str(myhead_dir), {"architectures": ["MyHead"], "hidden_size": 64})
    # firstresult: the silent detector (registered last, so asked first) answered None
    # and the MyHead detector was asked next
    assert CALLS["silent"] == 1 and CALLS["detect"] == 1
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == baseline
    assert CALLS["propose"] > 0


def test_detect_method_first_answer_wins(myhead_dir):
    class Other:
        @staticmethod
        @speculum.hookimpl
        def speculum_detect_method(config):
            CALLS["other"] += 1
            return "ngram"

    reg = build_registry(extra_plugins=[EchoPlugin, MyHeadDetector, Other])
    cfg = SpeculativeConfig(model=str(myhead_dir), num_speculative_tokens=2)
    assert resolve_method(cfg, reg).method == "ngram"  # Other, registered last, answers first
    assert CALLS["other"] == 1 and CALLS["detect"] == 0


def test_checkpoint_without_detector_is_a_draft_model(tiny_llama, myhead_dir):
    reg = build_registry()
    for path in (myhead_dir, tiny_llama):
        cfg = SpeculativeConfig(model=str(path), num_speculative_tokens=2)
        assert resolve_method(cfg, reg).method == "draft_model"
    # the detector is not even asked when the method is given
    reg = build_registry(extra_plugins=[EchoPlugin, MyHeadDetector])
    cfg = SpeculativeConfig(method="draft_model", model=str(myhead_dir), num_speculative_tokens=2)
    assert resolve_method(cfg, reg).method == "draft_model"
    assert CALLS["detect"] == 0
    # a detector that does not recognise the checkpoint leaves it a draft model
    cfg = SpeculativeConfig(model=str(tiny_llama), num_speculative_tokens=2)
    assert resolve_method(cfg, reg).method == "draft_model"
    assert CALLS["detect"] == 1 and SEEN["detect"][1]["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.parametrize("alias", ["ngram", "[ngram]", "[NGRAM]"])
def test_ngram_model_aliases(alias):
    reg = build_registry(extra_plugins=[MyHeadDetector])
    cfg = SpeculativeConfig(model=alias, num_speculative_tokens=2)
    assert resolve_method(cfg, reg).method == "ngram"
    assert CALLS["detect"] == 0
    with pytest.raises(ConfigError, match="means method 'ngram'"):
        resolve_method(SpeculativeConfig(model=alias, method="draft_model", num_speculative_tokens=2), reg)


def test_ngram_model_alias_builds_the_ngram_proposer(tiny_llama):
    llm = make_llm(tiny_llama, {"model": "[ngram]", "num_speculative_tokens": 2})
    assert llm.speculative_config.method == "ngram"
    assert type(llm.proposer).__name__ == "NgramProposer"
    assert llm.method_spec.plugin.distribution == "speculum-ngram"


# -------------------------------------------- speculum_register_verifiers / _backends
def test_third_party_verifier(tiny_llama, baseline):
    llm = make_llm(tiny_llama, {"method": "echo_last", "num_speculative_tokens": 2,
                                "acceptance_method": "counting_greedy"}, plugins=[EchoPlugin, VerifierPlugin])
    assert isinstance(llm.verifier, CountingVerifier)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == baseline
    assert 0 < CALLS["verify"] <= llm.metrics.num_steps  # one call per engine step (batched)
    reg = llm.registry
    assert reg.verifiers["counting_greedy"].lossless and not reg.verifiers["sloppy"].lossless
    assert reg.verifiers["counting_greedy"].plugin.name == "VerifierPlugin"
    with pytest.raises(ConfigError, match="installed verifiers: block, counting_greedy, exact_match, greedy, greedy_jax, "
                                          "rejection_sampler, rejection_sampler_jax, sloppy"):
        reg.verifier("nope")


def test_third_party_backend(tiny_llama, baseline):
    llm = make_llm(tiny_llama, backend="counting_torch", plugins=[BackendPlugin])
    assert isinstance(llm.backend, CountingTorchBackend) and CALLS["load_target"] == 1
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == baseline
    # installed methods register for "torch" only: a clear error for another backend
    with pytest.raises(ConfigError, match="method 'ngram' .* has no implementation for backend 'counting_torch'"):
        make_llm(tiny_llama, {"method": "ngram", "num_speculative_tokens": 2}, backend="counting_torch",
                 plugins=[BackendPlugin])
    with pytest.raises(ConfigError, match="unknown backend 'nope'; installed backends: counting_torch, jax, torch"):
        make_llm(tiny_llama, backend="nope", plugins=[BackendPlugin])


# --------------------------------------------------------- entry points, disabling
@pytest.mark.parametrize("value", ["speculum_no_such_module.plugin", "speculum_ngram.plugin:no_such_attr"])
def test_broken_entry_point_is_named(monkeypatch, value):
    broken = md.EntryPoint(name="broken_thing", value=value, group="speculum")
    real = md.entry_points

    def fake_entry_points(**kw):
        if kw.get("group") != "speculum":
            return real(**kw)
        return [*real(**kw), broken]

    monkeypatch.setattr(speculum.plugins.md, "entry_points", fake_entry_points)
    monkeypatch.delenv("SPECULUM_DISABLE_PLUGINS", raising=False)
    with pytest.raises(PluginError) as info:
        make_plugin_manager()
    msg = str(info.value)
    assert 'speculum plugin "broken_thing"' in msg and value in msg
    assert "SPECULUM_DISABLE_PLUGINS=broken_thing" in msg
    assert isinstance(info.value.__cause__, (ImportError, AttributeError))
    with pytest.raises(PluginError, match="broken_thing"):
        LLM("unused", plugins=[])  # the engine fails the same way, before loading anything

    monkeypatch.setenv("SPECULUM_DISABLE_PLUGINS", "broken_thing")
    pm = make_plugin_manager()
    assert pm.get_plugin("broken_thing") is None
    assert {"ngram", "draft_model"} <= set(build_registry(pm).methods)


def test_disable_ngram(monkeypatch, tiny_llama):
    monkeypatch.setenv("SPECULUM_DISABLE_PLUGINS", "ngram")
    reg = build_registry()
    assert "ngram" not in reg.methods and "draft_model" in reg.methods
    others = ", ".join(sorted(reg.methods))
    with pytest.raises(ConfigError, match=f"unknown speculative method 'ngram'; installed methods: {others}"):
        make_llm(tiny_llama, {"method": "ngram", "num_speculative_tokens": 2})
    every = {ep.name for ep in md.entry_points(group="speculum")}
    monkeypatch.setenv("SPECULUM_DISABLE_PLUGINS", " , ".join(sorted(every)) + " ,")
    reg = build_registry()
    assert reg.methods == {}
    with pytest.raises(ConfigError, match=r"installed methods: \(none\)"):
        reg.method("ngram", "torch")
    # the built-ins only (verifier plugins such as typical_acceptance are entry points)
    assert reg.verifiers.keys() == {"rejection_sampler", "block", "exact_match", "greedy", "rejection_sampler_jax", "greedy_jax"}
    # built-ins can be disabled by module name too (and then are missing)
    monkeypatch.setenv("SPECULUM_DISABLE_PLUGINS", ",".join(["speculum.verifiers", *sorted(every)]))
    assert set(build_registry().verifiers) == {"rejection_sampler_jax", "greedy_jax"}  # the JAX backend's
    monkeypatch.setenv("SPECULUM_DISABLE_PLUGINS", ",".join(["speculum.verifiers", "speculum.backends.jax", *sorted(every)]))
    reg = build_registry()
    assert reg.verifiers == {} and "jax" not in reg.backends


def test_registry_reports_distributions(monkeypatch):
    monkeypatch.delenv("SPECULUM_DISABLE_PLUGINS", raising=False)
    reg = build_registry()
    info = {name: (s.plugin.name, s.plugin.distribution, s.plugin.version) for name, s in reg.methods.items()}
    assert info["ngram"] == ("ngram", "speculum-ngram", "0.1.0")
    assert info["draft_model"] == ("draft_model", "speculum-draft-model", "0.1.0")
    for spec in (reg.verifiers["rejection_sampler"], reg.verifiers["greedy"], reg.backends["torch"]):
        assert spec.plugin.distribution == "speculum"
        assert spec.plugin.version == speculum.__version__
    assert reg.verifiers["rejection_sampler"].plugin.name == "speculum.verifiers"
    assert reg.backends["torch"].plugin.name == "speculum.backends.torch"
    assert all(spec.description for spec in (*reg.methods.values(), *reg.verifiers.values(), *reg.backends.values()))


# ------------------------------------------------------------------- the contract
def hookspec_names() -> set[str]:
    return {name for name, fn in vars(hooks).items() if hasattr(fn, f"{hooks.PROJECT}_spec")}


def test_every_hookspec_is_documented_and_exercised():
    names = hookspec_names()
    assert names == {"speculum_register_proposers", "speculum_register_verifiers",
                     "speculum_register_backends", "speculum_register_trainers", "speculum_detect_method"}
    for name in names:
        doc = getattr(hooks, name).__doc__
        assert doc and len(doc.strip()) > 40, f"hookspec {name} needs a docstring"
    # each hookspec is implemented by a plugin of this file (and used by a test above)
    pm = make_plugin_manager(extra_plugins=TEST_PLUGINS, load_entry_points=False)
    ours = {id(p) for p in TEST_PLUGINS}
    exercised = {name for name in names
                 if any(id(impl.plugin) in ours for impl in getattr(pm.hook, name).get_hookimpls())}
    assert exercised == names


def test_misspelled_hook_fails_loudly(tiny_llama):
    with pytest.raises(pluggy.PluginValidationError, match="speculum_register_proposer"):
        make_plugin_manager(extra_plugins=[MisspelledPlugin])
    with pytest.raises(pluggy.PluginValidationError, match="unknown hook"):
        make_llm(tiny_llama, plugins=[MisspelledPlugin])


def test_trainers_register_through_the_hook_and_load_lazily(monkeypatch):
    reg = build_registry(extra_plugins=[TrainerPlugin])
    assert reg.trainers["draft"].plugin.name == "speculum.train"  # the built-in is a default plugin
    assert reg.trainers["echo"].description and isinstance(reg.trainers["echo"].factory, str)
    assert type(reg.trainers["echo"].create()).__name__ == "DraftTrainer"
    with pytest.raises(PluginError, match=r"trainer 'broken' of plugin .* could not be loaded"):
        reg.trainers["broken"].create()
    # the disable list applies to trainers like to every other plugin part
    monkeypatch.setenv("SPECULUM_DISABLE_PLUGINS", "speculum.train")
    assert "draft" not in build_registry().trainers
