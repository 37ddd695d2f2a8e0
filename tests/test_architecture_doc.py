"""docs/architecture.md stays true to the tree: every repository path it names exists, and every
package and module of the four packages is named on it, so a newcomer can find each part there."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
PACKAGES = ("optimize", "export", "train", "targets")
ROOTS = (*PACKAGES, "tests", "bench", "examples", "docs")


def _code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def _named_paths(text: str) -> set[str]:
    """Repository paths in code spans: a token that starts with a top-level folder and holds no
    placeholder (``<kind>``, ``*.yaml``, ``NN``), stripped of a ``::test`` or ``:Class`` suffix."""
    paths = set()
    for span in _code_spans(text):
        for token in span.split():
            token = token.strip("(),;")
            if not token.startswith(tuple(f"{r}/" for r in ROOTS)) or re.search(r"[<>*{}]|NN", token):
                continue
            paths.add(token.split("::")[0].split(":")[0])
    return paths


def test_every_path_the_page_names_exists():
    text = DOC.read_text()
    named = _named_paths(text)
    assert len(named) > 60, sorted(named)  # the page names the tree, not a handful of files
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
    links = re.findall(r"\]\(([a-z_]+\.md)(?:#[^)]*)?\)", text)
    assert links and all((DOC.parent / link).is_file() for link in links), links


def test_every_package_and_module_is_named():
    """Each package folder (``optimize/fit/``) and each module (by its path, or its file name
    under the package the page is describing) appears on the page."""
    text = DOC.read_text()
    spans = " ".join(_code_spans(text))
    missing = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if path.name == "__init__.py":
                folder = rel[: -len("__init__.py")]
                if folder.count("/") > 1 and folder not in spans and folder.split("/", 1)[1] not in spans:
                    missing.append(folder)
                continue
            if rel not in spans and path.name not in spans:
                missing.append(rel)
    assert not missing, f"docs/architecture.md does not name: {missing}"


def test_the_path_check_is_not_vacuous(tmp_path):
    """A path that is gone is caught (the check above would pass on a page naming nothing)."""
    named = _named_paths("see `optimize/fit_price.py` and `optimize/fit/search.py` and `stages/NN-<kind>/`")
    assert named == {"optimize/fit_price.py", "optimize/fit/search.py"}
    assert [p for p in named if not (REPO / p).exists()] == ["optimize/fit_price.py"]
