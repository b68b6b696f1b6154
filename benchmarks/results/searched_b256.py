"""`searched_b256`: a `weighted` rule fitted by `fxbudget search` (family: fxbudget/rules/weighted.py)."""

from dataclasses import dataclass

from fxbudget.rules import register
from fxbudget.rules.weighted import Weighted


@register("searched_b256")
@dataclass
class SearchedB256(Weighted):
    """score = -0.3617 * z(log attn) +0.1843 * z(log window_attn) +0.4761 * z(log last_attn) +0.2707 * z(log
    acc_attn) -0.7902 * z(key_norm) -0.1286 * z(value_norm) +0.1989 * z(-log age), max-pooled over 7 positions;
    always kept: the first 9 and the last 121 positions.

    Found 2026-11-30 06:35 UTC as trial #13 of 20 (Optuna TPE, seed 0) on Qwen2.5-Coder-0.5B-Instruct, budget
    256, protocol query-agnostic, observation window 32: the best mean gold-answer log-probability per token,
    -0.473310 nats, over 2 calibration sample(s) per task and length (passkey, niah_multikey at 2000 tokens;
    generator seed 0). Training-free: no gradient, no weight change. Judge it on held-out samples (the search's
    held-out comparison), not on this number. Command:

        fxbudget search --tasks passkey,niah_multikey --lengths 2000 --protocol query-agnostic --budget 256
            --samples 2 --trials 20 --holdout-samples 4 --threads 1 --out runs/rule_search --summary
            benchmarks/results/rule_search.md --note 'Written by benchmarks/rule_search.py (the command below is
            what it ran)'
    """

    w_attn: float = -0.36166652376692604
    w_window_attn: float = 0.18432439416179291
    w_last_attn: float = 0.4761425787803103
    w_acc_attn: float = 0.27074202356575916
    w_key_norm: float = -0.7901741416647424
    w_value_norm: float = -0.12856125774326865
    w_recency: float = 0.19886161760578797
    n_sink: int = 9
    n_recent: int = 121
    pool: int = 7
