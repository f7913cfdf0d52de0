"""The tree's shape budgets, read from the source with :mod:`ast` (nothing is imported).

* **Import graph** (``test_no_import_cycle``): one node per module under ``kvarena/`` (a
  package is its ``__init__`` module). Every ``import`` / ``from ... import`` statement counts,
  function-local ones included; only those under ``if TYPE_CHECKING:`` are left out (they
  never run). ``import kvarena.a.b`` is an edge to ``kvarena.a.b``; ``from kvarena.a import
  b`` is an edge to ``kvarena.a.b`` when that is a module and to ``kvarena.a`` otherwise;
  relative imports resolve against the importing module's package. The graph has no edge
  from a submodule to its parent packages, so the usual ``__init__`` that re-exports its
  submodules is not a cycle.
* **Module size** (``test_module_size``): no module over ``MAX_MODULE_LINES`` lines (the
  physical line count of the file), except those in ``MODULE_SIZE_EXEMPT``.
* **Function size** (``test_function_size``): no function (``def`` or ``async def``, nested
  ones and methods included, each on its own) over ``MAX_FUNCTION_LINES`` lines, counted
  from the ``def`` line (decorators not counted) to the function's last line, minus the
  lines of its docstring. Functions decorated with ``triton.jit`` (Triton kernels) and
  the functions nested in them are exempt.
* **Triton function parameters** (``test_jit_parameters``): a ``triton.jit`` helper (a
  function the kernels call) takes at most ``MAX_JIT_HELPER_PARAMS`` parameters: past that
  its call sites cannot be read, and related values travel as a record (a ``NamedTuple``,
  e.g. ``kernels/attn_tiles.py``). A kernel (a ``triton.jit`` function named ``*_kernel``,
  the one a launcher runs) takes at most ``MAX_KERNEL_PARAMS``: its parameters are its
  launch signature, one per pointer, stride and scalar, which ``kvarena check`` compiles
  by name (records there would change that signature); the bound is the forward kernel's
  count, so a kernel growing past it is a decision taken here.
* **Layering** (``test_layering``): ``kvarena.kernels`` imports nothing from
  ``kvarena.attention`` / ``kvarena.cache`` / ``kvarena.integrations``;
  ``kvarena.attention`` nothing from ``kvarena.cache`` / ``kvarena.integrations``;
  ``kvarena.cache`` nothing from ``kvarena.integrations`` (direct imports). And the arena
  modules (``kvarena/cache/arena*.py``, ``layout.py``, ``allocator.py``) reach, through
  everything importing them runs, no module that registers ``torch.library`` ops
  (``OP_REGISTERING``): this closure does follow the parent packages, because importing
  ``kvarena.a.b`` runs the package ``kvarena.a`` (its ``__init__``) first.

* **The integration seam** (``test_integrations_use_public_names``): no module under
  ``kvarena/integrations/`` imports, from the rest of ``kvarena``, a private name (``from
  kvarena.x import _name``) or anything of a private module (a dotted path with a part
  starting with ``_``: ``kvarena._checks``, ``kvarena.cache._meta``), function-local imports
  included; its own private modules (``kvarena.integrations.hf._common``) are its business.
* **Pool privacy** (``test_no_cross_package_private_access``): a *private member of a pool*
  is a name ``_x`` (not ``__x__``) that a class in a pool package (``POOL_PACKAGES``:
  ``kvarena/cache/paged/``, ``kvarena/cache/slab/``) or in the pools' shared base
  (``POOL_BASE``: ``kvarena/cache/_pool.py``, part of both packages) defines: a method, a
  ``self._x = ...`` assignment or a class-level name. A name some class elsewhere in
  ``kvarena`` also defines is not attributed (the source alone cannot tell whose it is).
  Then no expression ``obj._x`` (``obj`` not ``self`` / ``cls``) reads a private member of
  a pool outside the packages that define it: not in a module outside the pool packages
  and the base, and not in one pool package for a member only the other one defines.
  And outside the pool packages and the base, nothing reads any ``_x`` of an object named
  as a pool (``pool._x``, ``self.pool._x``, ``cache._pool._x``: the tree's name for one).

The ``*_can_fail`` tests feed the same checking functions a small synthetic tree with a
violation each, so a check that silently stopped seeing anything would fail too.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "kvarena"

MAX_MODULE_LINES = 600
MODULE_SIZE_EXEMPT: frozenset[str] = frozenset()  # none: every module fits the budget
MAX_FUNCTION_LINES = 80
MAX_JIT_HELPER_PARAMS = 25
MAX_KERNEL_PARAMS = 85

#: (importing package, forbidden packages): direct imports only.
LAYERS = (
    ("kvarena.kernels", ("kvarena.attention", "kvarena.cache", "kvarena.integrations")),
    ("kvarena.attention", ("kvarena.cache", "kvarena.integrations")),
    ("kvarena.cache", ("kvarena.integrations",)),
)
#: modules that register torch.library ops when imported.
OP_REGISTERING = frozenset(
    {"kvarena.attention.library", "kvarena.attention.dispatch", "kvarena.attention.ops"}
)


@dataclass(frozen=True)
class Module:
    name: str
    rel: str  # path relative to the repository root
    is_package: bool
    tree: ast.Module
    n_lines: int


@dataclass(frozen=True)
class ImportEdge:
    source: str
    target: str
    lineno: int


def _module_name(rel: Path) -> tuple[str, bool]:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def load_modules(root: Path, package: str = PACKAGE) -> dict[str, Module]:
    """Every ``.py`` file under ``root/package``, parsed, by dotted module name."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root)
        name, is_package = _module_name(rel)
        text = path.read_text()
        modules[name] = Module(
            name, rel.as_posix(), is_package, ast.parse(text, filename=str(rel)),
            len(text.splitlines()),
        )
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST):
    """Import statements under ``node``, at any depth, skipping ``if TYPE_CHECKING:`` bodies."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _import_nodes(ast.Module(body=[other], type_ignores=[]))
        else:
            yield from _import_nodes(child)


def _known(name: str, modules: dict[str, Module]) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules`` (None outside the tree)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_edges(modules: dict[str, Module]) -> list[ImportEdge]:
    """Every import of one tree module by another (see the module docstring for the rules)."""
    edges = []
    for mod in modules.values():
        package = mod.name if mod.is_package else mod.name.rpartition(".")[0]
        for node in _import_nodes(mod.tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [_known(alias.name, modules) for alias in node.names]
            else:
                if node.level:
                    base_parts = package.split(".")
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.append(full if full in modules else _known(base, modules))
            for target in targets:
                if target is not None and target != mod.name:
                    edges.append(ImportEdge(mod.name, target, node.lineno))
    return edges


def _graph(edges: list[ImportEdge]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One concrete cycle (``[a, b, ..., a]``) per strongly connected component of ``graph``
    with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return [_cycle_in(graph, set(c), c[0]) for c in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str], start: str) -> list[str]:
    """A shortest path ``start -> ... -> start`` inside ``component`` (breadth-first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{start} is in no cycle of its component")


def describe_cycle(cycle: list[str], edges: list[ImportEdge], modules: dict[str, Module]) -> str:
    where = {}
    for e in edges:
        where.setdefault((e.source, e.target), e.lineno)
    hops = [
        f"{modules[a].rel}:{where[(a, b)]} imports {b}" for a, b in zip(cycle, cycle[1:])
    ]
    return " -> ".join(cycle) + "\n    " + "\n    ".join(hops)


@dataclass(frozen=True)
class FunctionSize:
    rel: str
    lineno: int
    qualname: str
    n_lines: int


def _is_triton_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (
        isinstance(target, ast.Attribute)
        and target.attr == "jit"
        and isinstance(target.value, ast.Name)
        and target.value.id == "triton"
    )


def function_sizes(mod: Module) -> list[FunctionSize]:
    """Every function of ``mod`` outside ``triton.jit`` kernels, with its counted length."""
    sizes = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                if any(_is_triton_jit(d) for d in child.decorator_list):
                    continue
                n_lines = child.end_lineno - child.lineno + 1
                body = child.body
                if (
                    body
                    and isinstance(body[0], ast.Expr)
                    and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)
                ):
                    n_lines -= body[0].end_lineno - body[0].lineno + 1
                qualname = f"{prefix}{child.name}"
                sizes.append(FunctionSize(mod.rel, child.lineno, qualname, n_lines))
                visit(child, f"{qualname}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(mod.tree, "")
    return sizes


@dataclass(frozen=True)
class JitParams:
    rel: str
    lineno: int
    name: str
    n_params: int

    @property
    def is_kernel(self) -> bool:
        return self.name.endswith("_kernel")

    @property
    def bound(self) -> int:
        return MAX_KERNEL_PARAMS if self.is_kernel else MAX_JIT_HELPER_PARAMS


def jit_params(mod: Module) -> list[JitParams]:
    """Every ``triton.jit`` function of ``mod`` with its parameter count."""
    out = []
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.FunctionDef) and any(_is_triton_jit(d) for d in node.decorator_list):
            a = node.args
            n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
            out.append(JitParams(mod.rel, node.lineno, node.name, n))
    return out


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def layering_violations(modules: dict[str, Module], edges: list[ImportEdge]) -> list[str]:
    out = []
    for e in edges:
        for layer, forbidden in LAYERS:
            if _under(e.source, layer):
                for banned in forbidden:
                    if _under(e.target, banned):
                        out.append(
                            f"{modules[e.source].rel}:{e.lineno}: {e.source} ({layer}) "
                            f"imports {e.target} ({banned} is above it)"
                        )
    return out


def _arena_modules(modules: dict[str, Module]) -> list[str]:
    names = []
    for name, mod in modules.items():
        stem = Path(mod.rel).name
        if mod.rel.startswith("kvarena/cache/") and (
            stem.startswith("arena") or stem in ("layout.py", "allocator.py")
        ):
            names.append(name)
    return sorted(names)


def _runtime_graph(modules: dict[str, Module], edges: list[ImportEdge]) -> dict[str, set[str]]:
    """The import graph plus, for each module, the parent packages importing it runs."""
    graph = {name: set() for name in modules}
    for e in edges:
        graph[e.source].add(e.target)
    for name in modules:
        parts = name.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent in modules:
                graph[name].add(parent)
    return graph


def op_registration_paths(
    modules: dict[str, Module], edges: list[ImportEdge], sources: list[str]
) -> list[str]:
    """For each of ``sources`` that reaches an ``OP_REGISTERING`` module: the import path."""
    graph = _runtime_graph(modules, edges)
    where = {}
    for e in edges:
        where.setdefault((e.source, e.target), e.lineno)
    out = []
    for source in sources:
        previous = {source: None}
        frontier = [source]
        hit = None
        while frontier and hit is None:
            following = []
            for node in frontier:
                for child in sorted(graph[node]):
                    if child in previous:
                        continue
                    previous[child] = node
                    if child in OP_REGISTERING:
                        hit = child
                        break
                    following.append(child)
                if hit is not None:
                    break
            frontier = following
        if hit is None:
            continue
        path = [hit]
        while previous[path[-1]] is not None:
            path.append(previous[path[-1]])
        path.reverse()
        hops = []
        for a, b in zip(path, path[1:]):
            line = where.get((a, b))
            how = f"{modules[a].rel}:{line} imports {b}" if line else f"{a} runs its package {b}"
            hops.append(how)
        out.append(f"{source} registers ops on import: " + "; ".join(hops))
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def integration_private_imports(modules: dict[str, Module]) -> list[str]:
    """Imports of a private name or module of ``kvarena`` (outside ``kvarena.integrations``)
    by a module of ``kvarena.integrations`` (see the module docstring)."""
    out = []
    for mod in modules.values():
        if not _under(mod.name, f"{PACKAGE}.integrations"):
            continue
        package = mod.name if mod.is_package else mod.name.rpartition(".")[0]
        for node in _import_nodes(mod.tree):
            if isinstance(node, ast.Import):
                paths = [alias.name for alias in node.names]
            elif node.level:
                base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
                paths = [f"{base}.{alias.name}" for alias in node.names]
            else:
                paths = [f"{node.module}.{alias.name}" for alias in node.names]
            for path in paths:
                if not _under(path, PACKAGE) or _under(path, f"{PACKAGE}.integrations"):
                    continue
                if any(_private(part) for part in path.split(".")):
                    out.append(f"{mod.rel}:{node.lineno}: {mod.name} imports {path} (private)")
    return out


POOL_PACKAGES = (f"{PACKAGE}.cache.paged", f"{PACKAGE}.cache.slab")
POOL_BASE = (f"{PACKAGE}.cache._pool",)
#: How the tree names an object that is a pool (the receivers of the second rule).
POOL_NAMES = frozenset({"pool", "_pool"})


def _home(name: str) -> str | None:
    """The pool package a module belongs to (the base: ``"base"``), or None."""
    if name in POOL_BASE:
        return "base"
    return next((pkg for pkg in POOL_PACKAGES if _under(name, pkg)), None)


def _class_members(tree: ast.Module):
    """The private names the classes of ``tree`` define (methods, ``self._x =``, class names)."""
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        for node in ast.walk(cls):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield node.name
            elif isinstance(node, ast.AnnAssign | ast.Assign):
                for target in [node.target] if isinstance(node, ast.AnnAssign) else node.targets:
                    if isinstance(target, ast.Name):
                        yield target.id
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id == "self"):
                yield node.attr


def _is_pool(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id in POOL_NAMES) or (
        isinstance(node, ast.Attribute) and node.attr in POOL_NAMES)


def private_member_reads(modules: dict[str, Module]) -> list[str]:
    """Reads of a pool's private members outside the packages that define them (see the
    module docstring)."""
    owners: dict[str, set[str]] = {}
    for mod in modules.values():
        home = _home(mod.name) or "elsewhere"
        for name in _class_members(mod.tree):
            if _private(name):
                owners.setdefault(name, set()).add(home)
    out = []
    for mod in modules.values():
        home = _home(mod.name)
        allowed = {"base", *POOL_PACKAGES} if home == "base" else {home, "base"}
        for node in ast.walk(mod.tree):
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            whose = owners.get(node.attr, set())
            pooled = bool(whose) and "elsewhere" not in whose and not (whose & allowed)
            if pooled or (home is None and _is_pool(node.value)):
                out.append(f"{mod.rel}:{node.lineno}: {ast.unparse(node)} reads a private member of a pool")
    return out


MODULES = load_modules(ROOT)
EDGES = import_edges(MODULES)


def test_tree_is_seen():
    assert "kvarena.cache.arena" in MODULES and "kvarena.attention" in MODULES
    assert len(EDGES) > 50, f"only {len(EDGES)} import edges found in kvarena/"


def test_no_import_cycle():
    cycles = find_cycles(_graph(EDGES))
    assert not cycles, "import cycles in kvarena/:\n" + "\n".join(
        describe_cycle(c, EDGES, MODULES) for c in cycles
    )


@pytest.mark.parametrize("name", sorted(MODULES), ids=lambda n: MODULES[n].rel)
def test_module_size(name):
    mod = MODULES[name]
    if mod.rel in MODULE_SIZE_EXEMPT:
        return
    assert mod.n_lines <= MAX_MODULE_LINES, (
        f"{mod.rel}:1: {mod.n_lines} lines, over the {MAX_MODULE_LINES}-line budget"
    )


@pytest.mark.parametrize("name", sorted(MODULES), ids=lambda n: MODULES[n].rel)
def test_function_size(name):
    long = [f for f in function_sizes(MODULES[name]) if f.n_lines > MAX_FUNCTION_LINES]
    assert not long, "\n".join(
        f"{f.rel}:{f.lineno}: {f.qualname} is {f.n_lines} lines without its docstring, "
        f"over the {MAX_FUNCTION_LINES}-line budget"
        for f in long
    )


@pytest.mark.parametrize("name", sorted(MODULES), ids=lambda n: MODULES[n].rel)
def test_jit_parameters(name):
    wide = [f for f in jit_params(MODULES[name]) if f.n_params > f.bound]
    assert not wide, "\n".join(
        f"{f.rel}:{f.lineno}: {f.name} takes {f.n_params} parameters, over the "
        f"{f.bound} of a Triton {'kernel' if f.is_kernel else 'helper'}"
        for f in wide
    )


def test_jit_parameters_are_seen():
    counts = {f.name: f.n_params for m in MODULES.values() for f in jit_params(m)}
    assert counts.get("_paged_attn_kernel", 0) > MAX_JIT_HELPER_PARAMS  # a kernel, under its own bound
    assert 0 < counts.get("_page_tiles", 0) <= MAX_JIT_HELPER_PARAMS


def test_layering():
    bad = layering_violations(MODULES, EDGES)
    bad += op_registration_paths(MODULES, EDGES, _arena_modules(MODULES))
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_integrations_use_public_names():
    bad = integration_private_imports(MODULES)
    assert not bad, "integrations import private names of kvarena:\n" + "\n".join(bad)


def test_no_cross_package_private_access():
    bad = private_member_reads(MODULES)
    assert not bad, "private members of a pool read outside its package:\n" + "\n".join(bad)


#: A small tree with one violation of each kind, by module name (packages: ``SYNTHETIC_PACKAGES``).
SYNTHETIC = {
    "kvarena": "",
    "kvarena.kernels": "",
    "kvarena.kernels.k": (
        "import triton\n\n@triton.jit\ndef kern():\n" + "    x = 1\n" * 90
        + "\n@triton.jit\ndef _helper(" + ", ".join(f"a{i}" for i in range(MAX_JIT_HELPER_PARAMS + 1)) + "):\n"
        + "    pass\n\n@triton.jit\ndef _fine_kernel(" + ", ".join(f"a{i}" for i in range(MAX_KERNEL_PARAMS))
        + "):\n    pass\n"
    ),
    "kvarena.attention": "from kvarena.attention import ops\n",
    "kvarena.attention.ops": "",
    "kvarena.attention.a": "def f():\n    from kvarena.cache import b\n",
    "kvarena.cache": "",
    "kvarena.cache.b": "from .arena import X\n",
    "kvarena.cache.arena": (
        "from kvarena.attention.spec import S\n"
        "def long():\n    \'\'\'doc\n    doc\n    \'\'\'\n" + "    x = 1\n" * 80
    ),
    "kvarena.attention.spec": "from ..attention import a\n",
    # the integration seam: _own is the package's own; the other four are not
    "kvarena._checks": "",
    "kvarena.cache._meta": "",
    "kvarena.integrations": "",
    "kvarena.integrations._own": "",
    "kvarena.integrations.ok": "from kvarena.integrations import _own\nfrom . import _own as o\nfrom kvarena.cache import b\n",
    "kvarena.integrations.bad": (
        "from kvarena import _checks\nimport kvarena._checks\nfrom kvarena.cache.arena import _check_int\n"
        "def f():\n    from ..cache._meta import upload\n"
    ),
    # pool privacy: _seqs / _get are the paged pool's, _stamp the base's, _local also a class's elsewhere
    "kvarena.cache._pool": "class Base:\n    def _stamp(self):\n        return 0\n",
    "kvarena.cache.paged": "",
    "kvarena.cache.paged.pool": (
        "class Paged:\n    def __init__(self):\n        self._seqs = {}\n        self._local = 0\n"
        "    def _get(self):\n        return self._seqs\n"
    ),
    "kvarena.cache.paged.steps": "def f(pool, meta):\n    return pool._get(), pool._stamp(), meta._seqs\n",
    "kvarena.cache.slab": "",
    "kvarena.cache.slab.pool": "def f(other):\n    return other._seqs, other._stamp()\n",
    "kvarena.integrations.reads": (
        "class Scope:\n    def __init__(self):\n        self._local = 1\n"
        "def f(cache, scope, pool):\n    return cache.pool._region, scope._local, cache._get, pool._other\n"
    ),
}
SYNTHETIC_PACKAGES = {"kvarena", "kvarena.kernels", "kvarena.attention", "kvarena.cache", "kvarena.integrations",
                      "kvarena.cache.paged", "kvarena.cache.slab"}


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree")
    for name, text in SYNTHETIC.items():
        path = root.joinpath(*name.split("."))
        path = path / "__init__.py" if name in SYNTHETIC_PACKAGES else path.with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    modules = load_modules(root)
    return modules, import_edges(modules)


def test_cycle_check_can_fail(synthetic):
    modules, edges = synthetic
    # a.py -(function-local)-> cache.b -(relative)-> cache.arena -> attention.spec -> a.py
    cycles = find_cycles(_graph(edges))
    assert cycles == [
        ["kvarena.attention.a", "kvarena.cache.b", "kvarena.cache.arena",
         "kvarena.attention.spec", "kvarena.attention.a"]
    ]
    where = f"{modules['kvarena.cache.b'].rel}:1 imports kvarena.cache.arena"
    assert where in describe_cycle(cycles[0], edges, modules)
    assert find_cycles({"x": {"y"}, "y": set()}) == []


def test_size_checks_can_fail(synthetic):
    modules, _ = synthetic
    sizes = {f.qualname: f.n_lines for f in function_sizes(modules["kvarena.cache.arena"])}
    assert sizes == {"long": 81}  # 1 def line + 80 body lines; the 3 docstring lines are not counted
    assert function_sizes(modules["kvarena.kernels.k"]) == []  # triton.jit is exempt


def test_jit_parameter_check_can_fail(synthetic):
    modules, _ = synthetic
    found = {f.name: f for f in jit_params(modules["kvarena.kernels.k"])}
    assert {n: f.n_params for n, f in found.items()} == {
        "kern": 0, "_helper": MAX_JIT_HELPER_PARAMS + 1, "_fine_kernel": MAX_KERNEL_PARAMS}
    assert [f.name for f in found.values() if f.n_params > f.bound] == ["_helper"]


def test_layering_check_can_fail(synthetic):
    modules, edges = synthetic
    bad = layering_violations(modules, edges)
    assert len(bad) == 1 and bad[0].startswith(f"{modules['kvarena.attention.a'].rel}:2:")
    paths = op_registration_paths(modules, edges, _arena_modules(modules))
    assert len(paths) == 1 and "runs its package kvarena.attention" in paths[0]


def test_integration_seam_check_can_fail(synthetic):
    modules, _ = synthetic
    bad = integration_private_imports(modules)
    rel = modules["kvarena.integrations.bad"].rel
    assert bad == [
        f"{rel}:1: kvarena.integrations.bad imports kvarena._checks (private)",
        f"{rel}:2: kvarena.integrations.bad imports kvarena._checks (private)",
        f"{rel}:3: kvarena.integrations.bad imports kvarena.cache.arena._check_int (private)",
        f"{rel}:5: kvarena.integrations.bad imports kvarena.cache._meta.upload (private)",
    ]


def test_pool_privacy_check_can_fail(synthetic):
    modules, _ = synthetic
    bad = private_member_reads(modules)
    slab, reads = modules["kvarena.cache.slab.pool"].rel, modules["kvarena.integrations.reads"].rel
    assert bad == [
        f"{slab}:2: other._seqs reads a private member of a pool",  # the paged pool's, read in the slab package
        f"{reads}:5: cache.pool._region reads a private member of a pool",  # any _x of a pool, outside
        f"{reads}:5: cache._get reads a private member of a pool",  # the paged pool's name, outside
        f"{reads}:5: pool._other reads a private member of a pool",
    ]  # in the paged package its own and the base's are fine; _local is also Scope's: not attributed

