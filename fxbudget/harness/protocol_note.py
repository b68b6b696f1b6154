"""What a run and a report say about the protocol, so that nobody reads a query-agnostic score of SnapKV as SnapKV's.

The default protocol is query-agnostic (kvpress's, DESIGN §6): the context is compressed before the question is
seen. Rules that choose with the attention of the observation window (the latest queries of each call: `snapkv`,
`tova`, `pyramidkv`, `chunkkv`, ...; found by a dry run of each rule's score, `fxbudget.kernel.probe`, not by a list)
were designed with the question in that window; under query-agnostic the window holds the context's last tokens,
and on retrieval tasks they can score 0 where query-aware gives them 1. That is a fair comparison of what a rule can
do without the question, not a broken rule; these notes say so where a reader looks:

- `run_note`: one line printed when a run starts (`fxbudget compare`), when such a rule runs without query-aware;
- `header_note`: the report's protocol sentence, under its title;
- `row_note`: beside the row of such a rule in a query-agnostic column.
"""

from __future__ import annotations

DEFAULT_PROTOCOL = "query-agnostic"
_MEANING = {
    "query-agnostic": "the context is compressed before the question is seen (kvpress's default; the question and the "
                      "answer are appended without eviction)",
    "query-aware": "the context and the question are compressed together, the question's queries in the observation "
                   "window (SnapKV's setting)",
    "streaming": "eviction on every call, the question and every decoded token included; memory is the budget "
                 "throughout",
    "multi-request": "several requests over one context (SCBench's shared context): the context is compressed once, "
                     "before any question is seen, and every request starts from that same compressed cache (its "
                     "question and answer appended without eviction, the cache restored after it); one row per "
                     "request (`turn`)",
    "multi-turn": "several requests over one context as turns of one chat (SCBench's multi-turn): the context is "
                  "compressed once, then each turn's call appends the previous turn's gold answer and this turn's "
                  "question with eviction (the rule sees this question, never a later one), and the answer is "
                  "generated without eviction; one row per turn (`turn`), a later turn scoring what the earlier "
                  "compressions kept",
}


def question_rules(rules: list[str], rule_params: dict | None = None) -> list[str]:
    """The rules among `rules` that choose with the observation window's attention (so were designed with the
    question in it): a dry run of each one's score; `full`, replay rules (kvzip, its own protocol) and names that are
    not registered here (a report of another session's `--rule-file` rule) left out."""
    from ..kernel.probe import RuleProbeError, reads_observation_window
    from ..rules import get

    out = []
    for name in rules:
        if name == "full":
            continue
        try:
            rule = get(name, **(rule_params or {}).get(name, {}))
            if not rule.replay_only and reads_observation_window(rule):
                out.append(name)
        except (ValueError, TypeError, RuleProbeError):
            continue
    return out


def run_note(rules: list[str], protocols: list[str], rule_params: dict | None = None) -> str | None:
    """The line to print as a run starts when a rule designed around the question runs without query-aware (None
    otherwise)."""
    # multi-turn's calls evict with each turn's question in the window: only the protocols that never do are meant
    blind = [p for p in protocols if p in ("query-agnostic", "streaming", "multi-request")]
    if "query-aware" in protocols or not blind:
        return None
    names = question_rules(rules, rule_params)
    if not names:
        return None
    these = ", ".join(names)
    return (f"protocol {','.join(blind)}: {these} choose{'s' if len(names) == 1 else ''} with the attention of "
            f"the latest queries, which {'its paper fills' if len(names) == 1 else 'their papers fill'} with the "
            "question; here the context is compressed before the question is seen, so expect low scores on retrieval "
            "tasks (a fair comparison without the question, not a broken rule). For their own setting add "
            "--protocol query-aware (or run both: --protocol query-agnostic,query-aware)")


def interval_note(interval: int) -> str:
    """What the streaming protocol does at a decode interval > 1 (kvpress's DecodingPress), and the memory it holds:
    the budget accounting of such rows (docs/DESIGN.md §3)."""
    return (f"at decode interval {interval}: every call of several tokens (prefill, question) evicts to the budget; "
            f"decode steps evict only every "
            f"{interval}th step since the last eviction, down to the budget (kvpress DecodingPress's "
            f"compression_interval {interval}, target_size the budget), and append without eviction (or the rule's "
            f"scoring) in between, so a layer grows to budget + {interval - 1} entries between evictions (each "
            f"evicting step attends over budget + {interval}) and holds exactly the budget after each; the cache "
            f"allocates budget + max(head-room, {interval - 1}) slots per layer and KV head, which "
            f"`kv_allocated_bytes` counts")


def header_note(protocols: list[str], intervals: list[int] | None = None) -> str:
    """The report's sentence on its protocols: what each means, and which is the default. `intervals`: the decode
    intervals of the streaming rows (`interval_note` for each above 1)."""
    intervals = sorted(set(intervals or [1]))
    # Streaming at interval 1 only when some streaming rows ran at it: its "memory is the budget" is theirs alone.
    parts = [f"`{p}`{' (the default)' if p == DEFAULT_PROTOCOL else ''}: {_MEANING[p]}" for p in protocols
             if p in _MEANING and (p != "streaming" or 1 in intervals)]
    if "streaming" in protocols:
        parts += [f"`streaming` {interval_note(k)}" for k in intervals if k > 1]
    return "Protocol " + "; ".join(parts) + "."


def section_note(rows: list[dict]) -> str | None:
    """The sentence under a report section of one protocol: `row_note` for the rules of `rows` it applies to."""
    protocols = {r["protocol"] for r in rows}
    params = {r["rule"]: r.get("rule_params") or {} for r in rows}
    names = [n for n in params if protocols == {"query-agnostic"} and question_rules([n], params)]
    if not names:
        return None
    return f"**{', '.join(names)}**: " + row_note(names[0], "query-agnostic", params[names[0]]) + "."


def row_note(rule: str, protocol: str, rule_params: dict | None = None) -> str | None:
    """The note beside a report row of `rule` under `protocol`: for a rule designed around the question, run
    query-agnostic (None otherwise)."""
    if protocol != "query-agnostic" or not question_rules([rule], {rule: rule_params or {}}):
        return None
    return ("chooses with the latest queries, which its paper fills with the question; query-agnostic compresses "
            "before the question (--protocol query-aware is its own setting)")
