"""Hardware-neutral results: dump what every rule kept on one machine, dump it on another, compare.

    OMP_NUM_THREADS=1 python benchmarks/cross_device.py dump --device cpu --dtype float32 --backend eager \\
        --out benchmarks/results/cross_device/cpu-float32-eager.json.gz
    python benchmarks/cross_device.py compare A.json.gz B.json.gz [C D ...] [--md OUT.md]

`dump` runs the embedded model (or `--model DIR`) on fixed prompts (`--task` generated from `--seed` at each of
`--lengths` context tokens; the whole chat prompt, question included, is one prefill call with eviction), for every
evicting rule (`fxbudget.rules.available()` minus `full` and the replay rule `kvzip`) at each of `--budgets`. For each
(length, rule, budget) it records the kept positions of every budgeted layer and KV head after the prefill and after
`--steps` greedy decode steps (eviction on at every step), the greedy tokens with their top-1/top-2 logit gap, and
the environment. Tokens are taken for a fixed number of steps (EOS does not stop them), so two dumps always have the
same length.

- `--backend eager`: fxbudget's eager kernel. Each prompt's forward runs once (`shared_prefill`) and each rule's cache
  is branched from it (`branch`: bit-identical to a separate prefill, tests/test_branch.py). The rule is wrapped in
  `_ScoreRecorder`, which records the score the rule returns (unchanged) so the dump also holds each head's **cut
  margin** after the prefill: the relative difference (lo - hi) / max(|lo|, |hi|) of the lowest kept score lo and
  the highest dropped score hi (0 for an exact tie, which the kernel breaks by position). Protected candidates score
  +inf and empty slots -inf, as in the kernel; a cut with no finite score on both sides has no margin (null).
- `--backend inductor` (or `aot_eager`): `fxbudget.compile(..., backend=...)` per (rule, budget), one-call prefill
  (the same semantics as the eager path), then the decode steps through the compiled forward. No margins (a
  recording rule cannot run inside a compiled graph). Each (rule, budget) compiles a prefill and a decode graph.

`compare` matches entries by (length, rule, budget) and writes, per entry: the kept-set overlap |A & B| / held
(mean and min over layers x KV heads) after the prefill and after decoding, how many heads differ after the prefill,
how many heads have an exact tie at the cut (margin 0) and a near-tie (0 < margin <= `--tie`, default 1e-6) in A and
in B, how many differing heads have neither in either dump (unexplained), and whether the greedy tokens agree (else
the first differing step and the top-1/top-2 logit gaps there). Dumps of different prompts (token hashes) are refused.
"""

from __future__ import annotations

import argparse
import base64
import functools
import gzip
import hashlib
import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchlib.env import ROOT, command_line, env_info, setup_threads
from benchlib.output import md_table, write_md

FORMAT = 1
DEFAULT_LENGTHS = (2000, 8000)
DEFAULT_BUDGETS = (256, 1024)
TIE = 1e-6  # relative cut margin below which a head's choice counts as a near-tie (fp32 eps is 1.2e-7)


# ------------------------------------------------------------------------------------------------------------------
# Recording
# ------------------------------------------------------------------------------------------------------------------

@functools.cache
def _recorder_class():
    """`_ScoreRecorder`, built lazily so `compare` never imports torch or fxbudget."""
    from fxbudget.rules import Rule
    from fxbudget.rules.wrapper import Wrapper

    @dataclass
    class _ScoreRecorder(Wrapper):
        """Runs `rule` unchanged and, while `active`, records each call's score, protect mask and positions (one
        record per budgeted layer, in call order). Per-layer budgets, window and RoPE needs are the rule's."""

        rule: Rule = None
        active: bool = True
        records: list = field(default_factory=list, repr=False)

        def __post_init__(self):
            self.name = self.rule.name  # every capability is the rule's (`Wrapper`)

        def score(self, s):
            out = self.rule.score(s)
            if self.active:
                self.records.append({"score": out.detach().float().clone(), "pos": s.pos.clone(),
                                     "budget": s.budget, "protect": None})
            return out

        def protect(self, s):
            p = self.rule.protect(s)
            if self.active and p is not None:
                self.records[-1]["protect"] = p.clone()
            return p

    return _ScoreRecorder


def cut_margins(score, pos, protect, keep: int) -> list[float | None]:
    """Relative score margin at the cut for batch row 0's KV heads: one float or None per head.

    The kernel keeps the top `keep` candidates by (score, newer position), protected candidates at +inf and empty
    slots (pos < 0) at -inf. The margin is the relative difference between the lowest kept score `lo` and the highest
    dropped score `hi`: (lo - hi) / max(|lo|, |hi|), 0 for an exact tie (broken by position). Rounding noise in a
    score is proportional to its own magnitude, so the scores at the cut set the scale, not the largest score of the
    head (attention-based scores at the cut are often 1e-5 of the largest). None when no finite score competes at
    the cut: everything fits, or the cut separates protected candidates (ordered by position) or a candidate from
    empty slots.

    Args:
        score: `[batch, heads, C]` the rule's score. pos: `[batch, heads, C]`. protect: bool mask or None.
        keep: how many candidates the call keeps.
    """
    import torch

    final = score.float()
    if protect is not None:
        final = final.masked_fill(protect, float("inf"))
    final = final.masked_fill(pos < 0, float("-inf"))[0]
    out = []
    for s in final:
        if s.numel() <= keep:
            out.append(None)
            continue
        top = torch.topk(s, keep + 1).values
        lo, hi = float(top[keep - 1]), float(top[keep])
        if not (np.isfinite(lo) and np.isfinite(hi)):
            out.append(None)
        else:
            out.append(0.0 if lo == hi else (lo - hi) / max(abs(lo), abs(hi)))
    return out


def _pack(pos_row, seen: int) -> str:
    """Kept positions of one head (a 1-D tensor, -1 = empty) as a base64 bitmap over 0..seen-1."""
    bits = np.zeros(seen, dtype=bool)
    p = pos_row.cpu().numpy()
    bits[p[p >= 0]] = True
    return base64.b64encode(np.packbits(bits).tobytes()).decode()


def unpack(b64: str, seen: int) -> np.ndarray:
    """Inverse of `_pack`: a bool array of length `seen`."""
    return np.unpackbits(np.frombuffer(base64.b64decode(b64), dtype=np.uint8), count=seen).astype(bool)


def kept_sets(cache) -> dict:
    """`{"seen", "kept": [[b64 per KV head] per budgeted layer]}` of batch row 0."""
    seen = cache.tokens_seen
    layers = [i for i, layer in enumerate(cache.layers) if not layer.sliding]
    return {"seen": seen, "kept": [[_pack(row, seen) for row in cache.positions(i)[0]] for i in layers]}


def _decode(model, cache, logits, steps: int) -> tuple[list[int], list[float]]:
    """`steps` greedy tokens from `logits` on (the first from the prefill), each fed back through `model`."""
    import torch

    tokens, gaps = [], []
    for _ in range(steps):
        top = torch.topk(logits[0].float(), 2).values
        tok = int(logits[0].argmax())
        tokens.append(tok)
        gaps.append(float(top[0] - top[1]))
        logits = model(input_ids=torch.tensor([[tok]], device=logits.device), past_key_values=cache,
                       logits_to_keep=1).logits[:, -1]
    return tokens, gaps


def _sync(x) -> None:
    if x.is_cuda:
        import torch

        torch.cuda.synchronize()


def run_entry(model, ids, rule_name: str, budget: int, steps: int, backend: str, shared=None) -> dict:
    """Kept sets after the prefill and after `steps` decode steps, tokens and (eager) cut margins for one config.

    `prefill_s` is the compiled prefill (compile included), or for the eager backend the branch from the shared
    prefill (whose forward is timed once per prompt, `prompts[length]["shared_prefill_s"]`).

    Args:
        model: an unmodified HF causal LM (fxbudget compiles and restores it here).
        ids: the prompt `[1, n]` on the model's device. rule_name: a registered rule.
        budget: the uniform budget. steps: decode steps. backend: "eager" or a Dynamo backend name.
        shared: the prompt's `shared_prefill` (eager backend only).
    """
    import torch

    import fxbudget
    from fxbudget.harness.branch import branch
    from fxbudget.rules import get

    rule = get(rule_name)
    eager = backend == "eager"
    if eager:
        rule = _recorder_class()(rule=rule)
    entry = {"rule": rule_name, "budget": budget}
    with torch.no_grad():
        fxbudget.compile(model, rule=rule, budget=budget, backend=None if eager else backend)
        try:
            cache = model.forward.new_cache(1)
            t = time.perf_counter()
            if eager:
                branch(shared, cache, rule)
                logits = shared.logits
                rule.active = False
            else:
                logits = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits[:, -1]
            _sync(ids)
            entry["prefill_s"] = time.perf_counter() - t
            entry["layer_budgets"] = cache.layer_budgets
            entry["prefill"] = kept_sets(cache)
            if eager:
                if len(rule.records) != len(cache.layer_budgets):
                    raise RuntimeError(f"{len(rule.records)} score records for {len(cache.layer_budgets)} layers")
                entry["cut_margins"] = [cut_margins(r["score"], r["pos"], r["protect"], r["budget"])
                                        for r in rule.records]
                rule.records.clear()
            else:
                entry["cut_margins"] = None
            t = time.perf_counter()
            entry["tokens"], entry["token_gaps"] = _decode(model, cache, logits, steps)
            _sync(ids)
            entry["decode_s"] = time.perf_counter() - t
            entry["decode"] = kept_sets(cache)
        finally:
            model.forward.restore()
    return entry


def prompt_ids(tokenizer, task: str, length: int, seed: int):
    """The fixed prompt: sample 0 of `task` at `length` context tokens from `seed`, context + question."""
    import torch

    from fxbudget.harness.tasks import chat_ids, make_samples

    sample = make_samples(task, tokenizer, length, 1, seed=seed)[0]
    return torch.cat(chat_ids(tokenizer, sample), dim=1), sample


def _git_commit() -> str | None:
    """HEAD of the checkout, with "+dirty" if tracked files differ from it; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def dump(model, tokenizer, model_name: str, *, device: str, dtype: str, backend: str, task: str = "niah_multikey",
         seed: int = 0, lengths=DEFAULT_LENGTHS, rules=None, budgets=DEFAULT_BUDGETS, steps: int = 32,
         command: str = "", log=print) -> dict:
    """Run every (length, rule, budget) and return the dump (a JSON-able dict).

    Args:
        model, tokenizer, model_name: the model (moved to `device`/`dtype` here), its tokenizer and recorded name.
        device: "cpu", "cuda" or "cuda:N". dtype: "float32" or "bfloat16". backend: "eager", "inductor" or "aot_eager".
        task, seed, lengths: the prompts. rules: rule names (default: every evicting rule). budgets, steps: as above.
        command: the command line recorded in the dump. log: progress messages.
    """
    import torch
    import transformers

    from fxbudget.harness.branch import shared_prefill
    from fxbudget.kernel import DEFAULT_WINDOW
    from fxbudget.rules import available, get

    # Replay rules (kvzip) evict only in their own protocol, not in plain generation.
    rules = list(rules or [r for r in available() if r != "full" and not get(r).replay_only])
    model = model.to(device=device, dtype=getattr(torch, dtype)).eval()
    env = env_info(device)
    env.update(dtype=dtype, backend=backend, transformers=transformers.__version__, fxbudget_commit=_git_commit(),
               device_name=env.get("gpu") or env["cpu"])
    out = {"format": FORMAT, "env": env, "command": command,
           "config": {"model": model_name, "task": task, "seed": seed, "lengths": list(lengths), "rules": rules,
                      "budgets": list(budgets), "steps": steps, "window": DEFAULT_WINDOW},
           "prompts": {}, "entries": []}
    t_all = time.perf_counter()
    for length in lengths:
        ids, sample = prompt_ids(tokenizer, task, length, seed)
        ids = ids.to(device)
        digest = hashlib.sha256(ids.cpu().numpy().astype(np.int64).tobytes()).hexdigest()
        out["prompts"][str(length)] = {"tokens": ids.shape[1], "sha256": digest, "depth": sample.depth}
        shared, shared_s = None, None
        if backend == "eager":
            t = time.perf_counter()
            with torch.no_grad():
                shared = shared_prefill(model, ids)
            _sync(ids)
            shared_s = time.perf_counter() - t
            out["prompts"][str(length)]["shared_prefill_s"] = shared_s
            log(f"length {length}: {ids.shape[1]} tokens, shared prefill {shared_s:.1f} s")
        for rule in rules:
            for budget in budgets:
                entry = run_entry(model, ids, rule, budget, steps, backend, shared)
                entry["length"] = length
                out["entries"].append(entry)
                log(f"length {length} {rule} B={budget}: prefill {entry['prefill_s']:.1f} s, "
                    f"decode {entry['decode_s']:.1f} s")
        del shared
    out["wall_s"] = time.perf_counter() - t_all
    return out


def save(d: dict, path: str | Path) -> None:
    """Write a dump as JSON (gzip-compressed if the name ends in .gz)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(d, separators=(",", ":"))
    if path.suffix == ".gz":
        with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
            f.write(text.encode())  # mtime 0: the same dump gives the same bytes
    else:
        path.write_text(text)


def load(path: str | Path) -> dict:
    """Read a dump written by `save`."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        d = json.load(f)
    if d.get("format") != FORMAT:
        raise ValueError(f"{path}: not a cross_device dump of format {FORMAT}")
    return d


# ------------------------------------------------------------------------------------------------------------------
# Comparison
# ------------------------------------------------------------------------------------------------------------------

def _overlaps(a: dict, b: dict) -> list[float]:
    """|A & B| / held for every (layer, head) of one phase (held = the larger of the two kept counts)."""
    if a["seen"] != b["seen"]:
        raise ValueError(f"the dumps saw {a['seen']} and {b['seen']} tokens")
    out = []
    for la, lb in zip(a["kept"], b["kept"], strict=True):
        for ha, hb in zip(la, lb, strict=True):
            x, y = unpack(ha, a["seen"]), unpack(hb, b["seen"])
            held = max(int(x.sum()), int(y.sum()))
            out.append(float((x & y).sum()) / held if held else 1.0)
    return out


def _ties(margins, tie: float) -> tuple[list[bool], list[bool]] | tuple[None, None]:
    """Per (layer, head): an exact tie at the cut (margin 0), a near-tie (0 < margin <= tie); None without margins."""
    if margins is None:
        return None, None
    flat = [m for layer in margins for m in layer]
    return [m == 0.0 for m in flat], [m is not None and 0.0 < m <= tie for m in flat]


def compare_entries(a: dict, b: dict, tie: float = TIE) -> dict:
    """One row of the comparison of two entries with the same (length, rule, budget)."""
    pre, dec = _overlaps(a["prefill"], b["prefill"]), _overlaps(a["decode"], b["decode"])
    differing = [o < 1.0 for o in pre]
    (xa, na), (xb, nb) = _ties(a.get("cut_margins"), tie), _ties(b.get("cut_margins"), tie)
    if xa is None and xb is None:
        unexplained = None
    else:
        none = [False] * len(pre)
        tied = [any(t) for t in zip(xa or none, na or none, xb or none, nb or none)]
        unexplained = sum(d and not t for d, t in zip(differing, tied))
    first = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None)
    if first is None and len(a["tokens"]) != len(b["tokens"]):
        first = min(len(a["tokens"]), len(b["tokens"]))
    return {"length": a["length"], "rule": a["rule"], "budget": a["budget"],
            "prefill_mean": float(np.mean(pre)), "prefill_min": min(pre),
            "decode_mean": float(np.mean(dec)), "decode_min": min(dec),
            "heads": len(pre), "heads_differing": sum(differing),
            "exact_ties_a": None if xa is None else sum(xa), "exact_ties_b": None if xb is None else sum(xb),
            "near_ties_a": None if na is None else sum(na), "near_ties_b": None if nb is None else sum(nb),
            "unexplained": unexplained, "tokens_agree": first is None, "first_diff": first,
            "gaps_at_diff": None if first is None or first >= min(len(a["tokens"]), len(b["tokens"]))
            else (a["token_gaps"][first], b["token_gaps"][first]), "steps": len(a["tokens"])}


def compare(a: dict, b: dict, tie: float = TIE) -> dict:
    """Compare two dumps over their common (length, rule, budget) entries.

    Returns:
        `{"rows": [...], "only_a": [...], "only_b": [...]}`; each row from `compare_entries`.
    Raises:
        ValueError: if a common length was run on different prompts (token hashes differ).
    """
    for length, p in a["prompts"].items():
        q = b["prompts"].get(length)
        if q is not None and q["sha256"] != p["sha256"]:
            raise ValueError(f"length {length}: the dumps ran different prompts ({p['tokens']} vs {q['tokens']} "
                             "tokens; another tokenizer, task or seed?)")
    key = lambda e: (e["length"], e["rule"], e["budget"])  # noqa: E731
    ea, eb = {key(e): e for e in a["entries"]}, {key(e): e for e in b["entries"]}
    rows = [compare_entries(ea[k], eb[k], tie) for k in ea if k in eb]
    return {"rows": rows, "only_a": [k for k in ea if k not in eb], "only_b": [k for k in eb if k not in ea]}


def _label(d: dict) -> str:
    e = d["env"]
    return f"{e['device_name']} {e['dtype']} {e['backend']}"


def _short(commit: str | None) -> str:
    return "unknown" if not commit else commit[:9] + ("+dirty" if commit.endswith("+dirty") else "")


def _f(x: float) -> str:
    return "1" if x == 1.0 else f"{x:.4f}"


def _na(x) -> str:
    return "n/a" if x is None else str(x)


def report_lines(a: dict, b: dict, names: tuple[str, str], tie: float = TIE) -> list[str]:
    """Markdown section for one pair of dumps: environments, the per-entry table and a per-rule summary."""
    res = compare(a, b, tie)
    rows = res["rows"]
    lines = [f"## A = {_label(a)} vs B = {_label(b)}", ""]
    for tag, d, name in (("A", a, names[0]), ("B", b, names[1])):
        e = d["env"]
        lines.append(f"- {tag}: `{name}`: {e['device_name']}, {e['dtype']}, backend {e['backend']}, torch "
                     f"{e['torch']}, transformers {e['transformers']}, fxbudget {_short(e.get('fxbudget_commit'))}, "
                     f"{e['date']} (load {e['load']} at start); dump wall time {d['wall_s']:.0f} s; command `{d['command']}`")
    cfg = a["config"]
    lines += [f"- Model {cfg['model']}; prompts: {cfg['task']} seed {cfg['seed']} "
              + ", ".join(f"{k}: {v['tokens']} tokens" for k, v in a["prompts"].items() if k in b["prompts"])
              + f"; {cfg['steps']} decode steps, eviction on at every step", ""]
    if not rows:
        return lines + ["No common entries.", ""]
    table = []
    for r in rows:
        tokens = f"agree ({r['steps']})" if r["tokens_agree"] else (
            f"differ from step {r['first_diff']}" + ("" if r["gaps_at_diff"] is None else
                                                    " (logit gap A {:.3g}, B {:.3g})".format(*r["gaps_at_diff"])))
        table.append([r["length"], r["rule"], r["budget"], _f(r["prefill_mean"]), _f(r["prefill_min"]),
                      _f(r["decode_mean"]), _f(r["decode_min"]), f"{r['heads_differing']} / {r['heads']}",
                      f"{_na(r['exact_ties_a'])} / {_na(r['exact_ties_b'])}",
                      f"{_na(r['near_ties_a'])} / {_na(r['near_ties_b'])}", _na(r["unexplained"]), tokens])
    lines += md_table(["length", "rule", "budget", "prefill overlap mean", "min", "decode overlap mean", "min",
                       "heads differing (prefill)", "exact ties A / B", f"near-ties A / B (<= {tie:g})",
                       "differing, no tie", "greedy tokens"], table)
    identical = sum(r["heads_differing"] == 0 for r in rows)
    agree = sum(r["tokens_agree"] for r in rows)
    unexplained = [r["unexplained"] for r in rows if r["unexplained"] is not None]
    lines += ["", f"- Identical kept sets after the prefill: {identical} of {len(rows)} entries; greedy tokens agree: "
              f"{agree} of {len(rows)}; differing heads without a tie: "
              + (str(sum(unexplained)) if unexplained else "n/a (no margins recorded)")
              + f"; mean prefill overlap {np.mean([r['prefill_mean'] for r in rows]):.4f}, min "
              f"{min(r['prefill_min'] for r in rows):.4f}."]
    for tag, keys in (("A", res["only_a"]), ("B", res["only_b"])):
        if keys:
            lines.append(f"- {len(keys)} entries only in {tag} (not compared): "
                         + ", ".join(f"{n}/{r}/{bud}" for n, r, bud in keys[:12]) + (" ..." if len(keys) > 12 else ""))
    by_rule: dict[str, list[dict]] = {}
    for r in rows:
        by_rule.setdefault(r["rule"], []).append(r)
    lines += ["", "Per rule (all lengths and budgets compared):", ""]
    lines += md_table(["rule", "prefill overlap mean", "min", "decode overlap mean", "tokens agree"],
                      [[rule, _f(float(np.mean([r["prefill_mean"] for r in rs]))), _f(min(r["prefill_min"] for r in rs)),
                        _f(float(np.mean([r["decode_mean"] for r in rs]))),
                        f"{sum(r['tokens_agree'] for r in rs)} / {len(rs)}"] for rule, rs in sorted(by_rule.items())])
    return lines + [""]


# ------------------------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------------------------

def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _names(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


def _command(argv: list[str] | None) -> str:
    """The command line that is running (from `argv` when main() is called directly)."""
    if argv is None:
        return command_line()
    return "OMP_NUM_THREADS=1 python benchmarks/cross_device.py " + shlex.join(argv)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="record kept sets and tokens for every rule and budget")
    d.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when a GPU is visible, else cpu, "
                   "as `fxbudget compare`)")
    d.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="default: bfloat16 on a GPU, float32 on the CPU (as `fxbudget compare`)")
    d.add_argument("--backend", default="eager", choices=["eager", "inductor", "aot_eager"])
    d.add_argument("--model", default=None, help="local HF model directory or .gguf (default: the embedded model)")
    d.add_argument("--task", default="niah_multikey")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--lengths", type=_ints, default=list(DEFAULT_LENGTHS), help="context tokens, e.g. 2000,8000")
    d.add_argument("--rules", type=_names, default=None, help="default: every rule but full")
    d.add_argument("--budgets", type=_ints, default=list(DEFAULT_BUDGETS))
    d.add_argument("--steps", type=int, default=32, help="greedy decode steps")
    d.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    d.add_argument("--out", required=True, help="FILE.json or FILE.json.gz")
    c = sub.add_parser("compare", help="compare dumps pairwise: A B [C D ...]")
    c.add_argument("dumps", nargs="+")
    c.add_argument("--md", default=None, help="write the Markdown report here")
    c.add_argument("--tie", type=float, default=TIE, help="relative cut margin counted as a near-tie")
    args = p.parse_args(argv)

    if args.cmd == "dump":
        from fxbudget.models.devices import resolve

        try:  # the defaults filled in, an absent GPU refused: before any model work
            place = resolve(args.device, args.dtype)
        except ValueError as e:
            p.error(str(e))
        setup_threads(args.threads)
        if place.device == "cpu":
            from fxbudget.harness.malloc import tune_malloc

            tune_malloc()
        from fxbudget.models import load_model

        model, tok, name = load_model(args.model, progress=False, device=place.device, dtype=place.dtype)
        d = dump(model, tok, name, device=place.device, dtype=place.dtype, backend=args.backend, task=args.task,
                 seed=args.seed, lengths=args.lengths, rules=args.rules, budgets=args.budgets, steps=args.steps,
                 command=_command(argv))
        save(d, args.out)
        print(f"wrote {args.out} ({len(d['entries'])} entries, {d['wall_s']:.0f} s)")
        return 0

    if len(args.dumps) % 2:
        p.error("compare takes dumps in pairs: A B [C D ...]")
    lines = ["# Cross-device kept sets (generated by benchmarks/cross_device.py)", "",
             f"Command: `{_command(argv).removeprefix('OMP_NUM_THREADS=1 ')}`", "",
             "Overlap = |A & B| / held per budgeted layer and KV head (mean and min over layers x heads), after the "
             "prefill and after the decode steps. Cut margin of a head after the prefill = (lo - hi) / max(|lo|, |hi|), "
             "lo the lowest kept and hi the highest dropped score: an exact tie when it is 0 (the kernel then keeps "
             f"the newer position), a near-tie when it is at most {args.tie:g}. Margins are recorded by eager dumps "
             "only (n/a otherwise). \"differing, no tie\" counts heads whose kept sets differ although neither dump "
             "has an exact or near tie there.", ""]
    for i in range(0, len(args.dumps), 2):
        a, b = load(args.dumps[i]), load(args.dumps[i + 1])
        lines += report_lines(a, b, (args.dumps[i], args.dumps[i + 1]), args.tie)
    if args.md:
        write_md(args.md, lines)
    else:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
