"""SpeculativeConfig: what users write in ``speculative_config`` / ``--speculative-config``.

Field names follow vLLM's so existing configs carry over. Checks that need nothing but the
config run here; checks that need the target (vocabulary, tensor parallel size, installed
methods) run when the engine is built (:func:`speculum.engine_build.resolve_method`).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import attrs

from speculum.errors import ConfigError
from speculum.spec_length import parse_schedule

NGRAM_ALIASES = ("ngram", "[ngram]")
DRAFT_SAMPLE_METHODS = ("sample", "greedy")
#: what a step launches from the verifier's verdict while it is still on the device
FROM_VERDICT = ("off", "draft", "forward")


def _positive_or_none(_inst, attribute, value):
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{attribute.name} must be >= 1 (an integer), got {value!r}")


def _str_or_none(_inst, attribute, value):
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{attribute.name} must be a string, got {value!r}")


def _options_converter(key: str, whose: str):
    def convert(value) -> dict[str, Any]:
        """JSON null means no options; anything but an object is an error (not a TypeError)."""
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} must be a JSON object / dict of the {whose} options, got {type(value).__name__}")
        return dict(value)
    return convert


_to_options = _options_converter("options", "method's")
_to_verifier_options = _options_converter("verifier_options", "verifier's (acceptance_method's)")


@attrs.frozen
class SpeculativeConfig:
    """Speculative decoding settings (immutable).

    Build it with :meth:`from_dict`, :meth:`from_json` or :meth:`from_cli`; these reject
    unknown keys with the list of valid ones.
    """

    #: number of draft tokens proposed per step (k); with a tree, its number of nodes
    #: (derived when left out)
    num_speculative_tokens: int | None = None
    #: method name ("ngram", "draft_model", or a plugin's); None = detect from ``model``
    method: str | None = attrs.field(default=None, validator=_str_or_none)
    #: draft checkpoint (directory or GGUF), or "ngram"/"[ngram]"
    model: str | None = attrs.field(default=None, validator=_str_or_none)
    #: tensor parallel size of the draft: 1 or the target's
    draft_tensor_parallel_size: int | None = attrs.field(default=None, validator=_positive_or_none)
    #: ngram: shortest suffix to match
    prompt_lookup_min: int | None = attrs.field(default=None, validator=_positive_or_none)
    #: ngram: longest suffix to match
    prompt_lookup_max: int | None = attrs.field(default=None, validator=_positive_or_none)
    #: verifier name: "rejection_sampler" (default, lossless), "greedy", or a plugin's
    acceptance_method: str = attrs.field(default="rejection_sampler", validator=_str_or_none)
    #: how model drafts pick tokens for sampled requests: "sample" (from the draft
    #: distribution, with its probabilities) or "greedy" (draft argmax, one-hot)
    draft_sample_method: str = "sample"
    #: longest sequence (prompt + output) the draft must handle; None = the target's
    max_model_len: int | None = attrs.field(default=None, validator=_positive_or_none)
    #: plugin-specific options, validated by the method's own options class
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=_to_options)
    #: options of the verifier (``acceptance_method``), validated by the verifier's own class
    verifier_options: Mapping[str, Any] = attrs.field(factory=dict, converter=_to_verifier_options)
    #: a static token tree: paths of top-k ranks, e.g. [[0], [1], [0, 0]] (vLLM's key,
    #: Medusa's ``medusa_choices`` form); see docs/trees.md
    speculative_token_tree: Any = None
    #: a dynamic (EAGLE-2) tree, SGLang's meaning: children per expanded node
    #: (speculative_eagle_topk), expansion steps (speculative_num_steps), tokens verified
    #: per step including the root (speculative_num_draft_tokens)
    tree_topk: int | None = None
    tree_depth: int | None = None
    num_draft_tokens: int | None = None
    #: k by batch size: {"1-16": 3, "64-128": 2, "256-4096": 0} (inclusive ranges; a gap
    #: takes the range before it; k clamped to num_speculative_tokens, 0 = off), the list
    #: form [[1, 16, 3], ...], or "auto" (k chosen per step by a cost model of this
    #: machine); None = always num_speculative_tokens. See speculum.spec_length.
    num_speculative_tokens_per_batch_size: Any = None
    #: vLLM's older switch: no drafts once this many requests run together (the same as
    #: {"1-(N-1)": k, "N-...": 0}); not together with num_speculative_tokens_per_batch_size
    disable_by_batch_size: int | None = attrs.field(default=None, validator=_positive_or_none)
    #: what the next step launches from the verdict still on the device, before the host reads
    #: it (CUDA with overlap; methods whose proposer is a VerdictDrafter: the heads, n-gram):
    #: "draft" the next drafts, "forward" the drafts and the target's verify forward too,
    #: "off" nothing (drafting waits for the host's copy). None (default): the method's own
    #: choice (its proposer's ``from_verdict_default``: "forward" for n-gram, whose device
    #: lookup is one kernel; else "draft": a head's drafting graph already fills the copy's
    #: wait, and "forward" was 2-4% slower on the H200). The outputs are the same for every
    #: value; see docs/architecture.md, "Overlap".
    from_verdict: str | None = None

    def __attrs_post_init__(self):
        from speculum.tree import tree_from_config
        tree = tree_from_config(self.speculative_token_tree, self.tree_topk, self.tree_depth, self.num_draft_tokens,
                                self.num_speculative_tokens)
        if tree is not None:
            if tree.is_static:  # normalised: sorted breadth first, as lists (JSON-able)
                object.__setattr__(self, "speculative_token_tree", [list(p) for p in tree.paths])
            object.__setattr__(self, "num_speculative_tokens", tree.num_nodes)
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ConfigError(
                f"num_speculative_tokens must be an integer >= 1, got {k!r}; it is the number "
                "of draft tokens per step (3-5 is a good start)"
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is not None and hi is not None and lo > hi:
            raise ConfigError(
                f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})"
            )
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ConfigError(
                f"draft_sample_method must be one of {', '.join(DRAFT_SAMPLE_METHODS)}, "
                f"got {self.draft_sample_method!r}"
            )
        if self.from_verdict is not None and self.from_verdict not in FROM_VERDICT:
            raise ConfigError(f"from_verdict must be one of {', '.join(FROM_VERDICT)}, got {self.from_verdict!r} "
                              "(what the next step launches from the verdict still on the device)")
        parse_schedule(self.num_speculative_tokens_per_batch_size, k)  # raises ConfigError when malformed
        if self.disable_by_batch_size is not None and self.num_speculative_tokens_per_batch_size is not None:
            raise ConfigError("give num_speculative_tokens_per_batch_size or disable_by_batch_size, not both "
                              f"(disable_by_batch_size={self.disable_by_batch_size} is the ranges "
                              f'{{"1-{self.disable_by_batch_size - 1}": {k}, "{self.disable_by_batch_size}-1000000": 0}})')
        if self.method is None and self.model is None:
            raise ConfigError(
                "speculative config needs a 'method' or a 'model' (a draft checkpoint, or "
                "'ngram' for prompt lookup)"
            )

    # -- named constructors -------------------------------------------------------
    @classmethod
    def valid_keys(cls) -> list[str]:
        return [a.name for a in attrs.fields(cls)]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SpeculativeConfig":
        if isinstance(data, SpeculativeConfig):
            return data
        if not isinstance(data, Mapping):
            raise ConfigError(f"speculative config must be a JSON object / dict, got {type(data).__name__}")
        data = dict(data)
        if "tensor_parallel_size" in data:
            raise ConfigError(
                "'tensor_parallel_size' is not a speculative config key: the draft's tensor "
                "parallel size is 'draft_tensor_parallel_size' (1 or the target's)"
            )
        valid = cls.valid_keys()
        unknown = sorted(set(data) - set(valid))
        if unknown:
            raise ConfigError(
                f"unknown speculative config key(s): {', '.join(unknown)}; valid keys: "
                f"{', '.join(valid)}"
            )
        tree_keys = ("speculative_token_tree", "tree_topk", "tree_depth", "num_draft_tokens")
        if "num_speculative_tokens" not in data and not any(data.get(key) is not None for key in tree_keys):
            raise ConfigError(
                "num_speculative_tokens is required: the number of draft tokens per step "
                "(e.g. {\"method\": \"ngram\", \"num_speculative_tokens\": 4})"
            )
        return cls(**data)

    @classmethod
    def from_json(cls, text: str, source: str = "the speculative config") -> "SpeculativeConfig":
        """Parse a JSON object; ``source`` names where it came from in errors (the CLI flag,
        the Python argument), so each user sees the name they wrote."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{source} is not valid JSON ({exc}): {text!r}; write a JSON object such as "
                              '{"method": "ngram", "num_speculative_tokens": 4}') from exc
        return cls.from_dict(data)

    @classmethod
    def from_cli(cls, value: str | None, flag: str = "--speculative-config") -> "SpeculativeConfig | None":
        """Parse the ``--speculative-config`` flag (a JSON object); None/empty means off."""
        if value is None or not value.strip():
            return None
        return cls.from_json(value, source=flag)

    @classmethod
    def coerce(cls, value: "SpeculativeConfig | Mapping[str, Any] | str | None",
               source: str = "speculative_config") -> "SpeculativeConfig | None":
        """Accept a config object, a dict, a JSON string or None (``source``: the name of
        the argument, for errors)."""
        if value is None:
            return None
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            return cls.from_json(value, source=source)
        return cls.from_dict(value)

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @property
    def tree(self):
        """The :class:`speculum.tree.TreeSpec` to draft, or None (chains)."""
        from speculum.tree import tree_from_config
        return tree_from_config(self.speculative_token_tree, self.tree_topk, self.tree_depth, self.num_draft_tokens)

    # -- derived ------------------------------------------------------------------
    @property
    def length_schedule(self):
        """The parsed ``num_speculative_tokens_per_batch_size``: None, ``"auto"`` or
        sorted ``((lo, hi, k), ...)`` with k clamped to ``num_speculative_tokens``."""
        n = self.disable_by_batch_size
        if n is not None:
            return ((1, n - 1, self.num_speculative_tokens), (n, 1 << 30, 0)) if n > 1 else ((1, 1 << 30, 0),)
        return parse_schedule(self.num_speculative_tokens_per_batch_size, self.num_speculative_tokens)

    @property
    def model_is_ngram(self) -> bool:
        return self.model is not None and self.model.lower() in NGRAM_ALIASES
