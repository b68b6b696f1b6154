"""fxbudget's module import graph has no cycle (issue 29), function-level (lazy) imports included; the packages are
layered (issue 40: each imports only the packages below it, as each `__init__` docstring says); and the kernel
imports no rule: only the rule interface (`rules.base`)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fxbudget"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the fxbudget modules it imports anywhere in its body (`from .x import y` names `x.y` when that is a
    module, else `x`). Imports under `if TYPE_CHECKING:` are never run and do not count."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                for n in ast.walk(node)}
        targets = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[name] = {t for t in targets if t in mods and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], iter(range(10**9))

    def visit(v):
        index[v] = low[v] = next(counter)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50 and "fxbudget.kernel.measure" in graph["fxbudget.kernel.pipeline"]
    assert cycles(graph) == []


def test_a_planted_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_kernel_imports_no_rule():
    graph = import_graph()
    kernel = sorted(m for m in graph if m == "fxbudget.kernel" or m.startswith("fxbudget.kernel."))
    assert len(kernel) >= 10 and "fxbudget.kernel.pipeline" in kernel
    for mod in kernel + ["fxbudget.passes.sdpa", "fxbudget.passes.eager"]:
        rules = {m for m in graph[mod] if m.startswith("fxbudget.rules")}
        assert rules <= {"fxbudget.rules", "fxbudget.rules.base"}, (mod, rules)


# Which fxbudget packages (or root modules) each may import, besides itself: imports flow one way,
# rules <- kernel <- passes <- cache <- compiler <- fairness <- api <- harness <- lmeval / cli <- demo.
# "fxbudget" is the package's own `__init__` (its version); a module not listed here fails the test until it is.
_BELOW_API = {"fairness", "compiler", "cache", "passes", "kernel", "rules", "models", "checks"}
MAY_IMPORT = {
    "checks": set(),
    "rules": {"checks"},
    "models": {"checks"},
    "kernel": {"rules", "checks"},  # rules.base only: test_the_kernel_imports_no_rule
    "passes": {"kernel", "rules", "checks"},
    "cache": {"passes", "kernel", "rules", "models", "checks"},
    "compiler": {"cache", "passes", "kernel", "rules", "models", "checks"},
    "fairness": {"compiler", "cache", "passes", "kernel", "rules", "models", "checks", "fxbudget"},
    "api": _BELOW_API,
    "harness": {"api", *_BELOW_API},
    "lmeval": {"harness", "api", *_BELOW_API},
    "cli": {"harness", "api", *_BELOW_API, "fxbudget"},
    "demo": {"cli"},
}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "fxbudget"


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for mod, targets in sorted(graph.items()):
        if mod == "fxbudget":
            continue
        pkg = _package(mod)
        if pkg not in MAY_IMPORT:
            out.append(f"{mod}: its package {pkg!r} has no entry in MAY_IMPORT")
            continue
        out += [f"{mod} imports {t}" for t in sorted(targets)
                if _package(t) != pkg and _package(t) not in MAY_IMPORT[pkg]]
    return out


def test_packages_import_only_below_them():
    assert layering_violations(import_graph()) == []


def test_a_planted_upward_import_is_found():
    graph = {"fxbudget.kernel.pipeline": {"fxbudget.compiler.forward"}, "fxbudget.compiler.forward": set()}
    assert layering_violations(graph) == ["fxbudget.kernel.pipeline imports fxbudget.compiler.forward"]


def test_at_most_eight_root_modules():
    """The root shows the architecture in rooms (issue 40): few modules beside the subpackages."""
    root = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(root) <= 8, root
