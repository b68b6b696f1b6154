"""The calibration set (each sample's shared prefill, recorded once for the whole study) and the search objective."""

from __future__ import annotations

from dataclasses import dataclass
from statistics import mean

import torch
from torch import Tensor, nn

from ...rules import Rule
from ..branch import SharedPrefill, shared_prefill
from ..likelihood import rule_answer_logprobs
from ..tasks import answer_ids, chat_ids, make_samples
from .config import SearchConfig


@dataclass
class CalibrationSample:
    """One calibration sample: its recorded shared prefill and the question and gold answer ids."""

    task: str
    length: int
    seed: int
    prefill: SharedPrefill
    question: Tensor
    answer: Tensor


def calibration_set(model: nn.Module, tokenizer, config: SearchConfig, *, progress: bool = True
                    ) -> list[CalibrationSample]:
    """Generate the calibration samples and run each one's shared prefill once.

    Args:
        model: the unmodified model.
        tokenizer: its tokenizer.
        config: tasks, lengths, samples per task and length, seed and protocol (what is prefilled).
        progress: a progress bar over the prefills.
    Returns:
        The samples in task, length, index order.
    """
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    todo = [(t, n) for t in config.tasks for n in config.lengths]
    out = []
    with tqdm(total=len(todo) * config.samples, desc="calibration prefills", unit="sample",
              disable=not progress, dynamic_ncols=True) as bar:
        for task, length in todo:
            for sample in make_samples(task, tokenizer, length, config.samples, seed=config.seed):
                ctx, question = (x.to(device) for x in chat_ids(tokenizer, sample))
                ids = torch.cat([ctx, question], dim=1) if config.protocol == "query-aware" else ctx
                with torch.no_grad():
                    prefill = shared_prefill(model, ids)
                out.append(CalibrationSample(task, length, sample.seed, prefill, question,
                                             answer_ids(tokenizer, sample).to(device)))
                bar.update(1)
    return out


def prefill_bytes(calibration: list[CalibrationSample]) -> int:
    """Bytes held by the recorded prefills (each storage counted once)."""
    seen, total = set(), 0

    def add(x):
        nonlocal total
        if isinstance(x, Tensor):
            s = x.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
        elif isinstance(x, (list, tuple)):
            for y in x:
                add(y)
        elif isinstance(x, dict):
            for y in x.values():
                add(y)
        elif hasattr(x, "tensors"):
            add(x.tensors)

    for c in calibration:
        add(c.prefill.calls), add(c.prefill.signals)
    return total


def objective(model: nn.Module, calibration: list[CalibrationSample], rule: Rule, budget: int,
              protocol: str) -> tuple[float, list[float]]:
    """The search objective of `rule`: the mean over calibration samples of the gold answer's mean log-probability
    per token, each scored from the sample's shared prefill (no prefill).

    Returns:
        `(objective, per-sample values)`.
    """
    per = [float(rule_answer_logprobs(model, c.prefill, rule, budget, c.question, c.answer, protocol=protocol).mean())
           for c in calibration]
    return float(mean(per)), per
