"""Every ```python block of the documentation (``docs/**/*.md``) and of ``README.md`` runs.

One test per page: the page's blocks run in order in one namespace (later blocks use
earlier names), in a temporary working directory, so a failure names the page and the
traceback points at the Markdown line. A page whose blocks import a framework that this
run does not select (``PORTABLE_ATTENTION_BACKENDS``, see ``conftest.py``) is skipped with
that reason; a selected one always runs. A block right after the comment

    <!-- docs-test: skip (REASON) -->

is not run (CuPy examples: no GPU here). Each such block is its own skipped test, so
``pytest -ra`` lists and counts them with their reasons, and a page may not hide
anything else that way.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import BACKEND_NAMES, ENV_VAR

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]

SKIP_MARK = re.compile(r"^<!--\s*docs-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->$")
FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^`]*$")
IMPORT = re.compile(r"^\s*(?:from|import)\s+([\w.]+)", re.MULTILINE)

#: Imported module (prefix) -> (backends that must be selected, packages that must import).
NEEDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "torch": (("torch",), ()),
    "jax": (("jax",), ()),
    "flax": (("jax",), ("flax",)),
    "array_api_strict": (("array_api_strict",), ()),
    "cupy": (("cupy",), ("cupy",)),  # never a selected backend: such blocks carry the mark
    "transformers": (("torch",), ("transformers",)),
    "matplotlib": ((), ("matplotlib",)),
    "dask": ((), ("dask",)),
    "ndonnx": ((), ("ndonnx",)),
    "onnx": ((), ("onnx",)),
    "onnxruntime": ((), ("onnxruntime",)),
    "portable_attention.nn.torch": (("torch",), ()),
    "portable_attention.nn.flax": (("jax",), ("flax",)),
    "portable_attention.integrations.transformers": (("torch",), ("transformers",)),
    "portable_attention.plot": ((), ("matplotlib",)),
}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the first code line in the page
    source: str
    skip: str | None  # the reason of a docs-test skip mark, else None


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def blocks(page: Path) -> list[Block]:
    """The ```python blocks of ``page`` (indented fences too, e.g. inside list items)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    previous = ""  # last non-blank line before the current one
    while i < len(lines):
        opened = FENCE_OPEN.match(lines[i])
        if not opened:
            if lines[i].strip():
                previous = lines[i].strip()
            i += 1
            continue
        indent, lang = opened["indent"], opened["lang"]
        body: list[str] = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        if j == len(lines):
            msg = f"{_name(page)}:{i + 1}: code fence is never closed"
            raise ValueError(msg)
        if lang in ("python", "py"):
            mark = SKIP_MARK.match(previous)
            found.append(Block(page, i + 2, "\n".join(body) + "\n", mark and mark["reason"]))
        previous = "```"
        i = j + 1
    return found


def requirements(source: str) -> tuple[set[str], set[str]]:
    """Backends and packages the imports of ``source`` need."""
    backends: set[str] = set()
    packages: set[str] = set()
    for module in IMPORT.findall(source):
        for prefix, (needs_backends, needs_packages) in NEEDS.items():
            if module == prefix or module.startswith(prefix + "."):
                backends.update(needs_backends)
                packages.update(needs_packages)
    return backends, packages


def _selected(backend: str) -> bool:
    return any(name == backend or name.startswith(backend + "_") for name in BACKEND_NAMES)


def _parse(page: Path) -> list[Block] | ValueError:
    try:
        return blocks(page)
    except ValueError as err:  # reported by that page's test, not at collection
        return err


PAGE_BLOCKS = {page: _parse(page) for page in PAGES}
SKIPPED = [
    b
    for found in PAGE_BLOCKS.values()
    if not isinstance(found, ValueError)
    for b in found
    if b.skip is not None
]


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_page_examples_run(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    found = PAGE_BLOCKS[page]
    if isinstance(found, ValueError):
        raise found
    runnable = [b for b in found if b.skip is None]
    if not runnable:
        pytest.skip(f"{_name(page)} has no runnable python block")
    backends: set[str] = set()
    packages: set[str] = set()
    for block in runnable:
        more_backends, more_packages = requirements(block.source)
        backends |= more_backends
        packages |= more_packages
    assert "cupy" not in backends, (
        f"{_name(page)}: a block imports CuPy, which no test session provides; put "
        "`<!-- docs-test: skip (needs a GPU) -->` right before its fence"
    )
    missing = sorted(b for b in backends if not _selected(b))
    if missing:
        pytest.skip(f"{_name(page)} imports {missing}, not selected in this run ({ENV_VAR})")
    absent = sorted(p for p in packages if importlib.util.find_spec(p) is None)
    if absent:
        pytest.skip(f"{_name(page)} needs {absent}, not installed")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")  # figures render off-screen
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for block in runnable:
        # Pad to the block's line so tracebacks point at the page's own line numbers.
        code = compile("\n" * (block.line - 1) + block.source, str(block.page), "exec")
        exec(code, namespace)
    capsys.readouterr()  # the examples' printing is not the test's output


@pytest.mark.parametrize(
    "block", SKIPPED, ids=[f"{_name(b.page)}:{b.line}" for b in SKIPPED] or None
)
def test_marked_block_is_listed(block: Block) -> None:
    """Each block under a ``docs-test: skip`` mark shows up (and is counted) as a skip."""
    assert block.skip and block.skip.strip(), f"{_name(block.page)}:{block.line}: empty reason"
    compile(block.source, str(block.page), "exec")  # it must at least be valid Python
    pytest.skip(f"{_name(block.page)}:{block.line}: {block.skip}")


def test_block_parser_finds_marks_and_line_numbers(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(
        "# t\n\n```python\nx = 1\n```\n\n<!-- docs-test: skip (needs a GPU) -->\n"
        "```python\nimport cupy\n```\n\n- item\n\n  ```python\n  y = x + 1\n  ```\n"
        "```text\nnot code\n```\n",
        encoding="utf-8",
    )
    found = blocks(page)
    assert [(b.line, b.source, b.skip) for b in found] == [
        (4, "x = 1\n", None),
        (9, "import cupy\n", "needs a GPU"),
        (15, "y = x + 1\n", None),
    ]
    assert requirements("import torch\nfrom portable_attention.nn.flax import M\n") == (
        {"torch", "jax"},
        {"flax"},
    )


def test_every_page_is_in_the_site_nav() -> None:
    """Each docs page is reachable from mkdocs.yml's nav, and the nav names only real pages."""
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = set(re.findall(r"^\s*-\s*(?:[^:\n]+:\s*)?([\w./-]+\.md)\s*$", config, re.MULTILINE))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert pages - nav == set(), f"pages missing from the nav of mkdocs.yml: {pages - nav}"
    assert nav - pages == set(), f"nav entries without a page: {nav - pages}"
