"""What a search fits on and how it is judged (`SearchConfig`); no torch import."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ...checks import check_int
from ..grid import REFERENCE, Grid



@dataclass
class SearchConfig:
    """What a search fits on and how it is judged. The fields up to `protocol`, and `dtype`, define the study (a
    resumed study must match them); the others may change between runs. `device` and `dtype` are the model's
    ("cuda:0", "bfloat16"); None: taken from the model when the search starts."""

    model: str
    tasks: list[str]
    lengths: list[int]
    samples: int
    seed: int
    budget: int
    protocol: str = "query-agnostic"
    trials: int = 50
    baselines: list[str] = field(default_factory=lambda: ["streamingllm", "h2o", "snapkv", "tova", "knorm"])
    holdout_samples: int = 8
    holdout_seed: int | None = None  # None: seed + 1000
    name: str | None = None  # None: searched_b<budget>
    max_new_tokens: int | None = None
    device: str | None = None
    dtype: str | None = None

    STUDY_FIELDS = ("model", "tasks", "lengths", "samples", "seed", "budget", "protocol", "dtype")

    def __post_init__(self):
        if self.holdout_seed is None:
            self.holdout_seed = self.seed + 1000
        if self.name is None:
            self.name = f"searched_b{self.budget}"

    def validate(self) -> None:
        """Check the settings without a model.

        Raises:
            ValueError: naming the bad setting.
        """
        from ...rules import _LOADED, available

        if self.holdout_seed == self.seed:
            raise ValueError("the held-out seed must differ from the calibration seed (the samples would be the same)")
        if not re.fullmatch(r"[a-z][a-z0-9_]*", self.name):
            raise ValueError(f"rule name must be lower-case letters, digits and '_', got {self.name!r}")
        for name in ("samples", "budget", "trials", "holdout_samples"):
            check_int(name, getattr(self, name))
        if self.name in available() and self.name not in {n for _, names in _LOADED.values() for n in names}:
            raise ValueError(f"rule name {self.name!r} is taken by a registered rule; choose another --name")
        if REFERENCE in self.baselines or self.name in self.baselines:
            raise ValueError(f"baselines are built-in rules to beat; {REFERENCE!r} (the reference row) and the "
                             "searched rule are added by the search")
        # The held-out grid's checks (tasks, lengths, protocol, the baselines), `weighted` standing for the searched
        # rule: every rule of the comparison must use its observation window, the kernel default.
        grid = self.holdout_grid()
        grid.rules[-1] = "weighted"
        grid.validate()

    def study_key(self) -> dict:
        """What a resumed study must have been made with (a study stored before `dtype` was keyed ran float32)."""
        from ...kernel import DEFAULT_WINDOW

        return {k: getattr(self, k) for k in self.STUDY_FIELDS} | {"family": "weighted", "window": DEFAULT_WINDOW}

    def holdout_grid(self, params: dict | None = None) -> Grid:
        """The held-out comparison: the reference, the baselines and the searched rule on the held-out seed."""
        return Grid(tasks=list(self.tasks), lengths=list(self.lengths), rules=[REFERENCE, *self.baselines, self.name],
                    budgets=[self.budget], samples=self.holdout_samples, seed=self.holdout_seed,
                    protocols=[self.protocol], rule_params={self.name: params} if params else {})
