"""`fxbudget rules`: the table of registered rules, from the registry or, without torch, from the rules' sources.

The built-in rules import torch, which takes seconds to load: without `--rule-file`, the table is read from
`fxbudget/rules/*.py` with `ast` (module docstring, `@register` name, dataclass fields with literal defaults), the
same table `rules_table()` builds from the imported registry (a test holds the two equal). A source this reader does
not understand (a default that is not a literal, a base class it cannot find) makes it return None: the caller then
imports the registry.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
from pathlib import Path

_RULES_DIR = Path(__file__).resolve().parent.parent / "rules"
_HEADER = ["| rule | what it keeps | hyperparameters (defaults) |", "|---|---|---|"]
# The wrappers, printed under the table (they are not registered names: they wrap one).
WRAPPERS = ("Wrappers of any rule above:\n"
            "- `adakv:<rule>` (`alpha=0.2`; every other parameter goes to `<rule>`): AdaKV's head-adaptive budgets, "
            "each head keeps its top `alpha x budget`, the rest of the layer's `kv_heads x budget` by one top-k over "
            "its heads (head-pooled cache: the uniform budget's memory), e.g. `adakv:snapkv`\n"
            "- `noprotect:<rule>` (a rule that protects tokens): its score with nothing force-kept (its sinks/window "
            "compete like any token)\n"
            "- `protectonly:<rule>` (`random_seed=0`): the rule's protected tokens kept, the rest at random (the "
            "`random` rule's draw); with `noprotect:` it splits a rule's gain into score and protection "
            "(`fxbudget compare --decompose`)\n"
            "- `fxbudget.rules.Pyramid(rule, beta=20)` (Python): PyramidKV's per-layer budget schedule\n"
            "- `fxbudget.rules.Chunk(rule, chunk_length=1024)` (Python): kvpress's ChunkPress, every chunk of "
            "`chunk_length` positions keeps the same share of the budget")


def _line(name: str, doc: str, fields: list[tuple[str, object]]) -> str:
    summary = doc.split("\n")[0].split(":", 1)[-1].strip() if doc else ""
    shown = ", ".join(f"{n}={d!r}" for n, d in fields if not n.startswith("_"))
    return f"| `{name}` | {summary} | {shown or '-'} |"


def rules_table() -> str:
    """Markdown table of the registered rules (imported): name, description, hyperparameters with defaults."""
    from ..rules import _REGISTRY, available

    lines = list(_HEADER)
    for name in available():
        cls = _REGISTRY[name]
        doc = inspect.getdoc(sys.modules[cls.__module__]) or inspect.getdoc(cls) or ""
        fields = [(f.name, f.default) for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING]
        lines.append(_line(name, doc, fields))
    return "\n".join(lines)


class _Unreadable(Exception):
    """A rule source the static reader does not understand."""


def _decorator_name(node: ast.expr) -> str:
    target = node.func if isinstance(node, ast.Call) else node
    return target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")


def _own_fields(node: ast.ClassDef) -> list[tuple[str, object]]:
    """A dataclass body's fields as (name, default or MISSING), ClassVars left out."""
    out = []
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        if "ClassVar" in ast.unparse(stmt.annotation):
            continue
        value = stmt.value
        if value is None:
            default = dataclasses.MISSING
        elif isinstance(value, ast.Call) and _decorator_name(value) == "field":
            kw = {k.arg: k.value for k in value.keywords}
            default = ast.literal_eval(kw["default"]) if "default" in kw else dataclasses.MISSING
        else:
            try:
                default = ast.literal_eval(value)
            except ValueError:
                raise _Unreadable(ast.unparse(value)) from None
        out.append((stmt.target.id, default))
    return out


def static_rules_table() -> str | None:
    """The table `rules_table()` gives for the built-in rules, read from their sources without importing them.

    Returns:
        The table, or None when a source cannot be read this way.
    """
    try:
        init = ast.parse((_RULES_DIR / "__init__.py").read_text())
        modules = [a.name for stmt in init.body if isinstance(stmt, ast.ImportFrom) and stmt.level == 1
                   and stmt.module is None for a in stmt.names]
        classes: dict[str, tuple[ast.ClassDef, str]] = {}
        registered: dict[str, tuple[ast.ClassDef, str]] = {}
        for module in ["base", *modules]:
            tree = ast.parse((_RULES_DIR / f"{module}.py").read_text())
            doc = ast.get_docstring(tree) or ""
            for node in tree.body:
                if isinstance(node, ast.ClassDef):
                    if node.name in classes:
                        return None  # two classes of one name: bases would be ambiguous
                    classes[node.name] = (node, doc)
                    for d in node.decorator_list:
                        if _decorator_name(d) == "register" and isinstance(d, ast.Call):
                            registered[ast.literal_eval(d.args[0])] = (node, doc)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                        _decorator_name(d) == "register" for d in node.decorator_list):
                    return None  # a registered scoring function: let the registry describe it

        def fields(node: ast.ClassDef) -> dict[str, object]:
            merged: dict[str, object] = {}
            for base in node.bases:  # dataclass order: the bases' fields first, an override keeps its place
                name = getattr(base, "id", None)
                if name not in classes:
                    raise _Unreadable(ast.unparse(base))
                merged.update(fields(classes[name][0]))
            if any(_decorator_name(d) == "dataclass" for d in node.decorator_list):
                merged.update(_own_fields(node))
            return merged

        lines = list(_HEADER)
        for name in sorted(registered):
            node, doc = registered[name]
            if not doc:
                return None  # the registry would fall back to the class docstring
            shown = [(n, d) for n, d in fields(node).items() if d is not dataclasses.MISSING]
            lines.append(_line(name, doc, shown))
        return "\n".join(lines)
    except (_Unreadable, OSError, SyntaxError, ValueError, KeyError, IndexError):
        return None
