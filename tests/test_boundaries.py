"""The KV boundary: code outside `edmm/engine/` and `edmm/memory/` reaches KV memory only through
the public queries of `Engine` and `KVCacheManager`.

Statically (`ast`), every module under `edmm/` outside those two packages (and under
`benchmarks/scripts/`, where that folder exists) is checked for:

- an attribute that engine or memory code names privately (``engine.kv._arena``,
  ``runner._decode``, a module's ``_helper``), read or written on anything but ``self``/``cls``;
- an import of a private module or name of those packages (``from edmm.engine.engine import
  _model_folder``);
- an assignment to, or a deletion of, an attribute named like a method of their classes on
  anything but ``self``/``cls``: monkeypatching (``arena.grow = timed(arena.grow)``,
  ``del index.acquire``).

At run time no public attribute of a built `Engine` or of its `KVCacheManager` is one of the
objects behind the seam (arena, pool, prefix index, host store, scheduler, runner, backend).
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from edmm.engine import Engine, EngineConfig, ModelRunner, PrefixCache, Scheduler
from edmm.memory import KVArena, PagePool
from edmm.memory.host import HostVMM
from edmm.memory.offload import HostKVStore

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "edmm"
INTERNAL = ("engine", "memory")  # packages under edmm/ whose internals stay inside
SELF = ("self", "cls")
# Private names that other libraries' objects carry too, and that code outside reads on those
# objects: a Hugging Face fast tokenizer keeps its `tokenizers.Tokenizer` in ``_tokenizer``.
FOREIGN = frozenset({"_tokenizer"})


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _internal_paths() -> list[Path]:
    return sorted(p for pkg in INTERNAL for p in (PACKAGE / pkg).rglob("*.py"))


def _outside_paths() -> list[Path]:
    """Modules of edmm/ outside the internal packages, and benchmarks/scripts/ if present."""
    inside = {PACKAGE / pkg for pkg in INTERNAL}
    paths = [p for p in PACKAGE.rglob("*.py") if not inside & set(p.parents)]
    scripts = ROOT / "benchmarks" / "scripts"
    if scripts.is_dir():
        paths += scripts.rglob("*.py")
    return sorted(paths)


@dataclass(frozen=True)
class Internals:
    """What the engine and memory packages keep to themselves, and what they define."""

    private: frozenset[str]  # private attribute, method and module-level names
    methods: frozenset[str]  # public methods of their classes (properties aside)


def _is_property(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for d in fn.decorator_list:
        name = d.id if isinstance(d, ast.Name) else d.attr if isinstance(d, ast.Attribute) else ""
        if name in ("property", "cached_property", "setter", "deleter"):
            return True
    return False


def _assigned_names(node: ast.stmt) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else (
        [node.target] if isinstance(node, ast.AnnAssign) else [])
    return [t.id for t in targets if isinstance(t, ast.Name)]


@cache
def internals() -> Internals:
    """Names defined by every module of the engine and memory packages."""
    private: set[str] = set()
    methods: set[str] = set()
    for path in _internal_paths():
        tree = ast.parse(path.read_text(), str(path))
        for stmt in tree.body:  # module level: functions, classes, constants
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                private.update([stmt.name] if _is_private(stmt.name) else [])
            private.update(n for n in _assigned_names(stmt) if _is_private(n))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        if _is_private(item.name):
                            private.add(item.name)
                        elif not item.name.startswith("__") and not _is_property(item):
                            methods.add(item.name)
                    private.update(n for n in _assigned_names(item) if _is_private(n))
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in SELF
                  and _is_private(node.attr)):
                private.add(node.attr)
    return Internals(frozenset(private) - FOREIGN, frozenset(methods))


def _on_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in SELF


def _internal_module(module: str) -> bool:
    return any(module == f"edmm.{pkg}" or module.startswith(f"edmm.{pkg}.") for pkg in INTERNAL)


def _import_violations(node: ast.Import | ast.ImportFrom) -> Iterator[tuple[int, str]]:
    if isinstance(node, ast.ImportFrom):
        module = node.module or ""
        if node.level == 0 and _internal_module(module):
            if any(_is_private(part) for part in module.split(".")):
                yield node.lineno, f"imports private module {module}"
            for alias in node.names:
                if _is_private(alias.name):
                    yield node.lineno, f"imports private {module}.{alias.name}"
        return
    for alias in node.names:
        if _internal_module(alias.name) and any(_is_private(p) for p in alias.name.split(".")):
            yield node.lineno, f"imports private module {alias.name}"


def _patched(node: ast.AST) -> list[ast.Attribute]:
    """Attributes that ``node`` assigns or deletes."""
    if isinstance(node, ast.Assign):
        targets = [t for target in node.targets for t in ast.walk(target)]
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = list(node.targets)
    else:
        return []
    return [t for t in targets if isinstance(t, ast.Attribute) and not isinstance(t.ctx, ast.Load)]


def violations(source: str, filename: str = "<source>",
               found: Internals | None = None) -> list[str]:
    """``filename:line: what`` for each reach past the boundary in ``source``."""
    names = found if found is not None else internals()
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute) and node.attr in names.private and not _on_self(
                node.value):
            out.append((node.lineno, f"touches private .{node.attr}"))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.extend(_import_violations(node))
        for target in _patched(node):
            if target.attr in names.methods and not _on_self(target.value):
                out.append((target.lineno, f"monkeypatches .{target.attr}"))
    return [f"{filename}:{line}: {what}" for line, what in sorted(out)]


# ---------------------------------------------------------------------- the checks
def test_the_internal_names_are_found() -> None:
    """The scan sees what the engine and memory packages keep private (otherwise the check
    below could pass by finding nothing to look for)."""
    found = internals()
    assert {"_arena", "_index", "_scheduler", "_runner", "_decode", "_lru"} <= found.private
    assert {"grow", "acquire", "forward", "free", "allocate"} <= found.methods
    assert "max_tokens" not in found.methods  # a property: assigning one is no monkeypatch


@pytest.mark.parametrize("source", [
    "engine.kv._arena.free(3)",
    "index = agent.engine.kv._index",
    "seqs = engine._scheduler.running",
    "graph = runner._decode[1].graph",
    "from edmm.engine.engine import _model_folder",
    "from edmm.memory._hidden import thing",
    "import edmm.engine._hidden",
    "side.arena.grow = timed(side.arena.grow)",
    "index.acquire = timed(index.acquire)",
    "del index.acquire",
    "engine.step, other = spy, None",
    "runner.forward += 1",
], ids=lambda s: s.split(" ")[0][:24])
def test_a_reach_past_the_boundary_is_caught(source: str) -> None:
    assert violations(source), source


@pytest.mark.parametrize("source", [
    "self._arena = arena\nself._index.clear()",
    "engine.kv.discard([tag])\nengine.reclaim()\nengine.memory_short()",
    "pages = engine.stats().kv.pages_in_use\nlayout = engine.kv.layout()",
    "side.arena.grow(side.slot, 16)",  # a bench's own arena: its public methods
    "parser._actions",  # a private name of another library
    "from edmm.kernels._common import CounterWorkspace",  # not the engine's or memory's
    "from edmm.engine import Engine",
    "cfg.max_tokens = 8",  # a property's name: no method to patch
], ids=lambda s: s.split("\n")[0][:24])
def test_public_use_passes(source: str) -> None:
    assert violations(source) == []


def test_nothing_outside_engine_and_memory_reaches_their_internals() -> None:
    paths = _outside_paths()
    assert len(paths) > 50 and PACKAGE / "agent" / "api.py" in paths
    found = [v for p in paths for v in violations(p.read_text(), str(p.relative_to(ROOT)))]
    assert found == [], "\n".join(found)


_BEHIND_THE_SEAM = (KVArena, PagePool, PrefixCache, HostKVStore, Scheduler, ModelRunner,
                    HostVMM)


def _public_values(owner: object) -> Iterator[tuple[str, object]]:
    for name, value in vars(owner).items():
        if not name.startswith("_"):
            yield name, value
    for name, _ in inspect.getmembers(type(owner), lambda a: isinstance(a, property)):
        if not name.startswith("_"):
            yield name, getattr(owner, name)


def test_engine_and_manager_expose_no_object_behind_the_seam(tiny_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_dir), dtype="float32", host_page_size=16384,
                          max_model_len=64, num_pages=16, num_slots=4, max_num_seqs=2,
                          kv_offload_bytes=1 << 20)
    with Engine(config) as engine:
        exposed = [f"{type(owner).__name__}.{name}" for owner in (engine, engine.kv)
                   for name, value in _public_values(owner)
                   if isinstance(value, _BEHIND_THE_SEAM)]
        assert exposed == []
        assert isinstance(engine._runner, ModelRunner)  # the check can see them when public
        assert isinstance(engine.kv._arena, KVArena)
