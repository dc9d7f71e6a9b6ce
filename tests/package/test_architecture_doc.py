"""docs/ARCHITECTURE.md stays true to the tree: every module of ``titan_ext/`` (Python
and C) is named exactly once as the lead of a module entry (a bullet ``- `path` — …``, its path under
``titan_ext/``), no entry names a module that does not exist, and the new-schedule recipe points at the test
that follows it."""

from __future__ import annotations

import collections
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "ARCHITECTURE.md"


def _modules() -> set[str]:
    pkg = ROOT / "titan_ext"
    return {str(p.relative_to(pkg)) for p in pkg.rglob("*")
            if p.suffix in (".py", ".c") and "__pycache__" not in p.parts}


def test_every_module_is_named_once_in_the_module_lists():
    rows = collections.Counter(re.findall(r"^- `([\w/.]+\.(?:py|c))` — ", DOC.read_text(), re.M))
    modules = _modules()
    assert not sorted(modules - set(rows)), f"modules missing from docs/ARCHITECTURE.md: {sorted(modules - set(rows))}"
    assert not sorted(set(rows) - modules), f"entries naming no module: {sorted(set(rows) - modules)}"
    assert not [m for m, n in rows.items() if n > 1], f"named twice: {[m for m, n in rows.items() if n > 1]}"


def test_the_new_schedule_recipe_is_the_one_its_test_follows():
    text = DOC.read_text()
    recipe = text[text.index("### Adding an adaptive schedule"):]
    assert "tests/titan/test_titan_new_schedule.py" in recipe and "register_schedule" in recipe
    assert (ROOT / "tests" / "titan" / "test_titan_new_schedule.py").exists()
    for gone in ("runtime/delegated.py", "`_SCHEDULES`", "`_DELEGATING_VARIANTS`", "`_DIRECT`", "runtime/testing.py"):
        assert gone not in text, gone


def test_no_internal_issue_numbers_in_the_code_or_the_user_docs():
    """The code and the user's docs stand on their own: "issue N" means nothing to a user (the issue
    tracker is the developers'; BENCHMARKS.md and the commit log may cite it)."""
    pattern = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
    paths = [p for p in (ROOT / "titan_ext").rglob("*") if p.suffix in (".py", ".c", ".h", ".toml")]
    paths += [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    hits = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:100]}" for p in paths
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if pattern.search(line)]
    assert not hits, "\n".join(hits)
