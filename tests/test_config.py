"""Every speculative-config error is raised at construction, with a message that says
what to do.

Two layers: :class:`SpeculativeConfig` checks what needs nothing but the config
(``from_dict`` / ``from_json`` / ``from_cli``); the engine (``speculum.LLM``) checks what
needs the target and the installed plugins (method, backend, options, verifier,
tensor parallel size, draft vocabulary). Engine tests use the tiny random Llama.
"""

from __future__ import annotations

import json
import re

import attrs
import pytest

import speculum
from speculum import ConfigError, SpeculativeConfig
from speculum.context import ProposerContext
from speculum.interfaces import Draft
from speculum.verifiers import GreedyVerifier

CONSTRUCTORS = {
    "from_dict": SpeculativeConfig.from_dict,
    "from_json": lambda d: SpeculativeConfig.from_json(json.dumps(d)),
    "from_cli": lambda d: SpeculativeConfig.from_cli(json.dumps(d)),
    "coerce": SpeculativeConfig.coerce,
}


@pytest.fixture(params=sorted(CONSTRUCTORS))
def build(request):
    """Each named constructor, taking a dict (JSON-encoded for the string ones)."""
    return CONSTRUCTORS[request.param]


# ------------------------------------------------------------------ SpeculativeConfig
def test_happy_paths_agree():
    d = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    cfg = SpeculativeConfig.from_dict(d)
    assert cfg.num_speculative_tokens == 4 and cfg.method == "ngram"
    assert cfg.prompt_lookup_min == 1 and cfg.prompt_lookup_max == 3
    assert cfg.acceptance_method == "rejection_sampler" and cfg.draft_sample_method == "sample"
    assert cfg.options == {}
    text = json.dumps(d)
    assert SpeculativeConfig.from_json(text) == cfg
    assert SpeculativeConfig.from_cli(text) == cfg
    assert SpeculativeConfig.coerce(text) == cfg
    assert SpeculativeConfig.coerce(d) == cfg
    assert SpeculativeConfig.coerce(cfg) is cfg
    assert SpeculativeConfig.from_dict(cfg) is cfg
    assert SpeculativeConfig.from_dict(cfg.to_dict()) == cfg
    # a model alone is enough (method detected later); "[ngram]" is the vLLM spelling
    m = SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 2})
    assert m.method is None and m.model_is_ngram
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        cfg.num_speculative_tokens = 5  # type: ignore[misc]


@pytest.mark.parametrize("value", [None, "", "   ", "\n"])
def test_from_cli_empty_means_off(value):
    assert SpeculativeConfig.from_cli(value) is None
    if value is None:
        assert SpeculativeConfig.coerce(value) is None


def test_options_are_copied_into_a_dict():
    opts = {"num_layers": 1}
    cfg = SpeculativeConfig.from_dict({"method": "draft_model", "model": "x", "num_speculative_tokens": 2,
                                       "options": opts})
    assert cfg.options == opts and cfg.options is not opts


def test_unknown_key_lists_valid_keys(build):
    with pytest.raises(ConfigError, match=r"unknown speculative config key\(s\): num_spec_tokens; valid keys: ") as exc:
        build({"method": "ngram", "num_speculative_tokens": 3, "num_spec_tokens": 3})
    msg = str(exc.value)
    for key in SpeculativeConfig.valid_keys():
        assert key in msg
    assert "num_speculative_tokens" in msg and "prompt_lookup_max" in msg


def test_several_unknown_keys_are_all_named():
    with pytest.raises(ConfigError, match=r"key\(s\): draft_model, speculative_model; valid keys"):
        SpeculativeConfig.from_dict({"speculative_model": "x", "draft_model": "y", "num_speculative_tokens": 3})


def test_tensor_parallel_size_points_to_draft_tensor_parallel_size(build):
    with pytest.raises(ConfigError, match=r"'tensor_parallel_size' is not a speculative config key.*"
                                          r"'draft_tensor_parallel_size' \(1 or the target's\)"):
        build({"method": "ngram", "num_speculative_tokens": 3, "tensor_parallel_size": 2})


def test_num_speculative_tokens_missing(build):
    with pytest.raises(ConfigError, match="num_speculative_tokens is required"):
        build({"method": "ngram"})


@pytest.mark.parametrize("k", [0, -1, 2.5, "3", True, None])
def test_num_speculative_tokens_must_be_a_positive_integer(build, k):
    with pytest.raises(ConfigError, match=r"num_speculative_tokens must be an integer >= 1, got " + re.escape(repr(k))):
        build({"method": "ngram", "num_speculative_tokens": k})


def test_direct_construction_checks_too():
    with pytest.raises(ConfigError, match="num_speculative_tokens must be an integer >= 1, got 0"):
        SpeculativeConfig(num_speculative_tokens=0, method="ngram")


def test_prompt_lookup_min_above_max(build):
    with pytest.raises(ConfigError, match=r"prompt_lookup_min \(5\) must be <= prompt_lookup_max \(2\)"):
        build({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 2})
    # equal is fine
    build({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 2})


@pytest.mark.parametrize("field", ["prompt_lookup_min", "prompt_lookup_max", "draft_tensor_parallel_size",
                                   "max_model_len"])
@pytest.mark.parametrize("value", [0, -1, "2", 1.5, True])
def test_positive_integer_fields(build, field, value):
    with pytest.raises(ConfigError, match=rf"{field} must be >= 1 \(an integer\), got {re.escape(repr(value))}$"):
        build({"method": "ngram", "num_speculative_tokens": 3, field: value})


def test_draft_sample_method(build):
    with pytest.raises(ConfigError, match="draft_sample_method must be one of sample, greedy, got 'beam'"):
        build({"method": "draft_model", "model": "x", "num_speculative_tokens": 3, "draft_sample_method": "beam"})
    cfg = build({"method": "draft_model", "model": "x", "num_speculative_tokens": 3, "draft_sample_method": "greedy"})
    assert cfg.draft_sample_method == "greedy"


def test_from_verdict(build):
    with pytest.raises(ConfigError, match="from_verdict must be one of off, draft, forward, got 'yes'"):
        build({"method": "ngram", "num_speculative_tokens": 3, "from_verdict": "yes"})
    assert build({"method": "ngram", "num_speculative_tokens": 3}).from_verdict is None  # the method's choice
    assert build({"method": "ngram", "num_speculative_tokens": 3, "from_verdict": "forward"}).from_verdict == "forward"


def test_method_or_model_needed(build):
    with pytest.raises(ConfigError, match="needs a 'method' or a 'model'"):
        build({"num_speculative_tokens": 3})


@pytest.mark.parametrize("field", ["method", "model", "acceptance_method"])
def test_string_fields(build, field):
    with pytest.raises(ConfigError, match=rf"{field} must be a string, got 3"):
        build({"method": "ngram", "model": "ngram", "num_speculative_tokens": 3, field: 3})


@pytest.mark.parametrize("options", [None, [1, 2], "num_layers=1", 3])
def test_options_must_be_an_object(build, options):
    if options is None:  # null means no options
        cfg = build({"method": "ngram", "num_speculative_tokens": 3, "options": None})
        assert cfg.options == {}
        return
    with pytest.raises(ConfigError, match="options must be a JSON object / dict"):
        build({"method": "ngram", "num_speculative_tokens": 3, "options": options})


@pytest.mark.parametrize("options", [None, [1, 2], "posterior_alpha=0.3", 3])
def test_verifier_options_must_be_an_object(build, options):
    if options is None:  # null means no options
        cfg = build({"method": "ngram", "num_speculative_tokens": 3, "verifier_options": None})
        assert cfg.verifier_options == {}
        return
    with pytest.raises(ConfigError, match="verifier_options must be a JSON object / dict of the verifier's"):
        build({"method": "ngram", "num_speculative_tokens": 3, "verifier_options": options})


def test_verifier_options_round_trip():
    d = {"method": "ngram", "num_speculative_tokens": 3, "acceptance_method": "x", "verifier_options": {"a": 1}}
    cfg = SpeculativeConfig.from_dict(d)
    assert cfg.verifier_options == {"a": 1} and SpeculativeConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("text", ["{method: ngram}", "{\"method\": \"ngram\",}", "ngram", "{"])
def test_invalid_json(text):
    """Each parser names what the user wrote: the CLI flag, or the Python argument."""
    for parse, name in ((SpeculativeConfig.from_json, "the speculative config"),
                        (SpeculativeConfig.from_cli, "--speculative-config"),
                        (SpeculativeConfig.coerce, "speculative_config")):
        with pytest.raises(ConfigError, match=f"^{name} is not valid JSON"):
            parse(text)


@pytest.mark.parametrize("value", ["[1, 2]", "3", "\"ngram\"", "null"])
def test_json_must_be_an_object(value):
    with pytest.raises(ConfigError, match=r"must be a JSON object / dict, got"):
        SpeculativeConfig.from_json(value)
    with pytest.raises(ConfigError, match=r"must be a JSON object / dict, got list"):
        SpeculativeConfig.from_dict([("method", "ngram")])


# --------------------------------------------------------------------- through the engine
class _NullProposer:
    def propose(self, batch):
        return Draft.empty(len(batch.seqs))

    def observe(self, feedback):
        pass


@attrs.frozen
class _Opts:
    window: int = 4
    mode: str = attrs.field(default="fast", validator=attrs.validators.in_(("fast", "slow")))


@attrs.frozen
class _VOpts:
    strictness: float = attrs.field(default=0.5, validator=attrs.validators.le(1.0))


class _LossyGreedy(GreedyVerifier):
    lossless = False

    def __init__(self, opts: _VOpts):
        self.opts = opts


class _TestPlugin:
    """An in-process plugin: a method per situation the engine must check, and a lossy
    verifier with options."""

    def __init__(self):
        self.contexts: list[ProposerContext] = []

    def _factory(self, ctx):
        self.contexts.append(ctx)
        return _NullProposer()

    @speculum.hookimpl
    def speculum_register_proposers(self, register):
        register("nullmethod", self._factory, description="drafts nothing")
        register("jaxonly", self._factory, backends=("jax",))
        register("withopts", self._factory, backends=("torch", "jax"), options=_Opts)

    @speculum.hookimpl
    def speculum_register_verifiers(self, register):
        register("lossy_greedy", _LossyGreedy, lossless=False, options=_VOpts, description="pretends to be lossy")


def _llm(model, spec, plugin=None, **kw):
    return speculum.LLM(model=str(model), speculative_config=spec, device="cpu",
                        plugins=[plugin or _TestPlugin()], **kw)


def test_engine_happy_path_with_plugin_options(tiny_llama):
    plugin = _TestPlugin()
    llm = _llm(tiny_llama, {"method": "withopts", "num_speculative_tokens": 3,
                            "options": {"window": 8}, "draft_tensor_parallel_size": 1}, plugin)
    (ctx,) = plugin.contexts
    assert ctx.options == _Opts(window=8)
    assert ctx.vocab_size == 512
    assert llm.speculative_config.num_speculative_tokens == 3
    assert llm.method_spec.name == "withopts"
    assert llm.verifier_spec.name == "rejection_sampler"
    # the same config as a JSON string
    plugin2 = _TestPlugin()
    _llm(tiny_llama, json.dumps({"method": "withopts", "num_speculative_tokens": 2}), plugin2)
    assert plugin2.contexts[0].options == _Opts()


def test_engine_config_errors_come_before_model_loading(tmp_path):
    # the model path does not even exist: the config is checked first
    with pytest.raises(ConfigError, match="unknown speculative config key"):
        speculum.LLM(model=str(tmp_path / "missing"), speculative_config={"num_speculative_tokens": 3, "k": 1})
    with pytest.raises(ConfigError, match="not valid JSON"):
        speculum.LLM(model=str(tmp_path / "missing"), speculative_config="{bad json")


def test_unknown_method_lists_installed_methods(tiny_llama):
    with pytest.raises(ConfigError, match=r"unknown speculative method 'medusa2'; installed methods: ") as exc:
        _llm(tiny_llama, {"method": "medusa2", "num_speculative_tokens": 3})
    msg = str(exc.value)
    for name in ("nullmethod", "jaxonly", "withopts"):
        assert name in msg
    assert "pip install" in msg


def test_draft_tensor_parallel_size_must_be_1_or_targets(tiny_llama):
    with pytest.raises(ConfigError, match=r"draft_tensor_parallel_size must be 1 or the target's "
                                          r"tensor_parallel_size \(1\), got 2"):
        _llm(tiny_llama, {"method": "nullmethod", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2})


def test_target_tensor_parallel_size(tiny_llama):
    with pytest.raises(ConfigError, match="tensor_parallel_size > 1 is not supported yet"):
        _llm(tiny_llama, None, tensor_parallel_size=2)


def test_method_for_another_backend_names_supported_backends(tiny_llama):
    with pytest.raises(ConfigError, match=r"method 'jaxonly' .*has no implementation for backend 'torch'; "
                                          r"it supports: jax\."):
        _llm(tiny_llama, {"method": "jaxonly", "num_speculative_tokens": 3})


def test_unknown_backend(tiny_llama):
    with pytest.raises(ConfigError, match=r"unknown backend 'nope'; installed backends: .*torch"):
        _llm(tiny_llama, {"method": "jaxonly", "num_speculative_tokens": 3}, backend="nope")


def test_plugin_options_unknown_key_lists_valid_options(tiny_llama):
    with pytest.raises(ConfigError, match=r"unknown option\(s\) bogus for method 'withopts'; "
                                          r"valid options: window, mode"):
        _llm(tiny_llama, {"method": "withopts", "num_speculative_tokens": 3, "options": {"bogus": 1}})


def test_plugin_options_invalid_value(tiny_llama):
    with pytest.raises(ConfigError, match=r"invalid options for method 'withopts': .*mode"):
        _llm(tiny_llama, {"method": "withopts", "num_speculative_tokens": 3, "options": {"mode": "warp"}})


def test_options_for_a_method_without_options(tiny_llama):
    with pytest.raises(ConfigError, match=r"method 'nullmethod' takes no options, got: window"):
        _llm(tiny_llama, {"method": "nullmethod", "num_speculative_tokens": 3, "options": {"window": 2}})


def test_unknown_acceptance_method_lists_verifiers(tiny_llama):
    with pytest.raises(ConfigError, match=r"unknown acceptance_method 'typical'; installed "
                                          r"verifiers: block, exact_match, greedy, greedy_jax, lossy_greedy, rejection_sampler"):
        _llm(tiny_llama, {"method": "nullmethod", "num_speculative_tokens": 3, "acceptance_method": "typical"})


def test_verifier_options_reach_the_verifier_and_a_lossy_verifier_is_labelled(tiny_llama, caplog):
    import logging
    with caplog.at_level(logging.INFO, logger="speculum"):
        llm = _llm(tiny_llama, {"method": "nullmethod", "num_speculative_tokens": 2,
                                "acceptance_method": "lossy_greedy", "verifier_options": {"strictness": 0.25}})
    assert isinstance(llm.verifier, _LossyGreedy) and llm.verifier.opts == _VOpts(0.25)
    assert not llm.verifier_spec.lossless
    assert any("'lossy_greedy'" in r.message and "LOSSY" in r.message and r.levelname == "WARNING"
               for r in caplog.records)
    assert any("verifier=lossy_greedy (LOSSY)" in r.message for r in caplog.records)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, speculum.SamplingParams(temperature=0, max_tokens=3))[0]
    assert out.metrics.as_dict()["lossless"] is False and llm.metrics.as_dict()["lossless"] is False
    # the default: lossless, and said so
    llm = _llm(tiny_llama, {"method": "nullmethod", "num_speculative_tokens": 2})
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, speculum.SamplingParams(temperature=0, max_tokens=3))[0]
    assert out.metrics.as_dict()["lossless"] is True and llm.metrics.lossless
    # merging a lossy request's metrics makes the total lossy
    total = speculum.SpecDecodeMetrics()
    total.merge(speculum.SpecDecodeMetrics(lossless=False))
    assert not total.lossless


def test_verifier_options_are_validated(tiny_llama):
    base = {"method": "nullmethod", "num_speculative_tokens": 2, "acceptance_method": "lossy_greedy"}
    with pytest.raises(ConfigError, match=r"unknown option\(s\) bogus for verifier 'lossy_greedy'; "
                                          r"valid options: strictness"):
        _llm(tiny_llama, {**base, "verifier_options": {"bogus": 1}})
    with pytest.raises(ConfigError, match=r"invalid options for verifier 'lossy_greedy': .*strictness"):
        _llm(tiny_llama, {**base, "verifier_options": {"strictness": 2.0}})
    with pytest.raises(ConfigError, match=r"verifier 'rejection_sampler' takes no options, got: strictness"):
        _llm(tiny_llama, {"method": "nullmethod", "num_speculative_tokens": 2,
                          "verifier_options": {"strictness": 0.1}})


def test_ngram_model_with_another_method(tiny_llama):
    with pytest.raises(ConfigError, match=r"model 'ngram' means method 'ngram', but method is 'nullmethod'"):
        _llm(tiny_llama, {"method": "nullmethod", "model": "ngram", "num_speculative_tokens": 3})


def test_check_vocab_message(tiny_llama):
    """The check every draft-model method calls (ProposerContext.check_vocab)."""
    cfg = SpeculativeConfig.from_dict({"method": "x", "num_speculative_tokens": 3})
    ctx = ProposerContext(config=cfg, options=None, backend=None, target=None, target_path=tiny_llama,
                          vocab_size=512, tokenizer=None, max_model_len=128)
    ctx.check_vocab(512)
    with pytest.raises(ConfigError, match=r"draft model vocabulary size 600 differs from the target's 512"):
        ctx.check_vocab(600)
    with pytest.raises(ConfigError, match=r"method 'x' needs 'model'"):
        ctx.resolve_draft_path()


def test_draft_vocabulary_mismatch(tiny_llama, tmp_path):
    pytest.importorskip("speculum_draft_model")
    from speculum.testing import tiny_model_dir
    draft = tiny_model_dir(tmp_path / "draft600", "llama", vocab_size=600)
    with pytest.raises(ConfigError, match="vocabulary") as exc:
        speculum.LLM(model=str(tiny_llama), device="cpu", speculative_config={
            "method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    assert "600" in str(exc.value) and "512" in str(exc.value)
