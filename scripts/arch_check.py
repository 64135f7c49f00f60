"""Static architecture check: measures the code's structure and fails on a regression.

    .venv/bin/python scripts/arch_check.py                 # CI: exit 1 when a measure is over
    .venv/bin/python scripts/arch_check.py --json out.json # the counts and findings as JSON

It reads the sources with ``ast`` (it imports nothing) and prints, for each measure,
``name: count (limit N)`` and one line per finding, ``path:line  what``. A finding is where to
look, not a verdict; the exit status is 1 when a count is over its limit in ``LIMITS``. The
measures (the first four read ``torchtitan/experiments/fault_tolerance`` only):

upward_calls
    Ways an object reaches into one of another module, or lets it call back up:
    (a) a write into another object's attributes: ``self.reporter.agreement = v``,
    ``param.x = 1``, ``setattr(param, ...)``. Not counted: objects of a library or of this
    module's own classes (where the code says the class: annotations, constructors), the
    attributes in ``ALLOWED_WRITES``, and a name the function binds itself (a record it builds,
    an alias, a loop variable) unless a callable is stored in it (``obj.cb = self._cb``).
    (b) A callable that carries the caller's state passed, inside a function, into another
    module of ours: a bound method (``self._cb``; ``self.protocol.load_peer`` where the
    collaborator's class is known), a lambda, a nested def, a ``functools.partial``. Calls into
    a library (known from the imports and the receiver's class) or matching ``EXTERNAL_SINKS``
    are not counted. (c) A class's ``__getattr__`` (it forwards every unknown attribute).
    A plain call or read on a collaborator (``self.method.agreement_digest()``) looks like any
    call down: it is not seen, nor is a write through an alias (``x = self.a; x.b = 1``).
import_cycles
    Groups of modules of the whole package that import each other (strongly connected
    components), from every import: top level, ``if TYPE_CHECKING:`` and inside functions.
    Importing ``a.b.c`` also runs the ``__init__`` of ``a`` and ``a.b`` unless it is empty or
    is a package of the importer (which has run already). Each edge is printed with its kind
    (top, type_checking, local; ``via x``: the package ``__init__`` importing ``x`` runs), so
    the import that closes the cycle can be seen.
longest_chain
    The most modules of the experiment on one import path (imports between its modules only),
    a cycle counted as one node (printed ``{a, b}``). Each line is one import of the chain.
forwarding_methods
    Methods that only pass their own parameters on, unchanged, to a method of a collaborator
    (``return self.manager.start_quorum(a, b)``), and properties that only return
    ``self.a.b``. Not counted: dunder methods, and wrappers of a library object the class keeps
    (``self._done.wait()`` on a ``threading.Event``: the class's implementation).
layer_violations
    An import from a module to a higher layer of ``LAYERS`` (the experiment, bottom to top) or
    of ``CORE_LAYERS`` (the core package); imports within a layer are allowed. A module is in
    the layer of its longest prefix (whole dotted parts). A module of the experiment in no
    layer is listed as ``unplaced`` and counted (the experiment's own ``__init__`` is not).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import fnmatch
import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "torchtitan"
EXPERIMENT = "torchtitan.experiments.fault_tolerance"

#: Where the code must get to (issue 64): no call back up, no cycle, chains no longer than the
#: layers plus 2, at most 3 methods that only forward.
TARGETS: dict[str, int] = {
    "upward_calls": 0,
    "import_cycles": 0,
    "longest_chain": 11,
    "forwarding_methods": 3,
    "layer_violations": 0,
}
#: What CI allows today: the targets, or today's count where the code is not there yet (lower a
#: limit as the code improves; never raise one).
LIMITS: dict[str, int] = {
    "upward_calls": 0,
    "import_cycles": 0,
    "longest_chain": 11,
    "forwarding_methods": 3,
    "layer_violations": 0,
}

Layers = Sequence[tuple[str, Sequence[str]]]
#: The experiment's layers, bottom to top: a module may import its own layer and those below.
LAYERS: Layers = [
    (
        "config",
        (
            "torchtitan.experiments.fault_tolerance.job_config",
            "torchtitan.experiments.fault_tolerance.events",
        ),
    ),
    ("transport", ("torchtitan.experiments.fault_tolerance.transport",)),
    ("heal", ("torchtitan.experiments.fault_tolerance.heal",)),
    ("sync", ("torchtitan.experiments.fault_tolerance.sync",)),
    ("methods", ("torchtitan.experiments.fault_tolerance.methods",)),
    ("join", ("torchtitan.experiments.fault_tolerance.join",)),
    ("report", ("torchtitan.experiments.fault_tolerance.report",)),
    ("launch", ("torchtitan.experiments.fault_tolerance.launch",)),
    (
        "entry",
        (
            "torchtitan.experiments.fault_tolerance.trainer",
            "torchtitan.experiments.fault_tolerance.method_state",
            "torchtitan.experiments.fault_tolerance.plan",
        ),
    ),
]
#: The core package's layers, bottom to top. distributed < components: components.ft.build
#: imports distributed.ParallelDims, never the reverse; models > components: a model's
#: TrainSpec names its loss builder (models.llama3 imports components.loss).
CORE_LAYERS: Layers = [
    ("tools", ("torchtitan.tools",)),
    ("config", ("torchtitan.config",)),
    ("distributed", ("torchtitan.distributed",)),
    ("components", ("torchtitan.components",)),
    ("models", ("torchtitan.models",)),
    ("trainer", ("torchtitan.trainer", "torchtitan.train")),
    ("experiments", ("torchtitan.experiments",)),
]

#: Attributes of torch's and the stdlib's objects, not ours: writing them uses the library.
ALLOWED_WRITES: dict[str, str] = {
    "grad": "a tensor's gradient, which optimizers read (torch)",
    "data": "a tensor's storage, swapped in place (torch)",
    "requires_grad": "autograd's flag on a tensor (torch)",
    "daemon": "a threading.Thread's flag, set before start()",
    "name": "a threading.Thread's name, shown in stack dumps",
    "timeout": "torch.distributed's collective options (AllreduceOptions.timeout)",
}
#: Where ``object.__setattr__(self, ...)`` is a frozen dataclass setting itself up.
FROZEN_SETUP = ("__init__", "__post_init__")
#: Calls that hand a callable to a library, matched (fnmatch) on the call as written, when the
#: receiver's class is unknown. Calls resolved through an import or a known class to a module
#: outside the package are external anyway (threading.Thread, torch.*, torchft, ...).
EXTERNAL_SINKS: tuple[str, ...] = (
    *("threading.Thread", "*.submit", "*.map"),  # a thread's target, an executor's or pool's task
    *("*register_*hook*",),  # torch's module, tensor and optimizer hooks
    *("sorted", "min", "max", "*.sort", "map", "filter"),  # key= and the builtins
    *("atexit.register", "signal.signal", "weakref.finalize", "*.callback"),  # ExitStack.callback
    *("torch.*", "concurrent.futures.*", "contextlib.*", "functools.*", "*tree_map"),
)

#: Our wrappers of a library's callback registration, counted as the library's: they only hold
#: the callables until the library's object exists. torchft's healing state: its Manager calls
#: the pair when a peer heals from this group or this group heals (FTManager, SyncQuorum).
LIBRARY_CALLBACKS: tuple[str, ...] = ("register_state_dict_fn",)

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass
class Finding:
    """A place in the code: ``path:line  what`` (``detail``: further lines under it)."""

    path: str
    line: int
    what: str
    detail: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Module:
    name: str
    path: str  # relative to the root
    tree: ast.Module
    package: bool  # an __init__.py


@dataclass(frozen=True)
class Edge:
    """One import of ``dst`` by ``src``; ``via``: the module whose package ``dst`` is."""

    src: str
    dst: str
    kind: str  # top, type_checking or local
    path: str
    line: int
    via: str = ""


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _chain(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None for anything but names and attributes."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        base = _chain(node.value)
        return None if base is None else [*base, node.attr]
    return None


def load(root: Path, package: str = PACKAGE) -> dict[str, Module]:
    """Every module of ``package`` under ``root``, parsed, by dotted name."""
    modules = {}
    for file in sorted((root / package.replace(".", "/")).rglob("*.py")):
        parts = list(file.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        if all(part.isidentifier() for part in parts):
            rel = file.relative_to(root).as_posix()
            tree = ast.parse(file.read_text(encoding="utf-8"), rel)
            modules[".".join(parts)] = Module(".".join(parts), rel, tree, is_package)
    return modules


# ---- imports --------------------------------------------------------------------------------


def _imports(node: ast.AST, kind: str = "top") -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node, kind
        return
    if isinstance(node, (*_FUNCTIONS, ast.Lambda)) and kind == "top":
        kind = "local"
    if isinstance(node, ast.If) and (_chain(node.test) or [""])[-1] == "TYPE_CHECKING":
        for stmt in node.body:
            yield from _imports(stmt, "type_checking")
        for stmt in node.orelse:
            yield from _imports(stmt, kind)
        return
    for child in ast.iter_child_nodes(node):
        yield from _imports(child, kind)


def _from_base(module: Module, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    parts = module.name.split(".")[: None if module.package else -1]
    parts = parts[: len(parts) - node.level + 1]
    return ".".join([*parts, node.module] if node.module else parts)


def _imported_names(module: Module) -> dict[str, str]:
    """Each name an import binds in ``module``, to the dotted name it stands for."""
    names = {}
    for node, _ in _imports(module.tree):
        for alias in node.names:
            if isinstance(node, ast.Import):
                key = alias.asname or alias.name.split(".")[0]
                names[key] = alias.name if alias.asname else key
            else:
                names[alias.asname or alias.name] = f"{_from_base(module, node)}.{alias.name}"
    return names


def _is_empty(module: Module) -> bool:
    """An ``__init__`` with nothing but a docstring (and ``__future__`` imports)."""
    return all(
        (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
        or (isinstance(s, ast.ImportFrom) and s.module == "__future__")
        for s in module.tree.body
    )


def import_graph(modules: dict[str, Module]) -> list[Edge]:
    """Every import between ``modules``, the package ``__init__``s each one runs included."""
    edges: dict[tuple[str, str, str, int], Edge] = {}
    for m in modules.values():
        for node, kind in _imports(m.tree):
            if isinstance(node, ast.Import):
                wanted = [alias.name for alias in node.names]
            else:
                base = _from_base(m, node)
                wanted = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
                wanted += [base] if len(wanted) < len(node.names) else []
            for name in wanted:
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if not name:
                    continue
                edges.setdefault(
                    (m.name, name, kind, node.lineno), Edge(m.name, name, kind, m.path, node.lineno)
                )
                parts = name.split(".")
                for i in range(1, len(parts)):
                    parent = ".".join(parts[:i])
                    if (
                        parent in modules
                        and not _is_empty(modules[parent])
                        and not _within(m.name, parent)
                    ):
                        key = (m.name, parent, kind, node.lineno)
                        edges.setdefault(key, Edge(m.name, parent, kind, m.path, node.lineno, name))
    return list(edges.values())


def _components(nodes: Sequence[str], succ: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, each sorted, dependencies before dependents."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(succ.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            out.append(sorted(component))

    for v in nodes:
        if v not in index:
            visit(v)
    return out


def _short(names: Sequence[str]) -> tuple[str, list[str]]:
    """The dotted prefix ``names`` share, and each name without it."""
    parts = [n.split(".") for n in names]
    common = 0
    while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    return ".".join(parts[0][:common]), [".".join(p[common:]) for p in parts]


def import_cycles(modules: dict[str, Module], edges: list[Edge]) -> list[Finding]:
    """Each group of modules that import each other, with the imports between them."""
    succ: dict[str, set[str]] = {}
    for e in edges:
        succ.setdefault(e.src, set()).add(e.dst)
    findings = []
    for component in _components(sorted(modules), succ):
        if len(component) == 1 and component[0] not in succ.get(component[0], ()):
            continue
        prefix, names = _short(component)
        short = dict(zip(component, names, strict=True))
        inner = sorted(
            (e for e in edges if e.src in short and e.dst in short), key=lambda e: (e.path, e.line)
        )
        first = inner[0]
        what = f"cycle in {prefix}: {', '.join(names)}" if prefix else f"cycle: {', '.join(names)}"
        detail = []
        for e in inner:
            via = f", via {e.via.removeprefix(prefix + '.')}" if e.via else ""
            detail.append(f"{e.path}:{e.line}  {short[e.src]} -> {short[e.dst]} ({e.kind}{via})")
        findings.append(Finding(first.path, first.line, what, detail))
    return findings


def longest_chain(
    modules: dict[str, Module], edges: list[Edge], scope: str
) -> tuple[int, list[Finding]]:
    """The longest import path among the modules under ``scope`` (cycles collapsed): its
    number of nodes, and one finding per import on it."""
    inside = sorted(n for n in modules if _within(n, scope))
    succ: dict[str, set[str]] = {}
    for e in edges:
        if e.src in inside and e.dst in inside and e.src != e.dst:
            succ.setdefault(e.src, set()).add(e.dst)
    components = _components(inside, succ)
    of = {name: i for i, component in enumerate(components) for name in component}
    best: list[tuple[int, int | None]] = []  # nodes on the longest path from here, next node
    for i, component in enumerate(components):  # dependencies come first
        after = sorted({of[w] for v in component for w in succ.get(v, ()) if of[w] != i})
        nxt = max(after, key=lambda j: best[j][0], default=None)
        best.append((1 + (best[nxt][0] if nxt is not None else 0), nxt))
    if not components:
        return 0, []
    at = max(range(len(components)), key=lambda i: best[i][0])
    short = {n: n[len(scope) + 1 :] or n for n in inside}

    def label(i: int) -> str:
        c = [short[n] for n in components[i]]
        return c[0] if len(c) == 1 else "{" + ", ".join(c) + "}"

    length, nxt, findings = best[at][0], best[at][1], []
    while nxt is not None:
        e = min(
            (e for e in edges if of.get(e.src) == at and of.get(e.dst) == nxt),
            key=lambda e: (e.path, e.line),
        )
        findings.append(Finding(e.path, e.line, f"{label(at)} -> {label(nxt)}"))
        at, nxt = nxt, best[nxt][1]
    if not findings:  # one module, importing none of the others
        findings.append(Finding(modules[components[at][0]].path, 1, label(at)))
    return length, findings


def _layer(name: str, layers: Layers) -> int | None:
    """The index of the layer whose longest prefix ``name`` has, or None."""
    found, length = None, -1
    for i, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if _within(name, prefix) and len(prefix) > length:
                found, length = i, len(prefix)
    return found


def layer_violations(
    modules: dict[str, Module], edges: list[Edge], layers: Layers, core: Layers, scope: str
) -> list[Finding]:
    """Imports up the layers of ``layers`` and ``core``, and the unplaced modules of ``scope``."""
    findings = [
        Finding(m.path, 1, f"unplaced: {m.name} is in no layer")
        for name, m in sorted(modules.items())
        if _within(name, scope) and name != scope and _layer(name, layers) is None
    ]
    for table in (layers, core):
        for e in sorted(edges, key=lambda e: (e.path, e.line)):
            i, j = _layer(e.src, table), _layer(e.dst, table)
            if not e.via and i is not None and j is not None and j > i:
                what = f"{e.src} ({table[i][0]}) imports {e.dst} ({table[j][0]}), {e.kind}"
                findings.append(Finding(e.path, e.line, what))
    return findings


# ---- classes --------------------------------------------------------------------------------


class _Names:
    """What the names of a module stand for, as dotted names."""

    def __init__(self, module: Module) -> None:
        self.module = module.name
        self.imports = _imported_names(module)
        self.defined = {
            n.name for n in module.tree.body if isinstance(n, (*_FUNCTIONS, ast.ClassDef))
        }

    def resolve(self, chain: list[str]) -> str:
        root = chain[0]
        if root in self.imports:
            return ".".join([self.imports[root], *chain[1:]])
        if root in self.defined:
            return ".".join([self.module, *chain])
        return ".".join(["builtins", *chain] if hasattr(builtins, root) else chain)

    def type_of(self, node: ast.expr | None) -> str | None:
        """The class an annotation, a constructor call or a literal names (``X | None``: X);
        None where unknown (``Any``, a name of no import, a function of ours)."""
        if isinstance(node, ast.BinOp):
            return self.type_of(node.left) or self.type_of(node.right)
        if isinstance(node, ast.Subscript):
            optional = self.resolve(_chain(node.value) or ["?"]) == "typing.Optional"
            return self.type_of(node.slice if optional else node.value)
        if isinstance(node, ast.Dict | ast.DictComp | ast.List | ast.ListComp | ast.Set):
            return "builtins." + type(node).__name__.removesuffix("Comp").lower()
        call = isinstance(node, ast.Call)
        chain = _chain(node.func if isinstance(node, ast.Call) else node) if node else None
        if not chain or not (chain[0] in self.imports or chain[0] in self.defined):
            if not chain or not hasattr(builtins, chain[0]):
                return None
        t = self.resolve(chain)
        if call and not chain[-1][:1].isupper() and _within(t, self.module.partition(".")[0]):
            return None  # a function of ours: what it returns is unknown
        return None if t.startswith(("typing.", "collections.abc.", "builtins.object")) else t


@dataclass
class ClassInfo:
    module: str
    bases: list[str] = field(default_factory=list)  # base classes, bare names
    methods: set[str] = field(default_factory=set)  # properties excluded
    #: Attribute: its class, and the attributes read from that (``self.sync = exchange.sync``).
    attrs: dict[str, tuple[str, list[str]]] = field(default_factory=dict)


class Types:
    """The package's classes: their methods and what the code says of their attributes."""

    def __init__(self, modules: dict[str, Module], package: str = PACKAGE) -> None:
        self.package = package
        self.classes: dict[str, list[ClassInfo]] = {}
        for module in modules.values():
            names = _Names(module)
            for cls in (n for n in ast.walk(module.tree) if isinstance(n, ast.ClassDef)):
                info = ClassInfo(module.name, [c[-1] for c in map(_chain, cls.bases) if c])
                self.classes.setdefault(cls.name, []).append(info)
                for stmt in cls.body:
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                        if t := names.type_of(stmt.annotation):
                            info.attrs.setdefault(stmt.target.id, (t, []))
                    if isinstance(stmt, _FUNCTIONS):
                        if "property" not in _decorators(stmt):
                            info.methods.add(stmt.name)
                        self._read_method(stmt, names, info)

    def _read_method(self, fn: FunctionNode, names: _Names, info: ClassInfo) -> None:
        params = {a.arg: t for a in _params(fn.args) if (t := names.type_of(a.annotation))}
        pairs: list[tuple[ast.expr, ast.expr | None, ast.expr | None]]
        for node in ast.walk(fn):
            if isinstance(node, ast.AnnAssign):
                pairs = [(node.target, node.value, node.annotation)]
            elif isinstance(node, ast.Assign):
                pairs = [
                    (t, v, None) for target in node.targets for t, v in _pairs(target, node.value)
                ]
            else:
                continue
            for target, value, annotation in pairs:
                chain = _chain(target)
                if not chain or len(chain) != 2 or chain[0] != "self":
                    continue
                source = _chain(value) if value is not None else None
                if annotation is None and source and source[0] in params:
                    info.attrs.setdefault(chain[1], (params[source[0]], source[1:]))
                elif t := names.type_of(annotation or value):
                    info.attrs.setdefault(chain[1], (t, []))

    def ours(self, t: str | None) -> bool:
        return t is not None and _within(t, self.package)

    def _mro(self, t: str) -> Iterator[ClassInfo]:
        """The class ``t`` names and its bases (by bare name: the first found), each once."""
        module, _, name = t.rpartition(".")  # the defining module, or a package re-exporting it
        found = self.classes.get(name, [])
        todo = sorted(found, key=lambda c: (c.module != module, not _within(c.module, module)))[:1]
        seen: set[int] = set()
        while todo:
            info = todo.pop()
            if id(info) not in seen:
                seen.add(id(info))
                yield info
                todo += [c[0] for c in map(self.classes.get, info.bases) if c]

    def module_of(self, t: str) -> str | None:
        return next((info.module for info in self._mro(t)), None) if self.ours(t) else None

    def methods(self, t: str) -> set[str]:
        return set().union(*(info.methods for info in self._mro(t))) if self.ours(t) else set()

    def attr(self, t: str | None, name: str, depth: int = 0) -> str | None:
        """The class of attribute ``name`` of an object of class ``t``, where the code says."""
        if t is None or not self.ours(t) or depth > 8:
            return None
        for info in self._mro(t):
            if name in info.attrs:
                found: str | None = info.attrs[name][0]
                for step in info.attrs[name][1]:
                    found = self.attr(found, step, depth + 1)
                return found
        return None


def _params(args: ast.arguments) -> list[ast.arg]:
    extra = [a for a in (args.vararg, args.kwarg) if a is not None]
    return [*args.posonlyargs, *args.args, *args.kwonlyargs, *extra]


def _pairs(target: ast.expr, value: ast.expr | None) -> Iterator[tuple[ast.expr, ast.expr | None]]:
    """Each target of an assignment with its value (None where unpacking hides it)."""
    if isinstance(target, ast.Tuple | ast.List):
        values = value.elts if isinstance(value, ast.Tuple | ast.List) else []
        for i, t in enumerate(target.elts):
            yield from _pairs(t, values[i] if len(values) == len(target.elts) else None)
    else:
        yield target, value


def _decorators(fn: FunctionNode) -> set[str]:
    return {".".join(_chain(d) or []) for d in fn.decorator_list}


# ---- forwarding methods ---------------------------------------------------------------------


def _passes_on(call: ast.Call, args: ast.arguments, skip: int, root: str) -> bool:
    """Whether ``call`` gets exactly the parameters (but the first ``skip`` and ``root``)."""
    positional = [a.arg for a in [*args.posonlyargs, *args.args][skip:] if a.arg != root]
    keyword_only = [a.arg for a in args.kwonlyargs]
    vararg, kwarg = args.vararg and args.vararg.arg, args.kwarg and args.kwarg.arg
    given, starred, double = [], False, False
    for a in call.args:
        if isinstance(a, ast.Starred) and isinstance(a.value, ast.Name) and a.value.id == vararg:
            starred = True
        elif isinstance(a, ast.Name) and not starred:
            given.append(a.id)
        else:
            return False
    if given != positional[: len(given)]:
        return False
    for k in call.keywords:
        if k.arg is None and isinstance(k.value, ast.Name) and k.value.id == kwarg:
            double = True
        elif isinstance(k.value, ast.Name) and k.value.id == k.arg:
            given.append(k.arg)
        else:
            return False
    complete = sorted(given) == sorted(positional + keyword_only)
    return complete and starred == (vararg is not None) and double == (kwarg is not None)


def forwarding_methods(module: Module, types: Types) -> list[Finding]:
    """Methods that only pass their parameters on to a collaborator's method, and properties
    that only read ``self.a.b``. Going through a library object the class keeps (an Event, a
    deque, a dict: ``self._done.wait()``) is the class's implementation, not counted."""
    findings = []
    for cls in (n for n in ast.walk(module.tree) if isinstance(n, ast.ClassDef)):
        for fn in (n for n in cls.body if isinstance(n, _FUNCTIONS)):
            body, decorators = _body(fn), _decorators(fn)
            if fn.name.startswith("__") and fn.name.endswith("__") or len(body) != 1:
                continue
            skip = 0 if "staticmethod" in decorators else 1
            params = [a.arg for a in [*fn.args.posonlyargs, *fn.args.args]]
            me = params[0] if skip and params else ""
            stmt = body[0]
            value = stmt.value if isinstance(stmt, ast.Return | ast.Expr) else None
            call = value if isinstance(value, ast.Call) else None
            chain = _chain(call.func if call else value) if value else None
            if not chain:
                continue
            if chain[0] == me and len(chain) >= 3:
                kept = types.attr(f"{module.name}.{cls.name}", chain[1])
                if kept is not None and not types.ours(kept):
                    continue  # a library object the class keeps
            if "property" in decorators:
                if isinstance(stmt, ast.Return) and not call and chain[0] == me and len(chain) >= 3:
                    what = f"{cls.name}.{fn.name} (property) returns {'.'.join(chain)}"
                    findings.append(Finding(module.path, fn.lineno, what))
                continue
            deep_enough = len(chain) >= 3 if chain[0] == me else chain[0] in params[skip:]
            root = "" if chain[0] == me else chain[0]
            if call and deep_enough and _passes_on(call, fn.args, skip, root):
                what = f"{cls.name}.{fn.name} forwards to {'.'.join(chain)}()"
                findings.append(Finding(module.path, fn.lineno, what))
    return findings


def _body(fn: FunctionNode) -> list[ast.stmt]:
    """The body without its docstring."""
    first = fn.body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    return fn.body[1:] if docstring else fn.body


# ---- upward calls ---------------------------------------------------------------------------


@dataclass
class _Scope:
    """A function being read: its parameters, local names, nested defs and known classes."""

    name: str
    owner: str | None  # the class, for a method
    params: set[str]
    types: dict[str, str]
    local: set[str] = field(default_factory=set)
    nested: set[str] = field(default_factory=set)


class _Upward(ast.NodeVisitor):
    def __init__(self, module: Module, types: Types) -> None:
        self.module, self.types, self.names = module, types, _Names(module)
        self.scopes: list[_Scope] = []
        self.findings: list[Finding] = []

    def _find(self, node: ast.AST, what: str) -> None:
        self.findings.append(Finding(self.module.path, getattr(node, "lineno", 1), what))

    def _type_of(self, chain: list[str]) -> str | None:
        """The class of the object ``chain`` names, where the code says it."""
        root, t = chain[0], None
        owner = next((s.owner for s in reversed(self.scopes) if s.owner), None)
        if root in ("self", "cls") and owner:
            t = f"{self.module.name}.{owner}"
        else:
            t = next((s.types[root] for s in reversed(self.scopes) if root in s.types), None)
        for attr in chain[1:]:
            t = self.types.attr(t, attr)
        return t

    def _internal(self, t: str | None) -> bool:
        """Whether class ``t`` is a library's or this module's own (no other module of ours)."""
        return t is not None and self.types.module_of(t) in (None, self.module.name)

    def _is_local(self, name: str) -> bool:
        """Whether ``name`` is bound by the function (or one around it), not passed in."""
        for scope in reversed(self.scopes):
            if name in scope.params:
                return False
            if name in scope.local:
                return True
        return False

    def _into_ours(self, func: ast.expr) -> bool:
        """Whether a call of ``func`` goes into another module of ours (a guess if unknown)."""
        chain = _chain(func)
        if chain is None:
            return not any(fnmatch.fnmatch(ast.unparse(func), p) for p in EXTERNAL_SINKS)
        if chain[-1] in LIBRARY_CALLBACKS:
            return False
        if chain[0] in ("self", "cls") and len(chain) == 2:
            return False  # the object's own method
        t = self._type_of(chain[:-1]) if len(chain) > 1 else None
        if t is not None and (not self.types.ours(t) or chain[-1] in self.types.methods(t)):
            return not self._internal(t)
        if not self._is_local(chain[0]) and chain[0] not in ("self", "cls"):
            dotted = self.names.resolve(chain)
            if chain[0] in self.names.imports or dotted.startswith("builtins."):
                return self.types.ours(dotted)
            if chain[0] in self.names.defined:
                return False  # this module's own
        return not any(fnmatch.fnmatch(".".join(chain), p) for p in EXTERNAL_SINKS)

    def _callable(self, node: ast.expr | None) -> str | None:
        """How ``node`` reads when it is a callable that carries the caller's state, else None."""
        if isinstance(node, ast.Lambda):
            return "a lambda"
        if isinstance(node, ast.Call):
            chain = _chain(node.func)
            partial = chain and self.names.resolve(chain) == "functools.partial" and node.args
            return f"functools.partial({ast.unparse(node.args[0])}, ...)" if partial else None
        if isinstance(node, ast.Name) and any(node.id in s.nested for s in self.scopes):
            return f"the closure {node.id}"
        chain = _chain(node) if isinstance(node, ast.Attribute) else None
        t = self._type_of(chain[:-1]) if chain else None
        return ".".join(chain) if chain and t and chain[-1] in self.types.methods(t) else None

    def _write(self, node: ast.AST, base: ast.expr, value: ast.expr | None, text: str) -> None:
        if isinstance(base, ast.Name) and base.id in ("self", "cls"):
            return
        chain = _chain(base)
        if chain and self._internal(self._type_of(chain)):
            return  # a library's object, or one of this module's classes
        root = base
        while isinstance(root, ast.Attribute | ast.Subscript):
            root = root.value
        stored = self._callable(value)
        if isinstance(root, ast.Name) and self._is_local(root.id) and stored is None:
            return  # the function's own object
        self._find(node, f"stores {stored} in {text}" if stored else f"writes {text}")

    def _assign(self, node: ast.AST, target: ast.expr, value: ast.expr | None) -> None:
        for t, v in _pairs(target, value):
            if isinstance(t, ast.Attribute) and t.attr not in ALLOWED_WRITES:
                self._write(node, t.value, v, ast.unparse(t))

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._assign(node, target, node.value)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._assign(node, node.target, node.value)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self._assign(node, node.target, node.value)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        chain = _chain(node.func) or []
        if chain in (["setattr"], ["object", "__setattr__"]) and len(node.args) == 3:
            base, value = node.args[0], node.args[2]
            setup = self.scopes and self.scopes[-1].name in FROZEN_SETUP
            if chain == ["object", "__setattr__"] and not setup and _chain(base) == ["self"]:
                self._find(node, "object.__setattr__(self, ...) outside the set-up")
            self._write(node, base, value, f"{'.'.join(chain)}({ast.unparse(base)}, ...)")
        elif self.scopes and self._into_ours(node.func):  # a module-level lambda holds no state
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                if (what := self._callable(arg)) is not None:
                    self._find(node, f"passes {what} to {ast.unparse(node.func)}()")
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for stmt in node.body:
            if isinstance(stmt, _FUNCTIONS):
                self._function(stmt, node.name)
            else:
                self.visit(stmt)

    def visit_FunctionDef(self, node: FunctionNode) -> None:
        self._function(node, None)

    visit_AsyncFunctionDef = visit_FunctionDef

    def _function(self, fn: FunctionNode, owner: str | None) -> None:
        if owner and fn.name == "__getattr__":
            self._find(fn, f"{owner}.__getattr__ forwards every unknown attribute")
        params = _params(fn.args)
        types = {p.arg: t for p in params if (t := self.names.type_of(p.annotation))}
        scope = _Scope(fn.name, owner, {p.arg for p in params}, types)
        todo: list[ast.AST] = list(fn.body)
        while todo:  # this function's own statements, not those of a nested def or class
            node = todo.pop()
            if isinstance(node, (*_FUNCTIONS, ast.ClassDef)):
                scope.local.add(node.name)
                if isinstance(node, _FUNCTIONS):
                    scope.nested.add(node.name)
                continue
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                scope.local.add(node.id)
            elif isinstance(node, ast.Global | ast.Nonlocal):
                scope.params.update(node.names)  # not this function's own
            elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                if t := self.names.type_of(node.value):
                    scope.types[node.targets[0].id] = t
            elif isinstance(node, ast.withitem) and isinstance(node.optional_vars, ast.Name):
                if t := self.names.type_of(node.context_expr):
                    scope.types[node.optional_vars.id] = t
            if not isinstance(node, ast.Lambda):
                todo.extend(ast.iter_child_nodes(node))
        scope.local -= scope.params
        self.scopes.append(scope)
        for stmt in fn.body:
            self.visit(stmt)
        self.scopes.pop()


def upward_calls(module: Module, types: Types) -> list[Finding]:
    """Writes into other modules' objects, callables passed into them, ``__getattr__``s."""
    visitor = _Upward(module, types)
    visitor.visit(module.tree)
    return sorted(visitor.findings, key=lambda f: f.line)


# ---- the report -----------------------------------------------------------------------------


def measure(
    root: Path,
    layers: Layers = LAYERS,
    core_layers: Layers = CORE_LAYERS,
    package: str = PACKAGE,
    experiment: str = EXPERIMENT,
) -> dict[str, tuple[int, list[Finding]]]:
    """Every measure of the code under ``root``: its count and its findings."""
    modules = load(root, package)
    edges = import_graph(modules)
    types = Types(modules, package)
    scoped = [m for name, m in sorted(modules.items()) if _within(name, experiment)]
    upward = [f for m in scoped for f in upward_calls(m, types)]
    forwarding = [f for m in scoped for f in forwarding_methods(m, types)]
    cycles = import_cycles(modules, edges)
    length, chain = longest_chain(modules, edges, experiment)
    layered = layer_violations(modules, edges, layers, core_layers, experiment)
    return {
        "upward_calls": (len(upward), upward),
        "import_cycles": (len(cycles), cycles),
        "longest_chain": (length, chain),
        "forwarding_methods": (len(forwarding), forwarding),
        "layer_violations": (len(layered), layered),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the counts and findings here")
    args = parser.parse_args(argv)
    results = measure(REPO)
    over = []
    for name, (count, findings) in results.items():
        print(f"{name}: {count} (limit {LIMITS[name]}, target {TARGETS[name]})")
        for f in findings:
            print(f"    {f.path}:{f.line}  {f.what}")
            for line in f.detail:
                print(f"        {line}")
        if count > LIMITS[name]:
            over.append(f"{name} ({count} > {LIMITS[name]})")
    if args.json:
        payload = {
            name: {
                "count": c,
                "limit": LIMITS[name],
                "target": TARGETS[name],
                "findings": [asdict(f) for f in fs],
            }
            for name, (c, fs) in results.items()
        }
        args.json.write_text(json.dumps({"measures": payload, "over": over}, indent=2) + "\n")
    print(
        f"arch_check: {len(over)} measures over their limits: {', '.join(over)}"
        if over
        else "arch_check: ok"
    )
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
