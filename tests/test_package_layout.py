"""The package's own shape, as docs/architecture.md states it: no import cycle between its
modules (lazy imports inside functions included), no module over 700 lines, and no module
importing another module's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import portable_attention

ROOT = Path(portable_attention.__file__).parent
PACKAGE = "portable_attention"


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = (PACKAGE, *path.relative_to(ROOT).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str]]:
    """``(module, imported name)`` of every import of the package in ``path`` that runs,
    at any depth (a function's lazy import counts, one under ``if TYPE_CHECKING:`` does
    not); the name is "" for ``import x``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    annotations_only = {  # imports under `if TYPE_CHECKING:` never run
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for inner in ast.walk(node)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in annotations_only:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found += [(base, alias.name) for alias in node.names]
    return [(m, n) for m, n in found if m == PACKAGE or m.startswith(PACKAGE + ".")]


def _graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from pkg import sub`` names ``sub``;
    a name defined in a package's ``__init__`` names the package)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for module, imported in _imports(name, path, modules):
            sub = f"{module}.{imported}"
            targets.add(sub if sub in modules else module)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle() -> None:
    # A submodule's import of its own package (``from portable_attention import attend``
    # inside portable_attention/x.py) runs the package's __init__, which imports most
    # modules: that is a cycle too, and counted as one.
    assert _cycle(_graph()) is None


def test_no_module_over_700_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in _modules().values()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > 700
    }
    assert not long


def test_no_module_imports_private_names_of_another() -> None:
    modules = _modules()
    private = sorted(
        f"{name} imports {imported} from {module}"
        for name, path in modules.items()
        for module, imported in _imports(name, path, modules)
        if imported.startswith("_")
        and not imported.startswith("__")  # __version__
        and f"{module}.{imported}" not in modules
    )
    assert not private
