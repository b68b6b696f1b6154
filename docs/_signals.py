"""The `Signals` table of the Rules page, generated from the code: the fields of `fxbudget.rules.base.Signals` (the
dataclass's annotations, described by its docstring's `Attributes:`), then its public properties and methods (their
own docstrings). Read with `ast`, so neither torch nor fxbudget is imported.

    python docs/_signals.py            # rewrite the region between <!-- signals table --> markers in docs/rule.md
    python docs/_signals.py --check    # exit 1 if the committed table differs from the code's (tests do this)

The docs build fills the same region from the code (`docs/_hooks.py`), so the site never shows a stale table.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "fxbudget" / "rules" / "base.py"
PAGE = ROOT / "docs" / "rule.md"
START, END = "<!-- signals table -->", "<!-- /signals table -->"


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise SystemExit(f"{SOURCE}: no class {name}")


def attributes(doc: str) -> dict[str, str]:
    """The `Attributes:` section of a Google-style docstring: name -> text (lines joined; `a, b: text` gives both
    names the same text)."""
    section = doc.split("Attributes:", 1)[1] if "Attributes:" in doc else ""
    out: dict[str, str] = {}
    names: list[str] = []
    for line in section.splitlines():
        m = re.match(r"^ {4}(\w+(?:, \w+)*): (.*)$", line)
        if m:
            names = m.group(1).split(", ")
            for n in names:
                out[n] = m.group(2).strip()
        elif line.strip() and names:
            for n in names:
                out[n] += " " + line.strip()
        elif not line.strip() and out:
            names = []
    return out


def _cell(text: str) -> str:
    # `||v||` (a norm) as `‖v‖`: an escaped pipe inside a code span shows its backslash on the site.
    return " ".join(text.split()).replace("||", "‖").replace("|", "\\|")


def signals_table(source: str | None = None) -> str:
    """Markdown: one line per `Signals` field (name, type, meaning), then its properties and methods."""
    cls = _class(ast.parse(source if source is not None else SOURCE.read_text()), "Signals")
    described = attributes(ast.get_docstring(cls) or "")
    lines = ["| field | type | meaning |", "|---|---|---|"]
    fields = [n for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    missing = [f.target.id for f in fields if f.target.id not in described]
    if missing:
        raise SystemExit(f"{SOURCE}: Signals fields without a line in its docstring's Attributes: {missing}")
    for f in fields:
        lines.append(f"| `{f.target.id}` | `{ast.unparse(f.annotation)}` | {_cell(described[f.target.id])} |")
    derived = ["", "Derived from the fields (computed only by a rule that reads them):", "",
               "| name | kind | meaning |", "|---|---|---|"]
    for node in cls.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        decorators = {ast.unparse(d) for d in node.decorator_list}
        if decorators & {"property", "functools.cached_property", "cached_property"}:
            kind, name = "property", f"`{node.name}`"
        else:
            args = [a.arg for a in node.args.args[1:]]
            kind, name = "method", f"`{node.name}({', '.join(args)})`"
        doc = (ast.get_docstring(node) or "").strip()
        derived.append(f"| {name} | {kind} | {_cell(doc)} |")
    return "\n".join(lines + derived)


def fill(text: str, table: str | None = None) -> str:
    """`text` with the region between the markers replaced by the table (unchanged without markers)."""
    body = f"{START}\n{table if table is not None else signals_table()}\n{END}"
    return re.sub(rf"{re.escape(START)}.*?{re.escape(END)}", lambda _: body, text, flags=re.S)


def main(argv: list[str]) -> int:
    text = PAGE.read_text()
    if START not in text:
        raise SystemExit(f"{PAGE}: no '{START}' marker")
    new = fill(text)
    if "--check" in argv:
        if new != text:
            print(f"{PAGE.relative_to(ROOT)}: the Signals table is stale: run `python docs/_signals.py`")
            return 1
        return 0
    if new != text:
        PAGE.write_text(new)
    print(f"{PAGE.relative_to(ROOT)}: Signals table {'rewritten' if new != text else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
