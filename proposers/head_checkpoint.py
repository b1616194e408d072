"""Reading and writing draft-head checkpoints, and finding the heads a plugin ships.

Checkpoints are directories with a ``config.json`` and weights in safetensors files or
PyTorch pickles (``pytorch_model.bin``, ``*.pt``). Heads shipped as package data carry a
``"speculum"`` entry in their config with a fingerprint of the target they were trained
for, so a method with no ``model`` picks the right head (or says none fits).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from speculum.errors import ConfigError, ModelLoadError

log = logging.getLogger(__name__)


def read_config(path: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a checkpoint directory ({} when there is none)."""
    path = Path(path)
    f = path / "config.json" if path.is_dir() else path.parent / "config.json"
    if not f.exists():
        return {}
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{f} is not valid JSON: {exc}") from exc


def _weight_files(path: Path, names: Iterable[str] = ()) -> list[Path]:
    if path.is_file():
        return [path]
    for n in names:  # a preferred file name (e.g. medusa_lm_head.safetensors) wins
        if (path / n).exists():
            return [path / n]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        files = sorted(path.glob("pytorch_model*.bin")) or sorted(path.glob("*.pt")) or sorted(path.glob("*.bin"))
    return files


def read_weights(path: str | Path, names: Iterable[str] = (), prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint whose names start with ``prefix`` (all by default), on
    the CPU; safetensors are preferred over pickles and read lazily, tensor by tensor."""
    path = Path(path)
    files = _weight_files(path, names)
    if not files:
        raise ModelLoadError(f"no weights (*.safetensors, pytorch_model.bin, *.pt) in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        if f.suffix == ".safetensors":
            from safetensors import safe_open
            with safe_open(str(f), "pt") as h:
                for k in h.keys():
                    if k.startswith(prefix):
                        state[k] = h.get_tensor(k)
        else:
            obj = torch.load(str(f), map_location="cpu", weights_only=True)
            obj = obj.get("state_dict", obj) if isinstance(obj, dict) else {}
            state.update({k: v for k, v in obj.items() if k.startswith(prefix)})
    return state


def weight_names(path: str | Path) -> set[str]:
    """Tensor names of a checkpoint without reading the tensors (cheap; for detection)."""
    path = Path(path)
    if not path.exists():
        return set()
    names: set[str] = set()
    for f in _weight_files(path):
        try:
            if f.suffix == ".safetensors":
                from safetensors import safe_open
                with safe_open(str(f), "pt") as h:
                    names.update(h.keys())
            else:
                obj = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
                names.update(obj.keys() if isinstance(obj, dict) else ())
        except Exception as exc:  # detection must never break construction
            log.debug("could not list weights of %s: %s", f, exc)
    return names


def write_checkpoint(path: str | Path, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                     filename: str = "model.safetensors", dtype: torch.dtype | None = None) -> Path:
    """Write ``config.json`` and one safetensors file; floats cast to ``dtype`` if given."""
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    out = {}
    for n, t in tensors.items():
        t = t.detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[n] = t.contiguous()
    save_file(out, str(path / filename), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(dict(config), indent=2) + "\n")
    return path


# -- the target a head belongs to ---------------------------------------------------------------
def target_fingerprint(embed: torch.Tensor, name: str | None = None, num_layers: int | None = None) -> dict:
    """Shape and a checksum of the target's embedding (robust to fp32/bf16 copies)."""
    rows = embed[:1024].detach().double()
    return {"name": name, "vocab_size": int(embed.shape[0]), "hidden_size": int(embed.shape[1]),
            "num_hidden_layers": num_layers, "embed_abs_mean": float(rows.abs().mean()),
            "embed_mean": float(rows.mean())}


def checkpoint_embedding(path: str | Path) -> tuple[torch.Tensor | None, int | None]:
    """The token embedding of the checkpoint at ``path`` (None without one) and its number of
    layers (``num_hidden_layers`` of its config): what :func:`target_fingerprint` takes of a target."""
    key = "model.embed_tokens.weight"
    return read_weights(path, prefix=key).get(key), read_config(path).get("num_hidden_layers")


def fingerprint_matches(want: Mapping[str, Any], have: Mapping[str, Any]) -> bool:
    for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if want.get(key) is not None and have.get(key) is not None and want[key] != have[key]:
            return False
    a, b = want.get("embed_abs_mean"), have.get("embed_abs_mean")
    if a is None or b is None or abs(a - b) > 2e-3 * abs(a):
        return False
    return abs(want.get("embed_mean", 0.0) - have.get("embed_mean", 0.0)) <= 2e-3 * abs(a)


def find_shipped_head(root: Path, method: str, fingerprint: Mapping[str, Any]) -> Path | None:
    """The head under ``root`` (package data) made for ``method`` and this target, if any."""
    if not root.is_dir():
        return None
    for d in sorted(p for p in root.iterdir() if (p / "config.json").exists()):
        meta = read_config(d).get("speculum", {})
        if meta.get("method") == method and fingerprint_matches(meta.get("target", {}), fingerprint):
            return d
    return None


def shipped_names(root: Path, method: str) -> list[str]:
    """Targets the shipped heads of ``method`` were made for (for error messages)."""
    if not root.is_dir():
        return []
    out = []
    for d in sorted(p for p in root.iterdir() if (p / "config.json").exists()):
        meta = read_config(d).get("speculum", {})
        if meta.get("method") == method:
            out.append(meta.get("target", {}).get("name") or d.name)
    return out
