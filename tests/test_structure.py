"""The package's shape: no import cycle among viasd_hf modules, and no module over 400 lines.

Every import counts, wherever it is written: at module level, inside a function, or under
``if TYPE_CHECKING:``, because each one is a dependency a reader has to follow, and a cycle
hidden in a function is still a cycle. Relative imports are resolved; ``from .pkg import name``
imports the submodule ``pkg.name`` when there is one, else the package ``pkg`` itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "viasd_hf"
MAX_LINES = 400


def module_names(package: Path) -> dict[str, Path]:
    """Every module under ``package``, by dotted name (a package by its ``__init__.py``)."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules among ``known`` that the module ``name`` (at ``path``) imports, anywhere in its body."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                prefixes = (".".join(parts[:end]) for end in range(len(parts), 0, -1))
                found.update(next(([prefix] for prefix in prefixes if prefix in known), []))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package[: len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
                base = ".".join(base_parts)
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in known:
                    found.add(submodule)
                elif base in known:
                    found.add(base)
    return found


def import_graph(package: Path) -> dict[str, set[str]]:
    modules = module_names(package)
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The shortest import cycle through each module that is in one (first module repeated at the end), deduplicated."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for neighbour in sorted(graph[node]):
            if neighbour not in index:
                connect(neighbour)
                low[node] = min(low[node], low[neighbour])
            elif neighbour in stack:
                low[node] = min(low[node], index[neighbour])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1 or node in graph[node]:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    found: dict[tuple[str, ...], list[str]] = {}
    for group in groups:
        for node in group:
            cycle = _cycle_through(node, set(group), graph)[:-1]
            first = cycle.index(min(cycle))  # the same cycle found from another of its modules
            found.setdefault(tuple(cycle[first:] + cycle[:first]), cycle + [node])
    return sorted(found.values())


def _cycle_through(start: str, group: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path of imports from ``start`` back to itself, inside ``group``."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for neighbour in sorted(graph[node] & group):
                if neighbour == start:
                    return paths[node] + [start]
                if neighbour not in paths:
                    paths[neighbour] = paths[node] + [neighbour]
                    following.append(neighbour)
        frontier = following
    raise AssertionError(f"{start} is in a cycle but no path leads back to it")


def test_no_import_cycle_among_viasd_hf_modules():
    found = cycles(import_graph(PACKAGE))
    assert not found, "import cycles (make the dependency point one way):\n" + "\n".join(
        "  " + " -> ".join(cycle) for cycle in found
    )


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between packages (``viasd_hf.engine`` and everything under it is ``engine``); a module at the
    top of the package stands for itself (``viasd_hf.config``)."""
    def node(module: str) -> str:
        return _package_of(module) or module

    packages: dict[str, set[str]] = {node(module): set() for module in graph}
    for module, imported in graph.items():
        packages[node(module)].update(node(target) for target in imported if node(target) != node(module))
    return packages


def test_no_import_cycle_among_viasd_hf_packages():
    """Packages by concern, arrows one way: a package never imports one that imports it back, directly or not."""
    found = cycles(package_graph(import_graph(PACKAGE)))
    assert not found, "package import cycles (move the module to the package that owns its concern):\n" + "\n".join(
        "  " + " -> ".join(cycle) for cycle in found
    )


def test_no_module_is_over_400_lines():
    long = {
        path.relative_to(PACKAGE.parent): count
        for path in sorted(PACKAGE.rglob("*.py"))
        if (count := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by job):\n" + "\n".join(
        f"  {path}: {count} lines" for path, count in long.items()
    )


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """The checks above are only as good as the graph: function-level, TYPE_CHECKING and submodule imports count."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .a import A\n",
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\nA = 1\n",
        "b.py": "def later():\n    from .sub import c\n",
        "sub/__init__.py": "",
        "sub/c.py": "import pkg.a\nfrom .. import a\nfrom . import missing\n",
        "d.py": "from pkg.sub import c as renamed\nimport os\n",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    graph = import_graph(package)
    assert graph == {
        "pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.sub.c"}, "pkg.sub": set(),
        "pkg.sub.c": {"pkg.a", "pkg.sub"}, "pkg.d": {"pkg.sub.c"},
    }  # fmt: skip
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]


# -- the layout: a small public face, packages by concern, arrows one way --------------------------------------

MAX_TOP_LEVEL_MODULES = 8
MAX_MODULES_PER_PACKAGE = 12  # beside __init__.py: more than this and a package is a flat pile again
# Arrows one way: bench and cli sit on top (only cli imports bench; nothing imports cli), the engine
# never reaches for search, measurement or the Hub, and the shipped data's loaders stand alone.
ONLY_IMPORTED_BY = {"bench": {"bench", "cli"}, "cli": {"cli"}}
NEVER_IMPORTS = {
    "engine": {"dimr", "calibration", "hub"},
    "data": {"engine", "control", "drafters", "masks", "hub", "models", "calibration", "dimr", "vocabulary"},
}


def _package_of(module: str) -> str:
    """``viasd_hf.engine.loop`` -> ``engine``; a top-level module -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else ""


def test_the_top_of_the_package_holds_only_the_public_face():
    modules = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, (
        f"{len(modules)} modules at the top of viasd_hf/ (at most {MAX_TOP_LEVEL_MODULES}); "
        f"move the ones that are not the public face into a package by concern: {modules}"
    )


def test_no_package_grows_a_flat_pile():
    piles = {
        str(init.parent.relative_to(PACKAGE.parent)): count
        for init in sorted(PACKAGE.rglob("__init__.py"))
        if (count := len([p for p in init.parent.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]))
        > MAX_MODULES_PER_PACKAGE
    }
    assert not piles, f"packages over {MAX_MODULES_PER_PACKAGE} modules (split them by concern): {piles}"


def _banned_imports(package: str) -> set[str]:
    banned = set(NEVER_IMPORTS.get(package, ()))
    banned.update(top for top, importers in ONLY_IMPORTED_BY.items() if package not in importers)
    return banned - {package}


def test_imports_point_one_way():
    wrong = [
        f"  {module} -> {target}"
        for module, imported in sorted(import_graph(PACKAGE).items())
        for target in sorted(imported)
        if _package_of(target) in _banned_imports(_package_of(module))
    ]
    assert not wrong, "imports against the one-way rules (ONLY_IMPORTED_BY, NEVER_IMPORTS):\n" + "\n".join(wrong)


def test_every_package_is_in_the_wheel():
    """pyproject.toml lists the packages by hand (hub_masks/ is mapped in from the repo root): none may be missing."""
    import tomllib

    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8"))
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join(init.parent.relative_to(PACKAGE.parent).parts) for init in PACKAGE.rglob("__init__.py")
    }
    assert on_disk <= listed, f"packages missing from [tool.setuptools] packages: {sorted(on_disk - listed)}"
