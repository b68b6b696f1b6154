"""Progress lines for a budgeted model's long calls, on stderr: on a CPU a prefill of a thousand tokens is silent
for tens of seconds otherwise, and a long generation for minutes (issue 55). `fxbudget.compile(progress=False)`
silences them; the comparison harness has its own progress and passes False."""

from __future__ import annotations

import sys
import time

PREFILL_TOKENS = 512  # a call of this many tokens or more says so before it starts
EVERY_S = 10.0  # decoding: a line at most this often, and only once this long has passed silent


class CallProgress:
    """Says when a long call starts and how long it took, and how decoding goes, every `EVERY_S` seconds."""

    def __init__(self, enabled: bool, what: str):
        self.enabled, self.what = enabled, what  # `what`: the rule and budget, as the lines name them
        self._start: float | None = None  # since when decoding runs (the last long call's end)
        self._last = 0.0  # the last line's time
        self._steps = 0

    def before(self, batch: int, n: int) -> None:
        if not self.enabled:
            return
        if n >= PREFILL_TOKENS:
            rows = f" x {batch} rows" if batch > 1 else ""
            _say(f"prefill: {n} tokens{rows} through {self.what} ...")
            self._start = time.perf_counter()
        elif self._start is None:  # decoding with no long call before
            self._start = self._last = time.perf_counter()

    def after(self, n: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if n >= PREFILL_TOKENS:
            _say(f"prefill done in {now - self._start:.1f} s")
            self._start, self._last, self._steps = now, now, 0
            return
        self._steps += 1
        if now - self._last >= EVERY_S:
            _say(f"decoding: {self._steps} steps in {now - self._start:.0f} s "
                 f"({self._steps / max(now - self._start, 1e-9):.1f} steps/s)")
            self._last = now


def _say(text: str) -> None:
    print(f"[fxbudget] {text}", file=sys.stderr, flush=True)
