"""The import graph keeps the layers of docs/architecture.md.

Read from the source with ``ast`` (nothing is imported): every ``import`` in
``fibrl/``, at module level or inside a function (a lazy import is still an
arrow), except those under ``if TYPE_CHECKING:``. A failure names the module
and what it imports; the fix is to hand the lower layer what it needs when it
is built, or to declare the seam public in the package that owns it.
"""
from __future__ import annotations

import ast
from pathlib import Path

import fibrl
from fibrl.backends import REGISTRY
from fibrl.config import BACKENDS

ROOT = Path(fibrl.__file__).parent

# Bottom to top. A module may import its own layer and the ones below, never above.
LAYERS = (
    ("foundation", ("fibrl.errors", "fibrl.config", "fibrl.meta", "fibrl.timers", "fibrl._version",
                    "fibrl.janitor", "fibrl.backends", "fibrl.backends.base")),
    ("wire and backends", ("fibrl.wire", "fibrl.wire.*", "fibrl.backends.*")),
    ("runtime", ("fibrl.hosting.runtime",)),
    ("hosting", ("fibrl.hosting", "fibrl.hosting.hub", "fibrl.hosting.hosted",
                 "fibrl.hosting.mailbox", "fibrl.hosting.mailbox.*")),
    ("worker start", ("fibrl.popen", "fibrl.bootstrap")),
    ("API", ("fibrl", "fibrl.channel", "fibrl.supervisor", "fibrl.context", "fibrl.process",
             "fibrl.queues", "fibrl.connection", "fibrl.sharedctypes", "fibrl.futures",
             "fibrl.pool",
             "fibrl.pool.*", "fibrl.managers", "fibrl.managers.*", "fibrl.synchronize",
             "fibrl.synchronize.*")),
    ("tools and RL", ("fibrl.cli", "fibrl.launch", "fibrl.launch.*", "fibrl.rl",
                      "fibrl.rl.*")),
)

# The stdlib's own factory cycle: context's factories import pool and managers, which
# fall back to the default context.
ALLOWED_CYCLE = {"fibrl.context", "fibrl.pool", "fibrl.managers", "fibrl.managers.manager"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _layer(module: str) -> int:
    best = None
    for index, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            exact = pattern == module
            under = pattern.endswith(".*") and module.startswith(pattern[:-1])
            if exact:
                return index
            if under:
                best = index
    assert best is not None, f"{module} is in no layer of test_layers.LAYERS: add it"
    return best


def _imports(module: str) -> list[tuple[str, str]]:
    """``(imported module, name)`` pairs (name "" for ``import x``)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    typing_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(sub) for sub in ast.walk(node))
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")
                if path.name != "__init__.py":
                    package.pop()
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            found += [(base, alias.name) for alias in node.names]
    return [(target, name) for target, name in found if target.split(".")[0] == "fibrl"]


def _resolve(target: str, name: str) -> str:
    candidate = f"{target}.{name}" if name else target
    if candidate in MODULES:
        return candidate
    while target not in MODULES:
        target = target.rsplit(".", 1)[0]
    return target


def _edges() -> dict[str, set[str]]:
    return {module: {_resolve(t, n) for t, n in _imports(module)} - {module}
            for module in MODULES}


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


def test_no_module_imports_a_higher_layer():
    upward = [f"{a} ({LAYERS[_layer(a)][0]}) imports {b} ({LAYERS[_layer(b)][0]})"
              for a, targets in sorted(_edges().items()) for b in sorted(targets)
              if _layer(b) > _layer(a)]
    assert not upward, "lower layers import higher ones:\n" + "\n".join(upward)


def test_the_only_import_cycle_is_the_stdlib_factory_cycle():
    edges, index, low, stack, on, cycles = _edges(), {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(component)

    for module in sorted(edges):
        if module not in index:
            visit(module)
    extra = [sorted(c) for c in cycles if not c <= ALLOWED_CYCLE]
    assert not extra, f"import cycles beyond context <-> pool/managers: {extra}"


def test_no_module_imports_another_packages_underscore_names():
    def package(module: str) -> str:
        return module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]

    found = []
    for module in sorted(MODULES):
        for target, name in _imports(module):
            if not name.startswith("_") or name.startswith("__"):
                continue
            owner = _resolve(target, name)
            if package(owner) != package(module):
                found.append(f"{module} imports {owner}.{name}")
    assert not found, "private names used across packages:\n" + "\n".join(found)


# What code above the core may import: the modules a user of fibrl imports.
PUBLIC = ("fibrl", "fibrl.channel", "fibrl.connection", "fibrl.context", "fibrl.errors",
          "fibrl.futures", "fibrl.managers", "fibrl.pool", "fibrl.process", "fibrl.queues",
          "fibrl.sharedctypes", "fibrl.supervisor", "fibrl.synchronize")


def test_the_rl_layer_uses_only_the_public_api():
    """RL code is built as a user of fibrl would build it: a seam it needs (a fast
    point-to-point connection) is made public in the core, not reached around."""
    found = [f"{module} imports {_resolve(t, n)}"
             for module in sorted(MODULES) if module.startswith("fibrl.rl")
             for t, n in _imports(module)
             if not _resolve(t, n).startswith("fibrl.rl") and _resolve(t, n) not in PUBLIC]
    assert not found, "fibrl.rl reaches under the public API:\n" + "\n".join(found)


def test_backend_names_have_one_owner():
    assert tuple(REGISTRY) == BACKENDS


def test_one_conftest_module():
    """Test modules import helpers with ``from conftest import ...``; a second
    conftest.py (their folders are no packages) would take that name for every module
    collected after it."""
    tests = Path(__file__).resolve().parents[1]
    assert sorted(p.relative_to(tests).as_posix() for p in tests.rglob("conftest.py")) \
        == ["conftest.py"]


LARGE_CLASS = 320   # lines: "about 300", with room for a docstring's growth


def test_a_large_class_says_why_it_is_one_class():
    """A class of more than about 300 lines says in its docstring why it is not split
    ("Why one class of this size: ..."): usually one lock or one thread over state
    that changes together."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                size = node.end_lineno - node.lineno + 1
                doc = ast.get_docstring(node) or ""
                if size > LARGE_CLASS and "Why one class of this size:" not in doc:
                    found.append(f"{path.relative_to(ROOT.parent)}: {node.name}, {size} lines")
    assert not found, "large classes that do not say why:\n" + "\n".join(found)
