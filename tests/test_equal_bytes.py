"""The equal-bytes grid's page (benchmarks/equal_bytes.py) on rows built so that the right answer is known (no model):
the ranking, the best-against-worst test, the paper's claim per rule, and the commands of the grid."""

import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
equal_bytes = importlib.import_module("equal_bytes")


def _rows(effect: dict, samples: int = 18, budget: int = 2**20) -> list[dict]:
    """Rows of every storage x rule at one budget; cell (storage, rule) scores `effect` plus a per-sample offset
    shared by every cell (so the paired differences are exact)."""
    rows = []
    for storage in equal_bytes.STORAGES:
        for rule in equal_bytes.RULES:
            for s in range(samples):
                base = -2.0 + 0.1 * (s % 5)
                rows.append({"model": "m", "rule": rule, "slot_dtype": storage, "budget_bytes": budget,
                             "budget": {"bfloat16": 76, "int4": 218}.get(storage, 133), "kv_held_bytes": budget,
                             "task": f"t{s % 6}", "length": 1024, "sample": s // 6, "dtype": "float32",
                             "answer_logprob_mean": base + effect.get((storage, rule), 0.0),
                             "score": 1.0 if effect.get((storage, rule), 0.0) > 0 else 0.0})
    return rows


def test_best_separated_from_worst_and_the_claim_per_rule():
    # int4 / snapkv is best by 1.0 on every sample; bfloat16 / streamingllm worst; int4 beats bfloat16 for snapkv
    # only (the other rules tie across storages).
    effect = {("int4", "snapkv"): 1.0, ("bfloat16", "streamingllm"): -1.0}
    text = equal_bytes.page(_rows(effect), runs=[], per_task=2)
    assert "Best `int4 / snapkv` against worst `bfloat16 / streamingllm`: +2.000" in text
    assert "**separated**" in text
    assert "- `snapkv`: +1.000" in text and "more tokens at lower precision win" in text
    assert "- `knorm`: +0.000" in text and "- `streamingllm`: +1.000" in text
    # The ranking table: the best cell first, with the entries it bought.
    table = [line for line in text.splitlines() if line.startswith("| 1 |")]
    assert table == ["| 1 | `int4 / snapkv` | 218 | 1.00 MiB | -0.817 | 1.00 |"]  # -2 + 0.1 x mean(s % 5) + 1
    assert "int4` beats `bfloat16` for 2 of 4 rules" in text


def test_nothing_separated_when_cells_tie():
    text = equal_bytes.page(_rows({}), runs=[], per_task=2)
    assert "not separated (p = 1)" in text
    assert "**separated**" not in text and "more tokens at lower precision win" not in text


def test_too_few_samples_cannot_separate():
    # 3 paired samples: the sign-flip test's smallest p is 2 / 8, so even a large effect is not separated.
    text = equal_bytes.page(_rows({("int4", "snapkv"): 1.0}, samples=3), runs=[], per_task=2)
    assert "**separated**" not in text and "Partial" in text


def test_commands_spend_one_budget_per_storage_and_the_reference_runs_once():
    cmds = {s: equal_bytes.compare_command(s, 2) for s in equal_bytes.STORAGES}
    for storage, cmd in cmds.items():
        assert cmd[cmd.index("--slot-dtype") + 1] == storage
        assert cmd[cmd.index("--budgets") + 1] == ",".join(equal_bytes.BUDGETS)
    assert sum("full" in cmd[cmd.index("--rules") + 1].split(",") for cmd in cmds.values()) == 1
    assert equal_bytes.planned_rows(1) == len(equal_bytes.TASKS) * (
        len(equal_bytes.STORAGES) * len(equal_bytes.RULES) * len(equal_bytes.BUDGETS) + 1)
