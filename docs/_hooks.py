"""mkdocs hook: the benchmark results (`benchmarks/`) become part of the site, so the pages link to them as GitHub
does (`../benchmarks/results/x.md` from `docs/`) and `mkdocs build --strict` checks those links like any other; and
the `Signals` table of "Your own rule" is filled from the code (`docs/_signals.py`) as the site is built."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _signals  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHARED = "benchmarks"


def on_files(files, config):
    """Add every file under `benchmarks/` (results, their analyses and data) at `benchmarks/...` in the site."""
    for path in sorted((ROOT / SHARED).rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            files.append(File(path.relative_to(ROOT).as_posix(), src_dir=str(ROOT), dest_dir=config["site_dir"],
                              use_directory_urls=config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    """In a page of `docs/`, `../benchmarks/` is `benchmarks/` of the site (the folder added by `on_files`); in a page
    of `benchmarks/`, `../docs/` is the site's root."""
    if "/" not in page.file.src_uri:
        markdown = markdown.replace(f"](../{SHARED}/", f"]({SHARED}/")
    elif page.file.src_uri.startswith(f"{SHARED}/"):  # and back: `docs/` of the repository is the site's root
        markdown = re.sub(r"\]\(((?:\.\./)+)docs/", r"](\1", markdown)
    if page.file.src_uri == "rule.md":
        markdown = _signals.fill(markdown)  # the table from the code, even if the committed copy were stale
    return markdown
