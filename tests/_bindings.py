"""Checks every Python binding of ``titan_ext._delegate_C`` against its call sites in titan_ext/.

Three independent views of one binding are compared:

* the C++ source: the ``PYBIND11_MODULE`` block of cpp_ext/delegate_ext.cpp (``#ifdef WITH_CUDA`` parts
  included, so the CUDA-only bindings are checked on a machine without CUDA) and the parameter types
  of the C++ functions it binds (a method's first parameter is its ``self``);
* the compiled module, when given: pybind11's own signature line of every bound callable;
* the call sites: an AST scan of titan_ext/ for calls on a Region (``region``, ``x.region``, a local
  assigned from one) or on the module (``load_ext()``, a local assigned from it), with a small type
  inference of the arguments (literals, module constants, annotated parameters and attributes,
  ``-> int`` / ``-> torch.Tensor`` methods, tensor-returning torch calls).

A call whose receiver, arity, keyword names or an inferable argument type do not fit its binding is a
finding — the class of bug where ``region.d2h_signal(src, ...)`` handed the Region as the tensor.
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPP = os.path.join(ROOT, "cpp_ext", "delegate_ext.cpp")
PKG = os.path.join(ROOT, "titan_ext")

INT, FLOAT, BOOL, STR, TENSOR, REGION, NONE = "int", "float", "bool", "str", "Tensor", "Region", "None"
ACCEPTS = {INT: {INT, BOOL}, FLOAT: {INT, FLOAT, BOOL}, BOOL: {BOOL}, STR: {STR}, TENSOR: {TENSOR},
           REGION: {REGION}}


@dataclass
class Binding:
    name: str
    scope: str                     # "Region" (method), "Region.static", "module"
    params: list[tuple[str, str]]  # (python name or argN, kind), self excluded
    self_kind: str | None          # methods: the kind of the C++ function's first parameter
    defaults: set[str] = field(default_factory=set)
    cuda: bool = False


def cpp_kind(decl: str) -> str:
    t = re.sub(r"\b(const|volatile)\b|[&*]", " ", decl).strip()
    t = " ".join(t.split()[:-1]) if len(t.split()) > 1 else t   # drop the parameter name
    t = t.replace(" ", "")
    if "Region" in t:
        return REGION
    if t in ("torch::Tensor", "at::Tensor", "Tensor"):
        return TENSOR
    if re.fullmatch(r"u?int(8|16|32|64)?_t|int|long|size_t|unsigned|uintptr_t", t):
        return INT
    if t in ("double", "float"):
        return FLOAT
    if t == "bool":
        return BOOL
    if t in ("std::string",):
        return STR
    raise ValueError(f"unknown C++ parameter type {decl!r}")


def _split_top(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "(<{[":
            depth += 1
        elif ch in ")>}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def cpp_functions(src: str) -> dict[str, list[str]]:
    """Free functions defined in the source: name -> parameter declarations."""
    funcs = {}
    for m in re.finditer(r"^[\w:<>,\s\*&]+?\b(\w+)\(([^)]*)\)\s*(const\s*)?\{", src, re.M):
        funcs[m.group(1)] = _split_top(m.group(2))
    return funcs


def parse_cpp(path: str = CPP) -> dict[tuple[str, str], Binding]:
    src = open(path).read()
    funcs = cpp_functions(src)
    block = src[src.index("PYBIND11_MODULE"):]
    out: dict[tuple[str, str], Binding] = {}
    # the chained .def(...) calls may span lines: parse the calls on the joined text, tracking scope
    text = block
    cuda_spans = [(m.start(), m.end()) for m in re.finditer(r"#ifdef WITH_CUDA.*?#endif", text, re.S)]
    region_span = re.search(r"py::class_<Region.*?;\s*\n", text, re.S).span()
    for m in re.finditer(r"(\bm)?\.(def|def_static)\(\s*\"(\w+)\"\s*,\s*&(\w+)((?:[^;]|\n)*?)\)\s*(?=[\n;.#])",
                         text):
        kind, name, fn, rest = m.group(2), m.group(3), m.group(4), m.group(5)
        in_region = region_span[0] <= m.start() < region_span[1] and not m.group(1)
        scope = ("Region.static" if kind == "def_static" else "Region") if in_region else "module"
        decls = funcs[fn]
        kinds = [cpp_kind(d) for d in decls]
        self_kind = None
        if scope == "Region":
            self_kind, kinds = kinds[0], kinds[1:]
        args = re.findall(r"py::arg\(\"(\w+)\"\)(\s*=)?", rest)
        names = [a for a, _ in args] if args else [f"arg{i}" for i in range(len(kinds))]
        if len(names) != len(kinds):
            raise ValueError(f"{name}: {len(names)} py::arg for {len(kinds)} parameters")
        defaults = {a for a, eq in args if eq}
        out[(scope, name)] = Binding(
            name, scope, list(zip(names, kinds)), self_kind, defaults,
            any(a <= m.start() < b for a, b in cuda_spans))
    return out


# --------------------------------------------------------------------------------------------------
# compiled module: pybind11's signature lines
# --------------------------------------------------------------------------------------------------
def _py_kind(t: str) -> str:
    t = t.strip()
    if t.endswith("Region"):
        return REGION
    if t in ("torch.Tensor", "Tensor"):
        return TENSOR
    # pybind11 3 writes "typing.SupportsInt | typing.SupportsIndex" for int, SupportsFloat for double
    parts = {p.strip().removeprefix("typing.") for p in t.split("|")} - {"SupportsIndex"}
    if len(parts) != 1:
        return t
    t = parts.pop()
    return {"int": INT, "SupportsInt": INT, "float": FLOAT, "SupportsFloat": FLOAT, "bool": BOOL,
            "str": STR}.get(t, t)


def compiled_signatures(mod) -> dict[tuple[str, str], tuple[list[tuple[str, str]], str | None]]:
    """(scope, name) -> ([(name, kind)] without self, self kind) from each callable's __doc__."""
    out = {}
    items = [("module", n, getattr(mod, n)) for n in dir(mod) if not n.startswith("_") and n != "Region"]
    for n, v in vars(mod.Region).items():
        if n.startswith("_") or isinstance(v, property):
            continue
        items.append(("Region.static" if isinstance(v, staticmethod) else "Region", n, getattr(mod.Region, n)))
    for scope, name, obj in items:
        if not callable(obj):
            continue
        first = (obj.__doc__ or "").strip().splitlines()[0]
        m = re.match(rf"{name}\((.*)\) ->", first)
        if m is None:
            raise ValueError(f"no pybind11 signature for {scope}.{name}: {first!r}")
        params = []
        for p in _split_top(m.group(1)):
            pname, _, ptype = p.partition(":")
            params.append((pname.strip(), _py_kind(ptype.split("=")[0])))
        self_kind = None
        if scope == "Region":
            self_kind, params = params[0][1], params[1:]
        out[(scope, name)] = (params, self_kind)
    return out


# --------------------------------------------------------------------------------------------------
# call sites
# --------------------------------------------------------------------------------------------------
def _annotation_kind(node) -> str | None:
    if node is None:
        return None
    text = ast.unparse(node).replace(" ", "")
    parts = set(text.split("|")) - {"None"}
    if len(parts) != 1:
        return None
    t = parts.pop()
    if t in ("torch.Tensor", "Tensor"):
        return TENSOR
    return {"int": INT, "float": FLOAT, "bool": BOOL, "str": STR}.get(t) or (
        "list:" + _annotation_kind(ast.parse(t[5:-1], mode="eval").body) if t.startswith("list[") and
        _annotation_kind(ast.parse(t[5:-1], mode="eval").body) else None)


class Facts:
    """Package-wide type facts: module constants, annotated attributes, method return types."""

    def __init__(self, trees: dict[str, ast.Module]):
        self.consts: dict[str, dict[str, str]] = {}
        self.attrs: dict[str, set[str]] = {}
        self.returns: dict[str, set[str]] = {}
        for path, tree in trees.items():
            mod = os.path.splitext(os.path.basename(path))[0]
            table = self.consts.setdefault(mod, {})  # modules of one basename: a conflict is unknown
            for node in tree.body:
                for name, kind in _module_constants(node, table):
                    table[name] = kind if table.get(name, kind) == kind else None
            for node in ast.walk(tree):
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Attribute):
                    k = _annotation_kind(node.annotation)
                    self.attrs.setdefault(node.target.attr, set()).add(k)
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    is_property = any(ast.unparse(d) == "property" for d in node.decorator_list)
                    table = self.attrs if is_property else self.returns
                    table.setdefault(node.name, set()).add(_annotation_kind(node.returns))


def _module_constants(node, table: dict):
    """(name, kind) of ``NAME = <expr>`` and ``A, B = <expr>, <expr>`` at module level, where the
    expressions are literals or arithmetic on the module's earlier constants."""
    if not isinstance(node, ast.Assign):
        return
    for t in node.targets:
        if isinstance(t, ast.Name):
            yield t.id, _literal_kind(node.value, table)
        elif isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
            for n, v in zip(t.elts, node.value.elts):
                if isinstance(n, ast.Name):
                    yield n.id, _literal_kind(v, table)


def _literal_kind(e, table: dict) -> str | None:
    if isinstance(e, ast.Constant):
        return _const_kind(e.value)
    if isinstance(e, ast.Name):
        return table.get(e.id)
    if isinstance(e, ast.BinOp):
        a, b = _literal_kind(e.left, table), _literal_kind(e.right, table)
        if a == b == INT:
            return FLOAT if isinstance(e.op, ast.Div) else INT
    return None


def _const_kind(v) -> str | None:
    if isinstance(v, bool):
        return BOOL
    return {int: INT, float: FLOAT, str: STR, type(None): NONE}.get(type(v))


_TENSOR_FACTORIES = {"empty", "zeros", "ones", "tensor", "empty_like", "zeros_like", "full", "arange", "frombuffer"}
_TENSOR_METHODS = {"contiguous", "clone", "to", "view", "reshape", "detach", "cuda", "cpu"}


class Scope:
    """Type inference inside one function (annotated parameters, single-kind local assignments)."""

    def __init__(self, facts: Facts, func, aliases: dict[str, str]):
        self.facts, self.aliases = facts, aliases
        self.names: dict[str, str | None] = {}
        if func is not None:
            for a in func.args.args + func.args.kwonlyargs:
                self.names[a.arg] = _annotation_kind(a.annotation)
            assigned: dict[str, set] = {}
            for node in ast.walk(func):
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    assigned.setdefault(node.targets[0].id, []).append(node.value)
            for _ in range(3):  # a few rounds: locals defined from other locals
                for name, values in assigned.items():
                    kinds = {self.kind(v) for v in values}
                    self.names[name] = kinds.pop() if len(kinds) == 1 else None

    def kind(self, e) -> str | None:  # noqa: C901 - one case per expression form
        f = self.facts
        if isinstance(e, ast.Constant):
            return _const_kind(e.value)
        if isinstance(e, ast.UnaryOp):
            return self.kind(e.operand)
        if isinstance(e, ast.BinOp):
            a, b = self.kind(e.left), self.kind(e.right)
            if a in (INT, BOOL) and b in (INT, BOOL):
                return FLOAT if isinstance(e.op, ast.Div) else INT
            if {a, b} <= {INT, FLOAT, BOOL}:
                return FLOAT
            return TENSOR if TENSOR in (a, b) else None
        if isinstance(e, ast.IfExp):
            a, b = self.kind(e.body), self.kind(e.orelse)
            return a if a == b else None
        if isinstance(e, ast.Name):
            if e.id in ("region",):
                return REGION
            if e.id in self.names:
                return self.names[e.id]
            return f.consts.get(self.aliases.get("", ""), {}).get(e.id)
        if isinstance(e, ast.Attribute):
            if e.attr == "region":
                return REGION
            if isinstance(e.value, ast.Name) and e.value.id in self.aliases:
                return f.consts.get(self.aliases[e.value.id], {}).get(e.attr)
            kinds = f.attrs.get(e.attr, set())
            return next(iter(kinds)) if len(kinds) == 1 else None
        if isinstance(e, ast.Subscript):
            base = self.kind(e.value)
            if base == TENSOR:
                return TENSOR
            return base[5:] if base and base.startswith("list:") else None
        if isinstance(e, ast.Call):
            fn = e.func
            if isinstance(fn, ast.Name) and fn.id in ("int", "len", "round"):
                return INT
            if isinstance(fn, ast.Name) and fn.id == "float":
                return FLOAT
            if isinstance(fn, ast.Attribute):
                if isinstance(fn.value, ast.Name) and fn.value.id == "torch" and fn.attr in _TENSOR_FACTORIES:
                    return TENSOR
                if fn.attr in _TENSOR_METHODS and self.kind(fn.value) == TENSOR:
                    return TENSOR
                kinds = f.returns.get(fn.attr, set())
                return next(iter(kinds)) if len(kinds) == 1 else None
        return None


@dataclass
class Call:
    where: str
    scope: str        # the receiver: "Region" / "module" / "Region.static"
    name: str
    args: list        # kinds (None: unknown) of the positional arguments
    keywords: dict    # name -> kind
    text: str


def _module_receiver(e, scope: Scope) -> str | None:
    if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id == "load_ext":
        return "module"
    if isinstance(e, ast.Name) and scope.names.get(e.id) == "module":
        return "module"
    if isinstance(e, ast.Attribute) and e.attr == "Region" and _module_receiver(e.value, scope):
        return "Region.static"
    return None


def call_sites(bindings: dict, pkg: str = PKG) -> list[Call]:
    trees = {}
    for dirpath, _, files in os.walk(pkg):
        for fn in files:
            if fn.endswith(".py"):
                p = os.path.join(dirpath, fn)
                trees[p] = ast.parse(open(p).read(), p)
    facts = Facts(trees)
    calls, seen = [], set()
    for path, tree in trees.items():
        aliases = {"": os.path.splitext(os.path.basename(path))[0]}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    aliases[a.asname or a.name] = a.name
        funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for func in funcs + [None]:
            scope = Scope(facts, func, aliases)
            body = func if func is not None else tree
            for node in ast.walk(body):  # locals assigned from load_ext()
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                        isinstance(node.targets[0], ast.Name) and _module_receiver(node.value, scope) == "module":
                    scope.names[node.targets[0].id] = "module"
            for node in ast.walk(body):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                recv = _module_receiver(node.func.value, scope) or scope.kind(node.func.value)
                where = f"{os.path.relpath(path, ROOT)}:{node.lineno}:{node.col_offset}"
                if recv not in ("module", "Region.static", REGION) or where in seen:
                    continue
                seen.add(where)
                calls.append(Call(where, recv, node.func.attr, [scope.kind(a) for a in node.args],
                                  {k.arg: scope.kind(k.value) for k in node.keywords}, ast.unparse(node)))
    return calls


def check_calls(bindings: dict, calls: list[Call]) -> tuple[list[str], int, int]:
    """Findings, and how many argument types were checked / left unknown."""
    problems, checked, unknown = [], 0, 0
    for c in calls:
        key = (c.scope, c.name)
        b = bindings.get(key)
        if b is None:
            problems.append(f"{c.where}: {c.text} — no binding {c.scope}.{c.name} in {os.path.basename(CPP)}")
            continue
        if b.scope == "Region" and b.self_kind != REGION:
            problems.append(f"{c.where}: {c.text} — {c.name} is a Region method but its C++ function takes "
                            f"{b.self_kind} first (the receiver is passed as that parameter)")
        names = [n for n, _ in b.params]
        if len(c.args) > len(names):
            problems.append(f"{c.where}: {c.text} — {len(c.args)} positional arguments, {c.name} takes {len(names)}")
            continue
        given = dict(zip(names, c.args))
        for k, v in c.keywords.items():
            if k not in names:
                problems.append(f"{c.where}: {c.text} — {c.name} has no parameter {k!r} (has {names})")
            elif k in given:
                problems.append(f"{c.where}: {c.text} — {k!r} given twice")
            given[k] = v
        missing = [n for n in names if n not in given and n not in b.defaults]
        if missing:
            problems.append(f"{c.where}: {c.text} — missing {missing}")
        for (n, want) in b.params:
            if n not in given:
                continue
            got = given[n]
            if got is None or got.startswith("list:"):
                unknown += 1
                continue
            checked += 1
            if got not in ACCEPTS[want]:
                problems.append(f"{c.where}: {c.text} — argument {n!r} is {got}, {c.name} expects {want}")
    return problems, checked, unknown
