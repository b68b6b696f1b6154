"""`FxBudgetLM`: lm-eval's `fxbudget` model, the compression in the path of every request type.

It is lm-eval's own `hf` model (`HFLM`: the same tokenization, truncation, chat template, windows and stop handling,
so with a budget covering every request its metrics equal `hf`'s) whose three request types run through
`fxbudget.compile` instead of a plain forward:

- `generate_until`: the context is prefilled with eviction (query-aware, streaming: all of it; query-agnostic: the
  part before the question), then the question (query-agnostic) and greedy decoding follow with eviction frozen
  (streaming: decoding evicts), until lm-eval's stop strings, the eos token or `max_gen_toks`.
- `loglikelihood`: the context prefilled the same way, once for all requests that share it (a multiple-choice
  doc's choices); each continuation is then teacher-forced in one call with eviction frozen (streaming: one token
  per call, evicting) and the cache put back; `is_greedy` comes from the same logits.
- The first scored or generated token is always predicted by a call over the compressed cache: when nothing would be
  fed after the prefill, the context's last token is held out of it and fed instead (`FxBudgetLM._split`).
- `loglikelihood_rolling`: each of lm-eval's windows streams through the budget in calls of `chunk_size` tokens
  (default 1), every call evicting (one call would attend exactly and evict only afterwards).

The question (query-agnostic) starts at the last occurrence of `question_marker` in the context if given, else at the
content of the chat template's last user turn (`--apply_chat_template`). A request with no such mark is refused under
query-agnostic (never run as query-aware under the wrong name).
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import warnings

import torch
import transformers
from lm_eval import utils as lm_utils
from lm_eval.api.registry import model_registry
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from ..api import kernel_fingerprint
from ..fairness.fingerprint_store import cached_kernel_fingerprint
from ..kernel.settings import signals_label
from ..kernel.signal_set import run_signals
from ..checks import byte_size
from ..harness.grid import budget_kind
from ..harness.tasks.ruler import find_question
from . import loading
from .engine import Budgeted
from .options import RULER_MARKER, parse

# Stands in for the last user turn's content to find where it starts in the rendered template.
# `conditions()`' words for each budget kind (`harness.grid.BUDGET_KINDS`).
BUDGET_WORDS = {"tokens": "absolute", "bytes": "bytes of KV cache per sequence (budget_tokens: the entries they buy)",
                "percent": "fraction of each request's prefill"}
_SENTINEL = "\u2063fxbudget:question\u2063"
NO_MARK = ("protocol=query-agnostic appends the question after compression, and lm-eval marks no question: run with "
           "--apply_chat_template (the last user turn is the question; not with --cache_requests, which skips "
           "rendering), or give question_marker= (the question starts at its last occurrence in the context), or use "
           "protocol=query-aware (the whole context prefilled with eviction)")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _batches(items: list, key, size: int) -> list[list]:
    """`items` (sorted) cut into runs of at most `size` that share `key(item)`."""
    out: list[list] = []
    for item in items:
        if out and len(out[-1]) < size and key(out[-1][0]) == key(item):
            out[-1].append(item)
        else:
            out.append([item])
    return out


class FxBudgetLM(HFLM):
    """lm-eval model `fxbudget`: `--model_args pretrained=...,rule=snapkv,budget=1024,protocol=query-aware,...`.

    Args (lm-eval passes `--model_args` as keywords; `fxbudget.lmeval.options.parse` checks them all before any
    model is loaded):
        pretrained: a local model directory, a `.gguf` file or a Hub id; omitted: the embedded default model.
        rule: a registered rule (default snapkv), its hyperparameters as further keys (`window=64,kernel=5`).
        budget: KV entries per layer and KV head (`1024`) or a percentage of each request's prefilled tokens (`25%`).
        protocol: query-aware (default), query-agnostic or streaming. question_marker: query-agnostic's question
            starts at its last occurrence in the context (default: the chat template's last user turn).
        backend: none (fxbudget's eager kernel, default), inductor, aot_eager or eager. chunk_size: prefill chunk
            (and rolling call size). block: the kernel's query block. device, dtype: where and in what the model
            runs (default cpu, float32).
        batch_size, max_length, truncation, add_bos_token, ...: as for lm-eval's `hf`.
    """

    def __init__(self, **kwargs):
        self.opts = parse(kwargs)  # every check first: nothing is loaded for a bad argument
        hf = dict(self.opts.hf_args)
        model, tok = loading.load(self.opts.pretrained, tokenizer=self.opts.tokenizer, dtype=self.opts.dtype,
                                  device=self.opts.device, revision=hf.pop("revision", None),
                                  trust_remote_code=bool(hf.get("trust_remote_code", False)),
                                  use_fast_tokenizer=hf.pop("use_fast_tokenizer", True))
        super().__init__(pretrained=model, tokenizer=tok, backend="causal", **hf)
        self.pretrained = loading.model_name(self.opts.pretrained)
        pad = self.tokenizer.pad_token_id
        self.engine = Budgeted(model, self.opts, pad if pad is not None else 0)
        self._question_at: dict[str, int] = {}  # rendered chat prompt -> where its last user turn's content starts
        self._fingerprint: str | None = None
        self._fingerprint_cached: bool | None = None  # read from the on-disk cache `compare` shares

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "FxBudgetLM":
        """As lm-eval's, but `--model_args` win over the command line's `batch_size`/`device`: lm-eval's CLI always
        passes `device` (default cuda:0), and the base class then fails on `device=` in `--model_args` with
        "multiple values for keyword argument"."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "FxBudgetLM":
        """`create_from_arg_obj` of lm-eval's parse of `key=value,...`."""
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

    # --- where the question starts (query-agnostic) ---------------------------------------------------------------
    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """lm-eval's rendering, remembering where the last user turn's content starts (the question)."""
        text = super().apply_chat_template(chat_history, add_generation_prompt)
        users = [i for i, m in enumerate(chat_history) if m.get("role") == "user"]
        if users and isinstance(chat_history[users[-1]].get("content"), str):
            i, content = users[-1], chat_history[users[-1]]["content"]
            probe = [dict(m) for m in chat_history]
            probe[i]["content"] = _SENTINEL
            marked = super().apply_chat_template(probe, add_generation_prompt)
            at = marked.find(_SENTINEL)
            if at >= 0 and text[:at] == marked[:at] and text.startswith(content, at):
                self._question_at[text] = at
        return text

    def _prefilled(self, context: str, context_ids: list[int], kept: int) -> int:
        """How many of the `kept` last tokens of `context_ids` (the context, left-truncated to `kept`) are prefilled
        with eviction: all, or (query-agnostic) those before the question. Raises for an unmarked question."""
        if self.opts.protocol != "query-agnostic":
            return kept
        marker = self.opts.question_marker
        if marker == RULER_MARKER:  # RULER's templates, whatever the task family (`tasks.ruler.find_question`)
            at = find_question(context)
        else:
            at = self._question_at.get(context) if marker is None else context.rfind(marker)
        if at is None or at < 0:
            where = "no chat-template mark" if marker is None else f"no question_marker {marker!r}"
            if marker is None and find_question(context) >= 0:  # RULER's own template (lm-eval's `ruler` tasks)
                raise ValueError(f"protocol=query-agnostic appends the question after compression, and this request "
                                 f"is a RULER prompt (lm-eval's ruler tasks): give question_marker={RULER_MARKER}, "
                                 "which finds its question with RULER's own templates (or protocol=query-aware: the "
                                 "whole context prefilled with eviction)")
            raise ValueError(f"{NO_MARK}; this request's context has {where}: {context[:80]!r}...")
        prefix = self.tok_encode(context[:at])
        if list(context_ids[:len(prefix)]) != prefix:
            raise ValueError(f"the chat template's question does not start at a token boundary of the context "
                             f"({context[max(0, at - 20):at + 20]!r}); use protocol=query-aware")
        return max(1, len(prefix) - (len(context_ids) - kept))  # truncation takes tokens from the prefix first

    @staticmethod
    def _split(ctx: list[int], k: int) -> tuple[list[int], list[int]]:
        """`(prefilled, fed)`: the `k` tokens prefilled with eviction and the rest of `ctx`, fed over the compressed
        cache. When nothing would be fed (query-aware, streaming, or a question at the very end) the last prefilled
        token is held out and fed instead: a prefill attends exactly and evicts only afterwards, so its own last
        logits never see the budget, and the first scored or generated token must come from a call over the kept
        cache (kvpress's pipeline likewise feeds the question over the compressed context)."""
        if k == len(ctx) and k > 1:
            k -= 1
        return ctx[:k], ctx[k:]

    # --- loglikelihood --------------------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """`(logprob, is_greedy)` per `((context, continuation), context_ids, continuation_ids)` request."""
        groups: dict[tuple, list] = {}  # prefilled tokens -> [(request index, question ids, continuation ids)]
        for i, ((context, _), ctx_ids, cont_ids) in enumerate(requests):
            if not cont_ids or len(cont_ids) > self.max_length:
                raise ValueError(f"continuation of {len(cont_ids)} tokens: must be 1..max_length ({self.max_length})")
            full = (list(ctx_ids) + list(cont_ids))[-(self.max_length + 1):]  # lm-eval's left truncation
            ctx = full[:len(full) - len(cont_ids)]
            k = self._prefilled(context, ctx_ids, len(ctx)) if context is not None else len(ctx)
            prefilled, fed = self._split(ctx, k)
            groups.setdefault(tuple(prefilled), []).append((i, fed, list(cont_ids)))
        budget = {p: self.engine.budget_for(len(p)) for p in groups}
        order = sorted(groups, key=lambda p: (budget[p], -len(p), p))
        evict = self.opts.protocol == "streaming"
        res: list = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="fxbudget loglikelihood")
        for batch in _batches(order, budget.get, override_bs or self.batch_size):
            members = [groups[p] for p in batch]
            frozen = 0 if evict else max(len(q) + len(c) - 1 for m in members for _, q, c in m)
            with self.engine.installed(budget[batch[0]], self.opts.chunk_size) as forward:
                cache, mask, last = self.engine.prefill(forward, [list(p) for p in batch], frozen)
                for r in range(max(len(m) for m in members)):  # round r: each context's r-th continuation
                    picks = [m[min(r, len(m) - 1)] for m in members]
                    got = self.engine.score(cache, mask, last, [q + c[:-1] for _, q, c in picks],
                                            [c for _, _, c in picks], evict=evict)
                    for m, (i, _, _), answer in zip(members, picks, got):
                        if r < len(m):
                            res[i] = answer
                            if requests[i][0] is not None and requests[i][0][0] is not None:
                                self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                            bar.update(1)
        bar.close()
        return res

    # --- loglikelihood_rolling ------------------------------------------------------------------------------------
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text in lm-eval's disjoint windows of `max_length` tokens (as `hf`), each window streamed through
        the budget in calls of `Options.rolling_call` tokens with eviction on every call; summed per text."""
        windows = []  # (request index, input ids, target ids)
        for idx, (string,) in enumerate(req.args for req in requests):
            for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((idx, (ctx + cont)[:-1], cont))
        budget = [self.engine.budget_for(len(w[1])) for w in windows]
        order = sorted(range(len(windows)), key=lambda j: (budget[j], -len(windows[j][1])))
        totals = [0.0] * len(requests)
        bar = tqdm(total=len(windows), disable=disable_tqdm or self.rank != 0, desc="fxbudget rolling windows")
        for batch in _batches(order, budget.__getitem__, self.batch_size):
            with self.engine.installed(budget[batch[0]], self.opts.rolling_call) as forward:
                sums = self.engine.rolling(forward, [windows[j][1] for j in batch], [windows[j][2] for j in batch])
            for j, s in zip(batch, sums):
                totals[windows[j][0]] += s
            bar.update(len(batch))
        bar.close()
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # --- generate_until -------------------------------------------------------------------------------------------
    def _eos_ids(self) -> set[int]:
        ids = getattr(self.model.generation_config, "eos_token_id", None)
        return set(ids if isinstance(ids, list) else [] if ids is None else [ids])

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, stopped as `hf` stops them (stop strings, the eos token, `max_gen_toks`)."""
        eos_text = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        plan = []  # (request index, prefilled ids, forced question ids, stop strings, max_gen_toks)
        for i, (context, gen_kwargs) in enumerate(req.args for req in requests):
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            if kwargs.get("do_sample"):
                raise ValueError("fxbudget decodes greedily; this task asks for sampling (do_sample=True)")
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_new = kwargs.pop("max_gen_toks")
            if self.max_length - max_new < 1:
                raise ValueError(f"max_gen_toks {max_new} leaves no room for a context in max_length "
                                 f"{self.max_length}")
            ids = self.tok_batch_encode([context], truncation=self.truncation)[0][0].tolist()
            ctx = ids[-(self.max_length - max_new):]  # lm-eval's left truncation
            prefilled, fed = self._split(ctx, self._prefilled(context, ids, len(ctx)))
            plan.append((i, prefilled, fed, until, max_new))
        budget = [self.engine.budget_for(len(p[1])) for p in plan]
        order = sorted(range(len(plan)), key=lambda j: (budget[j], plan[j][4], -len(plan[j][1])))
        evict, eos = self.opts.protocol == "streaming", self._eos_ids()
        res: list = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="fxbudget generate_until")
        for batch in _batches(order, lambda j: (budget[j], plan[j][4]), self.batch_size):
            rows = [plan[j] for j in batch]
            max_new = rows[0][4]

            def stop(r: int, tokens: list[int], rows=rows) -> bool:  # hf's check: the decoded new tokens
                text = self.tok_decode(tokens, skip_special_tokens=False)
                return any(s and s in text for s in rows[r][3])

            with self.engine.installed(budget[batch[0]], self.opts.chunk_size) as forward:
                frozen = 0 if evict else max(len(r[2]) for r in rows) + max_new
                cache, mask, last = self.engine.prefill(forward, [r[1] for r in rows], frozen)
                outs = self.engine.generate(cache, mask, last, [r[2] for r in rows], max_new, eos, stop, evict=evict)
            for (i, _, _, until, _), tokens in zip(rows, outs):
                res[i] = self._finish(tokens, until)
                self.cache_hook.add_partial("generate_until", requests[i].args, res[i])
            bar.update(len(batch))
        bar.close()
        return res

    def _finish(self, tokens: list[int], until: list[str]) -> str:
        """`hf`'s post-processing: an integer think-end token cuts before, then decode and cut at stop strings."""
        if isinstance(self.think_end_token, int) and self.think_end_token in tokens:
            tokens = tokens[len(tokens) - tokens[::-1].index(self.think_end_token):]
        text = self.tok_decode(tokens)
        if isinstance(self.think_end_token, int):
            text = text.lstrip()
        return postprocess_generated_text(text, until, self.think_end_token
                                          if isinstance(self.think_end_token, str) else None)

    # --- results --------------------------------------------------------------------------------------------------
    def conditions(self) -> dict:
        """The comparison's fixed conditions, recorded under `fxbudget` in lm-eval's results config."""
        o, model = self.opts, self.model
        p = next(model.parameters())
        n_full = list(getattr(model.config, "layer_types", None) or ["full_attention"]).count("full_attention")
        kind = budget_kind(o.budget)
        tokens = self.engine.byte_tokens[o.budget] if kind == "bytes" else o.budget if kind == "tokens" else 1024
        schedule = o.rule.layer_budgets(tokens, max(n_full, 1))
        if self._fingerprint is None:  # once, on the unmodified model (every forward is restored by now)
            try:  # compare's value on its probe, read from the on-disk cache when traced before
                self._fingerprint, self._fingerprint_cached = cached_kernel_fingerprint(
                    model, o.rule, budget=tokens, compute=kernel_fingerprint, slot_dtype=o.slot_dtype,
                    signals=run_signals([o.rule]))  # the kernel `fx_compile` runs: what the rule reads
            except Exception as e:  # noqa: BLE001  (called after the evaluation: record why, do not lose its results)
                self._fingerprint = f"unavailable: {type(e).__name__}: {e}"
                warnings.warn(f"fxbudget: kernel fingerprint {self._fingerprint}", stacklevel=2)
        return {
            "model": self.pretrained, "rule": o.rule.name, "rule_params": o.rule.params(),
            "budget": o.budget, "budget_kind": BUDGET_WORDS[kind],
            "budget_bytes": byte_size(o.budget), "budget_tokens": tokens if kind != "percent" else None,
            "slot_dtype": o.slot_dtype,
            "budgets_used": sorted(self.engine.budgets_used), "protocol": o.protocol,
            "allocation": "uniform" if schedule is None else f"per-layer ({o.rule.name} schedule)",
            "observation_window": o.window, "chunk_size": o.chunk_size, "rolling_call_tokens": o.rolling_call,
            "backend": o.backend or "none", "block": o.block, "kernel_fingerprint": self._fingerprint,
            "kernel_fingerprint_cached": self._fingerprint_cached, "signals": signals_label(run_signals([o.rule])),
            "device": str(p.device), "dtype": str(p.dtype).removeprefix("torch."),
            "versions": {"fxbudget": _version("flexbudget"), "lm_eval": _version("lm_eval"),
                         "torch": torch.__version__, "transformers": transformers.__version__,
                         "python": platform.python_version()},
        }

    def get_model_info(self) -> dict:
        """`hf`'s model info (without its Hub look-up) plus `fxbudget`: `conditions()`."""
        p = next(self.model.parameters())
        info = {"model_num_parameters": sum(x.numel() for x in self.model.parameters()),
                "model_dtype": str(p.dtype).removeprefix("torch."), "model_revision": self.revision,
                "model_sha": ""}
        info["fxbudget"] = json.loads(json.dumps(self.conditions(), default=str))
        return info


if "fxbudget" not in model_registry:  # lm-eval >= the entry-point release registers a placeholder first
    model_registry.register("fxbudget")(FxBudgetLM)
