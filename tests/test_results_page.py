"""benchmarks/RESULTS.md's figures are its linked files' (issue 55): every number in a row's result column is a
number of the files its benchmark column links (the file, its `.analysis.md`, every text file of a linked folder), as
written there or rounded to the digits the row shows. A figure typed by hand, or left behind when its file was
regenerated, fails here naming the row."""

import re
from decimal import Context, Decimal, ROUND_HALF_EVEN, ROUND_HALF_UP
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
# A number not inside a word or a version; lengths written 8K / 32K are the row's settings, not its results.
NUMBER = re.compile(r"(?<![\w.\-])\d+(?:\.\d+)?(?![\dK])")
NOT_RESULTS = re.compile(r"issues? \d+(?:, \d+)*|k = \d+(?: / \d+)*|B = \d+(?: / \d+)*|B \d+(?:-\d+)?(?: / \d+)*")
CONTEXT = Context(prec=200)


def _rows() -> list[tuple[str, str]]:
    rows = []
    for line in (BENCH / "RESULTS.md").read_text().splitlines():
        if line.startswith("| ["):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            rows.append((cells[0], cells[3]))
    return rows


def _linked_text(benchmark: str) -> str:
    files = []
    for link in re.findall(r"\]\(([^)]+)\)", benchmark):
        path = (BENCH / link.split("#", 1)[0]).resolve()  # an anchor names a part of the file
        if path.is_dir():
            files += [f for f in sorted(path.rglob("*")) if f.suffix in (".md", ".json", ".jsonl", ".txt", ".csv")]
        else:
            assert path.is_file(), f"RESULTS.md links {link}, which does not exist"
            files += [path] + [p for p in [path.with_name(path.stem + ".analysis.md")] if p.is_file()]
    return "\n".join(f.read_text(errors="replace") for f in files).replace(",", "")


def _shown(figure: str, written: list[Decimal]) -> bool:
    """Whether `figure` is one of `written` as written, equal, or rounded to `figure`'s digits."""
    want = Decimal(figure)
    step = Decimal(1).scaleb(want.as_tuple().exponent)
    return any(x == want or (x.as_tuple().exponent <= want.as_tuple().exponent
                             and x.quantize(step, rounding=r, context=CONTEXT) == want)
               for x in written for r in (ROUND_HALF_UP, ROUND_HALF_EVEN))


@pytest.mark.parametrize("benchmark,result", _rows(), ids=[b.split("]")[0].lstrip("[") for b, _ in _rows()])
def test_every_figure_of_a_row_is_in_its_linked_files(benchmark, result):
    written = [Decimal(x) for x in set(NUMBER.findall(_linked_text(benchmark)))]
    figures = NUMBER.findall(NOT_RESULTS.sub(" ", result))
    missing = [f for f in figures if not _shown(f, written)]
    assert not missing, f"{benchmark}: {missing} are not in its linked files (regenerate the row from them)"


def test_the_check_catches_a_figure_typed_by_hand():
    written = [Decimal(x) for x in NUMBER.findall("| 32K | 1.744x | 0.94x | 2.33 |")]
    assert _shown("1.74", written) and _shown("1.7", written) and _shown("2.33", written)  # as written, rounded
    assert not _shown("2.2", written) and not _shown("1.75", written) and not _shown("32", written)
    assert NUMBER.findall(NOT_RESULTS.sub(" ", "8.1x / 7.2x at 8K / 32K, B = 1024 (issue 40)")) == ["8.1", "7.2"]
