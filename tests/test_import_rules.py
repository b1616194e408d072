"""The architecture's import rules, enforced (docs/architecture.md, "Import rules").

- core/, proposers/ and verifiers/ never import a backend's internals: at most a
  backend's package itself (``speculum.backends.torch``, its public API).
- Plugins import only documented public modules of speculum.
- Production code never imports ``speculum.testing``.
- No import circles between speculum's modules (imports at module level).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: source folder -> the import package it becomes (pyproject's package-dir)
LAYOUT = {"core": "speculum", "proposers": "speculum.proposers", "verifiers": "speculum.verifiers",
          "backends": "speculum.backends"}
#: what plugins may import from speculum (documented in docs/plugins.md)
PUBLIC = ("speculum", "speculum.interfaces", "speculum.errors", "speculum.hooks", "speculum.config",
          "speculum.sampling", "speculum.context", "speculum.datasets", "speculum.kv", "speculum.tree",
          "speculum.proposers", "speculum.verifiers", "speculum.train", "speculum.backends.torch",
          "speculum.backends.torch.heads")


def _modules() -> dict[str, Path]:
    out = {}
    for folder, pkg in LAYOUT.items():
        for f in (REPO / folder).rglob("*.py"):
            rel = f.relative_to(REPO / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = f
    return out


def _imports(path: Path, module_level_only: bool = False) -> list[tuple[str, int]]:
    """Modules imported by a file (absolute names), with line numbers."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    if module_level_only:  # module-level, including inside top-level if/try blocks
        nodes = [n for top in tree.body for n in ast.walk(top)
                 if not isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        nodes += [n for top in tree.body if isinstance(top, ast.ClassDef) for n in top.body
                  if isinstance(n, (ast.Import, ast.ImportFrom))]
    out = []
    for n in nodes:
        if isinstance(n, ast.Import):
            out += [(a.name, n.lineno) for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            out.append((n.module, n.lineno))
            out += [(f"{n.module}.{a.name}", n.lineno) for a in n.names]  # "from pkg import submodule"
    return out


def _type_checking_lines(path: Path) -> set[int]:
    tree = ast.parse(path.read_text())
    lines = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            for m in ast.walk(n):
                if hasattr(m, "lineno"):
                    lines.add(m.lineno)
    return lines


def _is_backend_internal(name: str) -> bool:
    parts = name.split(".")
    return len(parts) > 3 and parts[:2] == ["speculum", "backends"]


def _module_of(name: str, known) -> str:
    """The module an imported name lives in: ``from pkg import Name`` imports from ``pkg``
    (unless ``pkg.Name`` is itself a module)."""
    if name not in known and name.rsplit(".", 1)[0] in known:
        return name.rsplit(".", 1)[0]
    return name


def test_core_and_proposers_never_import_backend_internals():
    known = set(_modules())
    bad = []
    for mod, path in _modules().items():
        if mod.startswith("speculum.backends") or mod == "speculum.testing":
            continue
        for name, line in _imports(path):
            if _is_backend_internal(_module_of(name, known)):
                bad.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    assert not bad, "core/proposers/verifiers reach into a backend:\n" + "\n".join(bad)


def _plugin_files():
    for f in (REPO / "plugins").glob("*/speculum_*/*.py"):
        yield f


def test_plugins_import_only_public_modules():
    known = set(_modules())
    bad = []
    for f in _plugin_files():
        for name, line in _imports(f):
            if not name.startswith("speculum.") and name != "speculum":
                continue
            name = _module_of(name, known)  # "from speculum.x import Name": the module is speculum.x
            if name not in PUBLIC and not any(name.startswith(p + ".") for p in PUBLIC if p in (
                    "speculum.proposers", "speculum.train")):
                bad.append(f"{f.relative_to(REPO)}:{line} imports {name}")
    assert not bad, "plugins import private modules:\n" + "\n".join(bad)


def test_a_plugin_importing_a_private_module_is_caught(tmp_path):
    f = tmp_path / "speculum_x" / "bad.py"
    f.parent.mkdir()
    f.write_text("from speculum.backends.torch.native.arch import LlamaArch\n")
    names = [n for n, _ in _imports(f)]
    assert any(_is_backend_internal(n) for n in names)
    assert "speculum.backends.torch.native.arch" not in PUBLIC


def test_names_from_a_backend_package_are_public_but_its_submodules_are_not():
    known = set(_modules())
    assert not _is_backend_internal(_module_of("speculum.backends.torch.TorchBackend", known))
    assert _is_backend_internal(_module_of("speculum.backends.torch.native", known))
    assert _is_backend_internal(_module_of("speculum.backends.torch.native.arch.LlamaArch", known))


def test_production_code_never_imports_testing():
    bad = [f"{p.relative_to(REPO)}:{line}" for mod, p in _modules().items() if mod != "speculum.testing"
           for name, line in _imports(p) if name == "speculum.testing"]
    bad += [f"{f.relative_to(REPO)}:{line}" for f in _plugin_files() for name, line in _imports(f)
            if name == "speculum.testing"]
    assert not bad, bad


def test_no_import_circles():
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        skip = _type_checking_lines(path)
        deps = set()
        for name, line in _imports(path, module_level_only=True):
            if line in skip:
                continue
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != mod:
                deps.add(name)
        graph[mod] = deps
    # Tarjan's strongly connected components
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))
    import sys
    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    # a package's __init__ importing its own submodules is how packages work, not a circle
    real = [c for c in comps if not all(m.startswith(min(c, key=len)) for m in c)]
    assert not real, "import circles:\n" + "\n".join(" -> ".join(c) for c in real)
