"""docs/ARCHITECTURE.md stays true to the tree (issue 38 item 5): every module of ``titan_ext/`` (Python
and C) is named exactly once as a module-table row (its path under ``titan_ext/``), no row names a
module that does not exist, and the new-schedule recipe points at the test that follows it."""

from __future__ import annotations

import collections
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"


def _modules() -> set[str]:
    pkg = ROOT / "titan_ext"
    return {str(p.relative_to(pkg)) for p in pkg.rglob("*")
            if p.suffix in (".py", ".c") and "__pycache__" not in p.parts}


def test_every_module_is_named_once_in_the_module_tables():
    rows = collections.Counter(re.findall(r"^\| `([\w/.]+\.(?:py|c))` \|", DOC.read_text(), re.M))
    modules = _modules()
    assert not sorted(modules - set(rows)), f"modules missing from docs/ARCHITECTURE.md: {sorted(modules - set(rows))}"
    assert not sorted(set(rows) - modules), f"rows naming no module: {sorted(set(rows) - modules)}"
    assert not [m for m, n in rows.items() if n > 1], f"named twice: {[m for m, n in rows.items() if n > 1]}"


def test_the_new_schedule_recipe_is_the_one_its_test_follows():
    text = DOC.read_text()
    recipe = text[text.index("### Adding an adaptive schedule"):]
    assert "tests/test_titan_new_schedule.py" in recipe and "register_schedule" in recipe
    assert (ROOT / "tests" / "test_titan_new_schedule.py").exists()
    for gone in ("runtime/delegated.py", "`_SCHEDULES`", "`_DELEGATING_VARIANTS`", "`_DIRECT`", "runtime/testing.py"):
        assert gone not in text, gone
