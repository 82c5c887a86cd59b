"""The studies in bench/studies/ still match today's code: every viasd_hf name a study script imports
exists. Scripts are parsed, not run (some load real models at import)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

STUDIES = Path(__file__).resolve().parents[1] / "bench" / "studies"
SCRIPTS = sorted(STUDIES.rglob("*.py"))


def viasd_imports(script: Path) -> list[tuple[str, str | None]]:
    """``(module, name)`` for each ``from viasd_hf... import name``, ``(module, None)`` for ``import viasd_hf...``."""
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"), filename=str(script))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "viasd_hf":
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] == "viasd_hf"]
    return found


def test_there_are_studies_to_check():
    assert SCRIPTS and all(viasd_imports(script) for script in SCRIPTS if script.name == "study.py")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: str(path.relative_to(STUDIES)))
def test_a_study_imports_only_what_exists(script: Path):
    missing = []
    for module_name, name in viasd_imports(script):
        module = importlib.import_module(module_name)
        if name is not None and not hasattr(module, name):
            try:
                importlib.import_module(f"{module_name}.{name}")
            except ModuleNotFoundError:
                missing.append(f"{module_name}.{name}")
    assert not missing, f"{script.relative_to(STUDIES)} imports names that no longer exist: {missing}"
