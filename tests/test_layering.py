"""The house's import rules, read from the source with :mod:`ast` (no module is imported).

Every ``.py`` file under the top-level packages is parsed; every ``import`` counts, wherever it
sits: at module level, inside a function, or under ``if TYPE_CHECKING:``. A rule may allow an
arrow *only* under ``TYPE_CHECKING`` (annotations need the type, the running code does not):
``transfer/`` naming ``engine.kv.pool.BufferInfo`` this way is the house convention. Each broken
arrow is reported as ``file:line imported.module (where)`` under the rule it breaks.

Import cycles are looked for among every import that can run (module level and function level,
not under ``TYPE_CHECKING``): none is allowed anywhere, so a function-level import is never a way
to hide one. The rooms' sub-rooms (``engine/core/``, ``transfer/plan/``, ...) have arrows of
their own, and every sub-room says in its ``__init__`` docstring what it holds.

The rules are those of ``docs/architecture.md`` ("Rooms and arrows"); change both together.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "transfer", "proto", "serving", "prefill_node", "decode_node", "router",
            "cli", "bench", "deploy")
NETWORKING = ("grpc", "grpc_*", "aiohttp", "ray", "mooncake", "msgpack", "prometheus_client",
              "socket")
NODES = ("prefill_node", "decode_node")
# Torch-free modules that define data and errors; the rooms that may only use "engine types"
# import these at run time (anything else from engine only under TYPE_CHECKING).
ENGINE_TYPES = ("engine.errors", "engine.core.request", "engine.config")
ENGINE_SHARED = ("engine.errors", "engine.config")  # what every engine sub-room may import
ANY_NON_STDLIB = "*"  # a pattern that matches every module outside the standard library
# The sub-rooms of engine/ and of transfer/ (each a package whose docstring says what it holds).
ENGINE_ROOMS = ("core", "kv", "attention", "runner", "sampling", "multimodal", "text", "parallel",
                "models", "builtin")
TRANSFER_ROOMS = ("backends", "bootstrap", "plan", "tp")
ENGINE_TOP_MODULES = 8  # the most modules engine/ keeps at its top level, __init__ included


@dataclass(frozen=True)
class Import:
    """One imported module: who imports it, where, and in which context."""

    source: str  # the importing module, dotted
    path: str  # its file, relative to the root
    line: int
    target: str  # the imported module, dotted and absolute
    type_checking: bool = False  # under ``if TYPE_CHECKING:``
    in_function: bool = False  # inside a function body (runs only when called)

    @property
    def runs(self) -> bool:
        """Whether the import can run (anything not under ``TYPE_CHECKING``)."""
        return not self.type_checking

    def where(self) -> str:
        if self.type_checking:
            return "under TYPE_CHECKING"
        return "in a function" if self.in_function else "at module level"


@dataclass(frozen=True)
class Rule:
    """Modules matching ``sources`` may not import modules matching ``forbidden``, except those
    matching ``allowed`` (anywhere) or ``types_only`` (under ``TYPE_CHECKING`` only). With
    ``transitive``, the imports of every project module a source loads at run time count too."""

    text: str
    sources: tuple[str, ...]
    forbidden: tuple[str, ...]
    allowed: tuple[str, ...] = ()
    types_only: tuple[str, ...] = ()
    exempt: tuple[str, ...] = ()  # sources the rule does not govern
    transitive: bool = False

    def governs(self, module: str) -> bool:
        return matches(module, self.sources) and not matches(module, self.exempt)

    def breaks(self, imp: Import) -> bool:
        if not matches(imp.target, self.forbidden) or matches(imp.target, self.allowed):
            return False
        return not (imp.type_checking and matches(imp.target, self.types_only))


def engine_room(room: str, may: Sequence[str], text: str, types_only: Sequence[str] = ()) -> Rule:
    """``engine/ROOM/`` imports from the engine only itself, errors and config, and ``may``."""
    return Rule(text, sources=(f"engine.{room}",), forbidden=("engine",),
                allowed=(f"engine.{room}", *ENGINE_SHARED, *(f"engine.{m}" for m in may)),
                types_only=tuple(f"engine.{m}" for m in types_only))


ROOM_RULES = (
    Rule("engine imports no networking and no other room",
         sources=("engine",),
         forbidden=(*NETWORKING, "transfer", "proto", "serving", *NODES, "router", "cli", "bench",
                    "deploy")),
    Rule("the scheduler core (engine/core/), engine/text/ and the engine types import no torch "
         "(not even through another module)",
         sources=("engine.core", "engine.text", *ENGINE_TYPES), forbidden=("torch",),
         transitive=True),
    Rule("transfer imports no model code: from engine only engine.errors (engine.kv.pool under "
         "TYPE_CHECKING); no proto, serving, nodes, router, cli, bench, deploy",
         sources=("transfer",),
         forbidden=("engine", "proto", "serving", *NODES, "router", "cli", "bench", "deploy"),
         allowed=("engine.errors",), types_only=("engine.kv.pool",)),
    Rule("proto imports only grpc, protobuf, numpy and engine types",
         sources=("proto",), forbidden=(ANY_NON_STDLIB,),
         allowed=("proto", "grpc", "google.protobuf", "numpy", *ENGINE_TYPES)),
    Rule("serving imports proto, engine types (other engine modules under TYPE_CHECKING) and "
         "transfer.errors; no nodes, router, cli, bench, deploy",
         sources=("serving",),
         forbidden=("engine", "transfer", *NODES, "router", "cli", "bench", "deploy"),
         allowed=(*ENGINE_TYPES, "transfer.errors"), types_only=("engine",)),
    Rule("prefill_node does not import decode_node, router, cli, bench, deploy",
         sources=("prefill_node",), forbidden=("decode_node", "router", "cli", "bench", "deploy")),
    Rule("decode_node does not import prefill_node, router, cli, bench, deploy",
         sources=("decode_node",), forbidden=("prefill_node", "router", "cli", "bench", "deploy")),
    Rule("router imports no node and no transfer (nor cli, bench, deploy)",
         sources=("router",), forbidden=(*NODES, "transfer", "cli", "bench", "deploy")),
    Rule("router imports no torch (not even through another module): it starts in half a "
         "second",
         sources=("router",), forbidden=("torch",), transitive=True),
    # bench and deploy may import any room; these two rules are their only limits
    Rule("nothing imports cli but cli itself", sources=PACKAGES, exempt=("cli",),
         forbidden=("cli",)),
    Rule("no room imports tests", sources=PACKAGES, forbidden=("tests",)),
)

ENGINE_RULES = (
    Rule("engine's shared modules (errors, config, device) import from the engine only errors "
         "and config",
         sources=("engine.errors", "engine.config", "engine.device"), forbidden=("engine",),
         allowed=ENGINE_SHARED),
    engine_room("core", (), "engine/core/ imports from the engine only errors and config"),
    engine_room("text", (), "engine/text/ imports from the engine only errors and config"),
    engine_room("multimodal", (),
                "engine/multimodal/ imports from the engine only errors and config"),
    engine_room("kv", (), "engine/kv/ imports from the engine only errors and config"),
    engine_room("attention", ("kv",), "engine/attention/ imports from the engine only errors, "
                "config and kv/"),
    engine_room("sampling", ("core",), "engine/sampling/ imports from the engine only errors, "
                "config and core/ (the request's sampling values)"),
    engine_room("models", ("device", "checkpoint", "checkpoint_bin", "attention", "kv",
                           "parallel.group", "parallel.shard"),
                "engine/models/ never imports runner/ (nor core/, sampling/, text/, "
                "multimodal/, builtin/, the TP processes or LLMEngine): from the engine only "
                "errors, config, device, checkpoint reading, attention/, kv/ and the TP group "
                "and shard"),
    engine_room("parallel", ("device", "checkpoint", "attention", "kv", "models"),
                "engine/parallel/ imports from the engine only errors, config, device, "
                "checkpoint reading, attention/, kv/ and models/ (never runner/ or LLMEngine)"),
    engine_room("runner", ("device", "attention", "kv", "core", "models", "multimodal",
                           "parallel"),
                "engine/runner/ imports no sampling/, text/ or builtin/, and LLMEngine only "
                "under TYPE_CHECKING",
                types_only=("llm_engine",)),
    Rule("no engine module but builtin/ itself imports builtin/ (the tiny model is a leaf)",
         sources=("engine",), exempt=("engine.builtin",), forbidden=("engine.builtin",)),
)

TRANSFER_RULES = (
    Rule("transfer/plan/ is pure logic: the standard library, transfer.errors and itself",
         sources=("transfer.plan",), forbidden=(ANY_NON_STDLIB,),
         allowed=("transfer.errors", "transfer.plan")),
    Rule("only transfer/backends/ loads a transfer engine build (mooncake, torch_npu)",
         sources=("transfer",), exempt=("transfer.backends",), forbidden=("mooncake", "torch_npu")),
    Rule("only transfer/bootstrap/ opens sockets and encodes messages (socket, msgpack); "
         "transfer/backends/keepalive.py only sets options on the transfer engine's sockets",
         sources=("transfer",), exempt=("transfer.bootstrap", "transfer.backends.keepalive"),
         forbidden=("socket", "msgpack")),
)

RULES = (*ROOM_RULES, *ENGINE_RULES, *TRANSFER_RULES)


def matches(module: str, patterns: Iterable[str]) -> bool:
    """Whether ``module`` is one of ``patterns`` or inside one (``grpc_*`` style globs work)."""
    for pattern in patterns:
        if pattern == ANY_NON_STDLIB:
            if module.partition(".")[0] not in sys.stdlib_module_names:
                return True
        elif fnmatchcase(module, pattern) or fnmatchcase(module, pattern + ".*"):
            return True
    return False


# ---- reading the source ----------------------------------------------------------------------


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(root: Path, packages: Sequence[str]) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``, by dotted name."""
    return {module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, type_checking: bool, in_function: bool
          ) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    """Every import statement below ``node`` with its context."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, type_checking, in_function
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk_one(stmt, True, in_function)
            for stmt in child.orelse:
                yield from _walk_one(stmt, type_checking, in_function)
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _walk(child, type_checking, True)
        else:
            yield from _walk(child, type_checking, in_function)


def _walk_one(stmt: ast.stmt, type_checking: bool, in_function: bool
              ) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    if isinstance(stmt, ast.Import | ast.ImportFrom):
        yield stmt, type_checking, in_function
    else:
        yield from _walk(stmt, type_checking, in_function)


def _targets(node: ast.Import | ast.ImportFrom, source: str, is_package: bool,
             known: Iterable[str]) -> list[str]:
    """The absolute modules one statement imports (``from a import b`` is ``a.b`` when that is
    a module, else ``a``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = source.split(".") if is_package else source.split(".")[:-1]
        anchor = package[: len(package) - node.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
    known = set(known)
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def read_imports(root: Path, modules: dict[str, Path]) -> list[Import]:
    """Every import of every module, in file and line order (duplicates per line dropped)."""
    found: list[Import] = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = path.relative_to(root).as_posix()
        for node, tc, fn in _walk(tree, False, False):
            targets = _targets(node, name, path.name == "__init__.py", modules)
            for target in dict.fromkeys(targets):
                found.append(Import(name, rel, node.lineno, target, tc, fn))
    return found


# ---- checking --------------------------------------------------------------------------------


def runtime_closure(start: str, imports: Sequence[Import]) -> set[str]:
    """Project modules that loading ``start`` and calling into it can load (``start`` included):
    every import that is not under ``TYPE_CHECKING``, function-level ones too."""
    edges: dict[str, set[str]] = {}
    for imp in imports:
        if not imp.type_checking:
            edges.setdefault(imp.source, set()).add(imp.target)
    seen, todo = {start}, [start]
    while todo:
        for target in edges.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def violations(imports: Sequence[Import], rules: Sequence[Rule]) -> dict[str, list[str]]:
    """Broken rules, each with its offending arrows as ``file:line target (where)``."""
    sources = {imp.source for imp in imports}
    broken: dict[str, list[str]] = {}
    for rule in rules:
        governed = {m for m in sources if rule.governs(m)}
        if rule.transitive:
            governed = set().union(*(runtime_closure(m, imports) for m in governed))
        lines = [f"{imp.path}:{imp.line} {imp.target} ({imp.where()})" for imp in imports
                 if imp.source in governed and rule.breaks(imp)
                 and not (rule.transitive and imp.type_checking)]
        if lines:
            broken[rule.text] = lines
    return broken


def cycles(imports: Sequence[Import]) -> list[list[str]]:
    """One cycle path (first module repeated at the end) per strongly connected group of
    project modules that import each other through imports that can run (function-level ones
    included)."""
    graph: dict[str, list[str]] = {}
    for imp in imports:
        graph.setdefault(imp.source, [])
    for imp in imports:
        if imp.runs and imp.target in graph and imp.target not in graph[imp.source]:
            graph[imp.source].append(imp.target)
    return [_cycle_in(group, graph) for group in _strong_components(graph)
            if len(group) > 1 or group[0] in graph[group[0]]]


def _strong_components(graph: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (no recursion limit on deep import chains)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group: list[str] = []
                    while not group or group[-1] != node:
                        group.append(stack.pop())
                        on_stack.discard(group[-1])
                    groups.append(sorted(group))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(graph[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return groups


def _cycle_in(group: list[str], graph: dict[str, list[str]]) -> list[str]:
    """A shortest cycle through the group's first module (breadth-first inside the group)."""
    start, members = group[0], set(group)
    parent: dict[str, str] = {}
    todo = [start]
    while todo:
        node = todo.pop(0)
        for child in graph[node]:
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if child in members and child not in parent:
                parent[child] = node
                todo.append(child)
    raise AssertionError(f"no cycle through {start}")


def report(broken: dict[str, list[str]], loops: list[list[str]]) -> str:
    lines = []
    for rule, arrows in broken.items():
        lines += [f"rule broken: {rule}", *(f"    {a}" for a in arrows)]
    lines += [f"import cycle: {' -> '.join(loop)}" for loop in loops]
    return "\n".join(lines)


# ---- the tests -------------------------------------------------------------------------------


def test_the_house_rules_hold() -> None:
    imports = read_imports(ROOT, project_modules(ROOT, PACKAGES))
    broken, loops = violations(imports, RULES), cycles(imports)
    if broken or loops:
        pytest.fail("\n" + report(broken, loops), pytrace=False)


def test_every_source_room_is_checked() -> None:
    """A new top-level package must be added to PACKAGES (and given its rules)."""
    rooms = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert rooms == set(PACKAGES)


@pytest.mark.parametrize(("room", "subrooms"), [("engine", ENGINE_ROOMS),
                                                ("transfer", TRANSFER_ROOMS)])
def test_every_sub_room_is_named_and_says_what_it_holds(room: str, subrooms: tuple[str, ...]
                                                        ) -> None:
    """Each sub-room of engine/ and transfer/ is listed here (and so has its arrows), and its
    ``__init__`` docstring says what it holds; engine/ keeps few modules at its top."""
    found = {p.parent.name for p in (ROOT / room).glob("*/__init__.py")}
    assert found == set(subrooms)
    for sub in (ROOT / room).rglob("__init__.py"):
        assert ast.get_docstring(ast.parse(sub.read_text())), f"{sub} has no docstring"
    if room == "engine":
        assert len(list((ROOT / room).glob("*.py"))) <= ENGINE_TOP_MODULES


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def _rule(start: str) -> str:
    """The text of the one rule that starts with ``start``."""
    (text,) = [r.text for r in RULES if r.text.startswith(start)]
    return text


def test_the_checker_reports_arrows_and_cycles(tmp_path: Path) -> None:
    _write(tmp_path, {
        "engine/__init__.py": "",
        "engine/core/scheduler.py": "from engine import helper\n",
        "engine/helper.py": "def f():\n    import torch\n",
        "engine/a.py": "import engine.b\nfrom typing import TYPE_CHECKING\n"
                       "if TYPE_CHECKING:\n    from transfer.base import X\n",
        "engine/b.py": "from . import c\n",
        "engine/c.py": "from engine.a import thing\n",
        "engine/d.py": "def f():\n    from engine import a\n",
        "engine/e.py": "import engine.f\n",
        "engine/f.py": "def g():\n    import engine.e\n",
        "engine/models/m.py": "from engine.runner.model_runner import X\n"
                              "from engine.parallel.shard import TextShard\n",
        "engine/runner/r.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from engine.llm_engine import LLMEngine\n"
                              "from engine.sampling.sampler import Sampler\n",
        "transfer/__init__.py": "",
        "transfer/base.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                            "    from engine.kv.pool import BufferInfo\n"
                            "from engine.errors import EngineError\nimport grpc\n",
        "transfer/bad.py": "from engine.kv.pool import BufferInfo\nimport mooncake.engine\n",
        "transfer/plan/p.py": "import torch\nfrom transfer.errors import E\n",
        "proto/__init__.py": "",
        "proto/convert.py": "import os\nimport numpy\nfrom engine.errors import E\nimport torch\n",
    })
    imports = read_imports(tmp_path, project_modules(tmp_path, ("engine", "transfer", "proto")))
    broken = violations(imports, RULES)
    assert broken == {
        _rule("engine imports no networking"): [
            "engine/a.py:4 transfer.base (under TYPE_CHECKING)"],
        _rule("the scheduler core"): ["engine/helper.py:2 torch (in a function)"],
        _rule("transfer imports no model code"): [
            "transfer/bad.py:1 engine.kv.pool (at module level)"],
        _rule("proto imports only"): ["proto/convert.py:4 torch (at module level)"],
        _rule("engine/core/"): ["engine/core/scheduler.py:1 engine.helper (at module level)"],
        _rule("engine/models/"): [
            "engine/models/m.py:1 engine.runner.model_runner (at module level)"],
        _rule("engine/runner/"): ["engine/runner/r.py:4 engine.sampling.sampler (at module level)"],
        _rule("transfer/plan/"): ["transfer/plan/p.py:1 torch (at module level)"],
        _rule("only transfer/backends/"): ["transfer/bad.py:2 mooncake.engine (at module level)"],
    }
    loops = cycles(imports)
    assert loops == [["engine.a", "engine.b", "engine.c", "engine.a"],
                     ["engine.e", "engine.f", "engine.e"]]
    text = report(broken, loops)
    assert "engine/helper.py:2 torch" in text and "engine.a -> engine.b -> engine.c" in text


def test_patterns() -> None:
    assert matches("grpc_health.v1", ("grpc_*",)) and matches("grpc.aio", ("grpc",))
    assert not matches("grpcx", ("grpc",)) and not matches("engine_x", ("engine",))
    assert matches("torch", (ANY_NON_STDLIB,)) and not matches("os.path", (ANY_NON_STDLIB,))
