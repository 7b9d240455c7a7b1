"""The layout the project keeps (docs/architecture.md): no file over 400 lines, no function over 80, imports
inside ``rl_specdec`` and inside ``benchmarks`` that point one way (no loop, counting imports made inside functions
too), no file that edits ``sys.path``, and the benchmarks imported as the package they are (``benchmarks.<...>``,
never a module of theirs by its bare name).

Each checker is shown to fail on a source built to break it (the negative controls)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("rl_specdec", "benchmarks", "examples", "tests", "scripts")
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 80
NO_PATH_EDITS = ("benchmarks", "tests", "examples", "scripts")
# sys.path changed in place (a method that edits it, an item or a slice assigned, += or =), site.addsitedir, or
# sys's path imported by name (path.insert then edits it unseen): in code, comments and strings (python -c) alike
PATH_EDIT = re.compile(
    r"\bsys\.path\s*(\.\s*(insert|append|extend|remove|pop|clear|__setitem__|__iadd__)\b|(\[[^\]\n]*\])?\s*\+?=(?!=))"
    r"|\baddsitedir\b|\bfrom\s+sys\s+import\s+[^\n]*\bpath\b"
)


def too_long(path: str, source: str) -> list[str]:
    """``path: what`` for the file if it passes MAX_FILE_LINES, and for each function that passes
    MAX_FUNCTION_LINES (its ``def`` line to its last, decorators not counted)."""
    out = []
    if source.count("\n") > MAX_FILE_LINES:
        out.append(f"{path}: {source.count(chr(10))} lines")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                out.append(f"{path}:{node.lineno} {node.name}: {n} lines")
    return out


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """{module: the modules of ``sources`` it imports, anywhere in it}; ``sources``: {module: (source, is a
    package)}. ``from pkg import submodule`` is an edge to the submodule, not to the package."""
    graph: dict[str, set[str]] = {m: set() for m in sources}
    for mod, (source, is_pkg) in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
                target = node.module or ""
                if node.level:  # relative: from the module's package, up level - 1
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    target = ".".join(base[: len(base) - node.level + 1] + ([target] if target else []))
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in sources]
                targets = subs if len(subs) == len(node.names) else [target, *subs]
            else:
                continue
            graph[mod] |= {t for t in targets if t in sources and t != mod}
    return graph


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def path_edits(path: str, source: str) -> list[str]:
    """``path:line`` for each line of ``source`` that edits ``sys.path`` (PATH_EDIT)."""
    return [f"{path}:{n}" for n, line in enumerate(source.splitlines(), 1) if PATH_EDIT.search(line)]


def benchmark_modules(root: Path) -> set[str]:
    """The bare names a module of ``root`` (benchmarks/) could be imported by if its folder were on sys.path: every
    module's and every package's name, at any depth."""
    names = {p.stem for p in root.rglob("*.py")} | {p.parent.name for p in root.rglob("__init__.py")}
    return names - {"__init__", "__main__", root.name}


def bare_imports(path: str, source: str, names: set[str]) -> list[str]:
    """``path:line import`` for each import of ``source`` (inside functions too) that names a module of ``names``
    bare (``import bench_common``, ``from whatif import models``) or relatively (``from . import models``), where it
    must be ``benchmarks.<...>``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            bad = [a.name for a in node.names if a.name.split(".")[0] in names]
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in names):
            bad = ["." * node.level + (node.module or "")]
        else:
            continue
        out += [f"{path}:{node.lineno} {b}" for b in bad]
    return out


def test_no_file_edits_sys_path_and_benchmarks_are_imported_as_the_package():
    names = benchmark_modules(ROOT / "benchmarks")
    assert {"bench_common", "bench", "rollout", "whatif", "grpo", "train_step"} <= names, sorted(names)
    edits, bare = [], []
    for folder in NO_PATH_EDITS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel, source = str(path.relative_to(ROOT)), path.read_text()
            if path != Path(__file__).resolve():  # this file spells the edits out, for the negative controls
                edits += path_edits(rel, source)
            bare += bare_imports(rel, source, names)
    assert not edits, "run from the repository's root (python -m ...) instead of editing sys.path: " + "; ".join(edits)
    assert not bare, "import these as benchmarks.<folder>.<module>: " + "; ".join(bare)


def test_the_path_and_import_checks_catch_an_edit_and_a_bare_import():
    for edit in (
        "sys.path.insert(0, here)",
        "sys.path.append(str(BENCHMARKS))",
        "sys.path [:0] = [here]",
        "sys.path = [here, *sys.path]",
        "sys.path += [here]",
        "site.addsitedir(here)",
        "from sys import path",
        'subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r}); import lockstep"])',
    ):
        assert path_edits("a.py", f"import sys\n{edit}\n") == ["a.py:2"], edit
    assert path_edits("b.py", "import sys\nprint(sys.path, sys.path[0] == here)\nenv['PYTHONPATH'] = here\n") == []
    names = {"bench_common", "whatif", "lockstep"}
    source = (
        "import bench_common\n"
        "from whatif.report import table\n"
        "from . import models\n"
        "def f():\n    import lockstep as ls\n"
        "from benchmarks import bench_common\n"
        "from benchmarks.whatif.report import table\n"
        "import benchmarks.grpo.lockstep\n"
        "import os, rl_specdec.rollout\n"
    )
    assert bare_imports("c.py", source, names) == [
        "c.py:1 bench_common",
        "c.py:2 whatif.report",
        "c.py:3 .",
        "c.py:5 lockstep",
    ]
    assert bare_imports("d.py", "\n".join(source.splitlines()[5:]), names) == []


def test_no_file_over_400_lines_and_no_function_over_80():
    found = []
    for folder in CHECKED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += too_long(str(path.relative_to(ROOT)), path.read_text())
    assert not found, "split these (docs/architecture.md): " + "; ".join(found)


def test_the_size_check_catches_a_long_file_and_a_long_function():
    long_function = "def f():\n" + "    x = 1\n" * 80
    assert too_long("a.py", long_function) == ["a.py:1 f: 81 lines"]
    assert too_long("b.py", "x = 1\n" * 401) == ["b.py: 401 lines"]
    assert too_long("c.py", "def f():\n" + "    x = 1\n" * 79 + "x = 2\n" * 300) == []


@pytest.mark.parametrize("package", ["rl_specdec", "benchmarks"])
def test_imports_inside_the_package_point_one_way(package):
    root = ROOT / package
    sources = {module_name(p, ROOT): (p.read_text(), p.name == "__init__.py") for p in sorted(root.rglob("*.py"))}
    graph = import_graph(sources)
    assert sum(map(len, graph.values())) > 100, "the import graph is nearly empty: the parser misses imports"
    assert loops(graph) == []


def test_the_loop_check_catches_a_loop_made_inside_a_function():
    sources = {
        "p": ("from p import a\n", True),
        "p.a": ("from p.b import g\n", False),
        "p.b": ("def g():\n    from . import c\n", False),
        "p.c": ("def h():\n    from p.a import f\n", False),
    }
    assert loops(import_graph(sources)) == [["p.a", "p.b", "p.c"]]
    sources["p.c"] = ("import os\n", False)
    assert loops(import_graph(sources)) == []


def room_edges(graph: dict[str, set[str]], source: str, target: str) -> list[str]:
    """``a -> b`` for every import from the room ``source`` (a package prefix) into the room ``target``."""
    return sorted(f"{a} -> {b}" for a, bs in graph.items() if a.startswith(source) for b in bs if b.startswith(target))


def test_the_config_room_imports_nothing_of_the_toy_room():
    """Loading a config reads and validates; building models is rl_specdec.toy.resolve's step (the toy room may
    import the config room, never the reverse)."""
    sources = {
        module_name(p, ROOT): (p.read_text(), p.name == "__init__.py") for p in (ROOT / "rl_specdec").rglob("*.py")
    }
    graph = import_graph(sources)
    assert room_edges(graph, "rl_specdec.config", "rl_specdec.toy") == []
    assert room_edges(graph, "rl_specdec.toy", "rl_specdec.config"), "the negative control below needs an edge"
    graph["rl_specdec.config.load"].add("rl_specdec.toy.build")  # negative control: a build reached from loading
    assert room_edges(graph, "rl_specdec.config", "rl_specdec.toy") == [
        "rl_specdec.config.load -> rl_specdec.toy.build"
    ]


def private_reaches(path: str, source: str) -> list[str]:
    """``path:line name`` for each private name of rl_specdec a benchmark imports (``from rl_specdec.x import
    _y``, or a module ``rl_specdec.x._y``): what a benchmark needs is public, so the package can change its
    insides without breaking the figures' commands."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rl_specdec"):
            names = [node.module] + [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("rl_specdec")]
        else:
            continue
        out += [f"{path}:{node.lineno} {n}" for n in names if any(p.startswith("_") for p in n.split("."))]
    return out


def test_no_benchmark_imports_a_private_name_of_rl_specdec():
    found = [hit for p in sorted((ROOT / "benchmarks").rglob("*.py")) for hit in private_reaches(str(p), p.read_text())]
    assert not found, "make these public in rl_specdec, or reach them through a public call: " + "; ".join(found)


def test_the_private_import_check_catches_a_name_and_a_module():
    source = (
        "from rl_specdec.heads.eagle3 import _chat_batches\nimport rl_specdec.policy._inner\nfrom rl_specdec import x"
    )
    assert private_reaches("b.py", source) == ["b.py:1 _chat_batches", "b.py:2 rl_specdec.policy._inner"]


def callbacks(path: str, source: str) -> list[str]:
    """``path:line name`` for each attribute set on ``self`` that holds a callback: annotated ``Callable`` or named
    ``on_*``. The engine group only raises; the run decides (``rl_specdec/grpo/recovery.py``)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets = node.targets
        else:
            targets = [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            if not (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"):
                continue
            typed = isinstance(node, ast.AnnAssign) and "Callable" in ast.unparse(node.annotation)
            if typed or t.attr.startswith("on_"):
                out.append(f"{path}:{node.lineno} {t.attr}")
    return out


def test_the_engine_group_holds_no_callback_into_the_run():
    rollout = sorted((ROOT / "rl_specdec" / "rollout").rglob("*.py"))
    assert len(rollout) > 10, "the rollout room moved: point this test at it"
    found = [hit for p in rollout for hit in callbacks(str(p.relative_to(ROOT)), p.read_text())]
    fix = "raise an error from rl_specdec.errors instead, and decide in grpo/recovery.py: "
    assert not found, fix + "; ".join(found)
    sources = {
        module_name(p, ROOT): (p.read_text(), p.name == "__init__.py") for p in (ROOT / "rl_specdec").rglob("*.py")
    }
    assert room_edges(import_graph(sources), "rl_specdec.rollout", "rl_specdec.grpo") == []


def test_the_callback_check_catches_a_typed_and_a_named_one():
    source = (
        "class G:\n    def __init__(self):\n        self.on_engine_death = None\n"
        "        self.hook: Callable[[int], None] | None = None\n        self.seed: int = 0\n        self.k = 1\n"
    )
    assert callbacks("g.py", source) == ["g.py:3 on_engine_death", "g.py:4 hook"]


def method_comparisons(path: str, source: str, names: set[str]) -> list[str]:
    """``path:line name`` for each comparison with a speculation method's name (``== "eagle3"``, ``in ("ngram",
    ...)``): what a method can do is a column of ``rl_specdec/vllm_ext/methods.py``'s table, read by its row."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        for side in [node.left, *node.comparators]:
            items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            hits = [e.value for e in items if isinstance(e, ast.Constant) and e.value in names]
            out += [f"{path}:{node.lineno} {h}" for h in hits]
    return out


def test_no_method_name_is_compared_outside_the_table():
    from rl_specdec.vllm_ext.methods import METHODS

    table = ROOT / "rl_specdec" / "vllm_ext" / "methods.py"
    found = [
        hit
        for p in sorted((ROOT / "rl_specdec").rglob("*.py"))
        if p != table
        for hit in method_comparisons(str(p.relative_to(ROOT)), p.read_text(), set(METHODS))
    ]
    assert not found, "read the method's row (vllm_ext.methods.method(name)) instead: " + "; ".join(found)


def test_the_method_check_catches_an_equality_and_a_membership():
    source = 'if m == "eagle3" or m in ("ngram", "x"):\n    pass\nif family == "toy" or m != other:\n    pass\n'
    assert method_comparisons("c.py", source, {"eagle3", "ngram"}) == ["c.py:1 eagle3", "c.py:1 ngram"]
