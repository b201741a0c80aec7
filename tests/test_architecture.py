"""The import contract of docs/ARCHITECTURE.md, checked over the source's `ast`.

Layers point one way: core <- backends (xla, litert) <- report <- face
(`odmlq/__init__.py`, `odmlq/cli.py`, `odmlq/targets.py`). Every import statement counts, the ones
inside functions too (they are where cycles hide).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "odmlq"
FACE = {"odmlq", "odmlq.cli", "odmlq.targets"}
BACKENDS = ("odmlq.xla", "odmlq.litert")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> list[tuple[str, tuple[str, ...], int]]:
    """(imported module, names taken from it, line) for every import in a file.

    ``from package import submodule`` counts as an import of the submodule's file.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    # `if TYPE_CHECKING:` imports never run: annotations only.
    typing_only = {id(n) for block in ast.walk(tree)
                   if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING"
                   for n in ast.walk(block)}
    out = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, (), node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = tuple(a.name for a in node.names)
            submodules = [n for n in names if f"{base}.{n}" in MODULES]
            if submodules:
                out += [(f"{base}.{n}", (), node.lineno) for n in submodules]
            rest = tuple(n for n in names if n not in submodules)
            if rest or not submodules:
                out.append((base, rest, node.lineno))
    return out


def _layer(module: str) -> str:
    if module in FACE:
        return "face"
    if module == "odmlq.report" or module.startswith("odmlq.report."):
        return "report"
    if module == "odmlq.training" or module.startswith("odmlq.training."):
        return "training"
    for backend in BACKENDS:
        if module == backend or module.startswith(backend + "."):
            return backend.split(".")[1]
    return "core"


def _is_private(module: str) -> bool:
    return any(part.startswith("_") for part in module.split(".")[1:])


def _same_package(a: str, b: str) -> bool:
    """b's package holds a (a sibling, or a module of a subpackage), where its
    private modules are fair game."""
    importer = a if a in MODULES and MODULES[a].name == "__init__.py" else a.rpartition(".")[0]
    owner = b.rpartition(".")[0] if _is_private(b) else b
    return importer == owner or importer.startswith(owner + ".") and owner != "odmlq"


def _violations() -> list[str]:
    found = []
    for name, path in MODULES.items():
        layer = _layer(name)
        for target, names, line in _imports(name, path):
            where = f"{path.relative_to(ROOT)}:{line} imports {target}"
            if target == "samples" or target.startswith("samples."):
                found.append(f"{where}: odmlq/ never imports samples/")
                continue
            if not target.startswith("odmlq"):
                continue
            to = _layer(target)
            if layer == "core" and to != "core":
                found.append(f"{where}: the core imports no backend, report or face ({to})")
            elif layer in ("xla", "litert") and to in ("xla", "litert") and to != layer:
                found.append(f"{where}: {layer} never imports {to}")
            elif layer in ("xla", "litert") and to in ("report", "face"):
                found.append(f"{where}: a backend never imports the {to}")
            elif layer in ("report", "training") and to == "face":
                found.append(f"{where}: the {layer} never imports the face")
            elif {layer, to} == {"report", "training"}:
                found.append(f"{where}: the report and training never import each other")
            if layer != "face" and not _same_package(name, target) and _is_private(target):
                found.append(f"{where}: a private module of another "
                             + ("layer" if to != layer else "package (import its public names)"))
            if layer != "face" and to != layer and not _same_package(name, target):
                private = [n for n in names if n.startswith("_")]
                if private:
                    found.append(f"{where}: private names {private} of another layer")
    return found


def test_import_contract():
    violations = _violations()
    assert not violations, "\n".join(violations)


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan)."""
    graph = {name: sorted({t for t, _, _ in _imports(name, path) if t in MODULES and t != name})
             for name, path in MODULES.items()}
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_files():
    # A package's __init__ re-exports its modules; a module importing its own
    # package's public names through that __init__ would close a loop, so
    # modules import their siblings directly and __init__ files count like any file.
    cycles = _cycles()
    assert cycles == [], "\n".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("init", sorted(n for n, p in MODULES.items() if p.name == "__init__.py"))
def test_package_inits_only_reexport(init):
    tree = ast.parse(MODULES[init].read_text())
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id in ("__all__", "__version__")
                                                for t in node.targets):
            continue
        pytest.fail(f"{MODULES[init].relative_to(ROOT)}:{node.lineno}: an __init__ only re-exports")


def test_the_contract_catches_what_it_forbids(tmp_path, monkeypatch):
    """Each rule fires on a planted violation (the contract is not vacuous)."""
    planted = {
        "odmlq.scales": "from odmlq.litert.export import export_tflite\nfrom odmlq.graph._run import GraphCache\n",
        "odmlq.xla.ptq": "from odmlq.litert import spec\nfrom odmlq.graph._run import GraphCache\n",
        "odmlq.plan._plan": "import samples.models\n",
    }
    for name, source in planted.items():
        fake = tmp_path / (name.replace(".", "_") + ".py")
        fake.write_text(source)
        monkeypatch.setitem(MODULES, name, fake)
    monkeypatch.setattr(pathlib.Path, "relative_to", lambda self, other: self)
    text = "\n".join(_violations())
    assert "the core imports no backend" in text
    assert "xla never imports litert" in text
    assert "a private module of another layer" in text
    assert "never imports samples/" in text
    assert "a private module of another package" in text
