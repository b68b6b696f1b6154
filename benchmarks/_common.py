"""Shared benchmark helpers: environment header, interleaved timing, markdown output.

Generic on purpose (no fxbudget imports at module level), so every benchmark script can use it:

    from _common import setup_threads, env_info, header_lines, interleaved, median_us, md_table, write_md

`benchmarks/` is not a package: scripts run as `python benchmarks/<name>.py`, so this module is importable as
`_common` from them (their own directory is on `sys.path`). Other callers can `sys.path.insert(0, "benchmarks")`.

Stable API (do not rename): setup_threads, tune_malloc, bench_model, emit, env_info, header_lines, command_line, load_str, sync, timed,
interleaved, median, median_us, quartiles, paired_ratio, verdict, fmt_ratio, analysis_link, md_table, write_md, ROOT.

Generated reports hold only what their script computed; analysis lives beside them in a hand-written
`<name>.analysis.md` (`analysis_link`), which quotes only numbers from the generated file.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # scripts run from a checkout import fxbudget from it
    sys.path.insert(0, str(ROOT))


def setup_threads(n: int = 1) -> int:
    """Pin torch to `n` intra-op threads (and OMP_NUM_THREADS, if the caller did not set it); returns `n`.

    Set OMP_NUM_THREADS on the command line too: OpenMP reads it when torch is first imported.
    """
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    import torch

    torch.set_num_threads(n)
    return n


def tune_malloc() -> bool:
    """Keep large temporaries on glibc's heap instead of fresh mmap/munmap pages per call (`fxbudget.harness.malloc`).

    A prefill chunk allocates and frees tens of MB of scores per call; by default glibc serves each from a new mmap
    and returns it on free, so every call pays page faults again, by an amount that depends on allocation order, not
    on the work (it made one rule 1.5x slower than an identical one in fairness_spread). Returns whether it applied.
    """
    from fxbudget.harness.malloc import tune_malloc as tune

    return tune()


def _malloc_setting() -> str:
    try:
        from fxbudget.harness.malloc import malloc_setting
    except ImportError:  # a peer venv without fxbudget never tunes malloc
        return "default"
    return malloc_setting()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_str() -> str:
    """`os.getloadavg()` as text (1, 5, 15 min), or 'n/a'."""
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def env_info(device: str = "cpu") -> dict:
    """Machine, thread and version facts for a results header."""
    import torch

    # The vector ISA torch runs with (AVX2, AVX512, ...): machines of one model name differ in it, and so do seconds.
    isa = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", lambda: "")()
    info = {
        "cpu": f"{_cpu_model()} ({isa})" if isa else _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "load": load_str(),
        "device": device,
        "malloc": _malloc_setting(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = "n/a"
    if str(device).startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


def command_line(prefix: str = "OMP_NUM_THREADS=1 ") -> str:
    """The command that is running, as one shell line relative to the repository root."""
    argv = list(sys.argv)
    try:
        argv[0] = str(Path(argv[0]).resolve().relative_to(ROOT))
    except ValueError:
        pass
    return prefix + "python " + " ".join(shlex.quote(a) for a in argv)


def header_lines(title: str, info: dict | None = None, command: str | None = None,
                 load_after: str | None = None) -> list[str]:
    """Markdown lines: title, then machine / threads / versions / date / load / command."""
    info = info or env_info()
    dev = info.get("device", "cpu")
    gpu = f"; GPU {info['gpu']} (CUDA {info['cuda']})" if "gpu" in info else ""
    load = f"load average (1/5/15 min) {info['load']} at start"
    if load_after:
        load += f", {load_after} at end"
    return [
        f"# {title}", "",
        f"- Machine: {info['cpu']}, {info['cores']} cores{gpu}; device `{dev}`",
        f"- torch threads {info['torch_threads']}, OMP_NUM_THREADS={info['omp_num_threads']}; malloc: "
        f"{info.get('malloc', 'default')}",
        f"- Python {info['python']}, torch {info['torch']}, transformers {info['transformers']}",
        f"- Date {info['date']}; {load}",
        f"- Command: `{command or command_line()}`", "",
    ]


def sync(device: str = "cpu") -> None:
    """Wait for the device (CUDA) so wall-clock timings are honest; no-op on CPU."""
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str = "cpu") -> float:
    """Seconds one call of `fn` takes (device synchronized before and after)."""
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def interleaved(fns: dict[str, Callable[[], object]], reps: int, *, warmup: int = 3, device: str = "cpu",
                inner: int = 1) -> dict[str, list[float]]:
    """Time every callable `reps` times, round-robin (a, b, c, a, b, c, ...), so all see the same machine state.

    `warmup` rounds are run first and dropped. With `inner > 1` each sample is the mean of `inner` back-to-back
    calls (for calls too short to time alone). The starting callable rotates every round, so none always runs first.
    Returns seconds per call for each name.
    """
    names = list(fns)
    out: dict[str, list[float]] = {k: [] for k in names}
    for r in range(warmup + reps):
        rot = names[r % len(names):] + names[:r % len(names)]
        for k in rot:
            f = fns[k]
            sync(device)
            t = time.perf_counter()
            for _ in range(inner):
                f()
            sync(device)
            dt = (time.perf_counter() - t) / inner
            if r >= warmup:
                out[k].append(dt)
    return out


def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))


def median_us(xs: Iterable[float]) -> float:
    """Median of seconds, in microseconds."""
    return 1e6 * statistics.median(list(xs))


def quartiles(xs: Iterable[float]) -> tuple[float, float, float]:
    """(25th percentile, median, 75th percentile) of `xs` (the interquartile range is the first to the last)."""
    xs = sorted(xs)
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float]:
    """Quartiles of the per-round ratios a[i] / b[i] of two interleaved series (`interleaved` keeps rounds aligned):
    the ratio's own spread, machine drift between rounds cancelling out."""
    return quartiles([x / y for x, y in zip(a, b)])


def verdict(ratio: tuple[float, float, float], goal: float) -> str:
    """'within noise' when 1.0 lies inside the ratio's interquartile range; else whether the median meets `goal`
    (a ratio that should stay <= goal)."""
    lo, mid, hi = ratio
    if lo <= 1.0 <= hi:
        return "within noise"
    return "met" if mid <= goal else "NOT met"


def fmt_ratio(ratio: tuple[float, float, float]) -> str:
    """'1.023 [0.998-1.051]': median and interquartile range."""
    return f"{ratio[1]:.3f} [{ratio[0]:.3f}-{ratio[2]:.3f}]"


def analysis_link(name: str) -> list[str]:
    """Markdown lines pointing to the hand-written analysis beside a generated report (never written by a script)."""
    return ["", f"Analysis (hand-written, quotes this file's numbers): [{name}.analysis.md]({name}.analysis.md)."]


def md_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """A markdown table; floats are printed with 1 decimal unless pre-formatted as strings."""
    def cell(x):
        return f"{x:.1f}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return lines


def emit(lines: Sequence[str], out: str | None, quick: bool, name: str) -> None:
    """Write a script's report to `out`, or to benchmarks/results/<name>.md unless it is a `--quick` smoke run (then
    only print it)."""
    out = out or (None if quick else str(ROOT / "benchmarks" / "results" / f"{name}.md"))
    if out:
        write_md(out, lines)
    else:
        print("\n".join(lines))


def write_md(path: str | Path, lines: Sequence[str]) -> str:
    """Write `lines` as a markdown file (parents created), print it, and return the text."""
    text = "\n".join(lines).rstrip() + "\n"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)
    return text


# ---------------------------------------------------------------------------------------------------------------
# Layer-level fxbudget cases (imports fxbudget lazily, so the generic helpers above stay importable without it).
# ---------------------------------------------------------------------------------------------------------------

QWEN_LAYER = {"heads": 14, "kv_heads": 2, "head_dim": 64, "rope_theta": 1e6}  # Qwen2.5-0.5B attention shapes


def fresh_function(fn):
    """A copy of `fn` with its own code object: Dynamo caches compiled variants per code object, so benchmark cases
    that compile the same function for other shapes or rules would otherwise share one cache (recompile limit, and
    guard checks that walk every earlier variant on each call)."""
    import types

    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _layer_module():
    import torch
    import torch.nn.functional as F

    class BudgetAttentionLayer(torch.nn.Module):
        """Attention only: the call's K/V go through the BudgetCache, SDPA attends (the pass rewrites it)."""

        def forward(self, q, k, v, past_key_values):
            keys, values = past_key_values.update(k, v, 0)
            return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)

    BudgetAttentionLayer.forward = fresh_function(BudgetAttentionLayer.forward)
    return BudgetAttentionLayer()


class LayerCase:
    """One attention layer with a full BudgetCache (every call evicts `n`), random inputs, fixed shapes.

    `compiled()` compiles the layer through fxbudget's backend (the SDPA pass + Inductor) once and returns a
    zero-argument step; `eager()` returns a step running `fxbudget.kernel.budget_attention` directly (no torch.compile);
    `static_sdpa()` returns the ideal that never evicts: a compiled index_copy_ of the call's K/V into a static cache of
    `budget` tokens, then SDPA over it (causal among the new tokens). Compile times are kept in `compile_s`.
    """

    def __init__(self, rule, budget: int, n: int, *, device: str = "cpu", dtype=None, heads: int = 14,
                 kv_heads: int = 2, head_dim: int = 64, rope_theta: float = 1e6, seed: int = 0,
                 cudagraphs: bool = False):
        from types import SimpleNamespace

        import torch

        import fxbudget
        from fxbudget.rules import get

        self.rule = get(rule)
        self.budget, self.n, self.device = budget, n, device
        self.dtype = dtype or torch.float32
        self.cudagraphs = cudagraphs
        self.compile_s: dict[str, float] = {}
        cfg = SimpleNamespace(num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads,
                              head_dim=head_dim, hidden_size=heads * head_dim,
                              rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
        self.cache = fxbudget.BudgetCache(cfg, budget, dtype=self.dtype, device=device)
        g = torch.Generator().manual_seed(seed)

        def rnd(*shape):
            return torch.randn(*shape, generator=g).to(device=device, dtype=self.dtype)

        self.q, self.k, self.v = rnd(1, heads, n, head_dim), rnd(1, kv_heads, n, head_dim), rnd(1, kv_heads, n, head_dim)
        L = self.layer = self.cache.layers[0]
        with torch.no_grad():
            L.keys.copy_(rnd(*L.keys.shape))
            L.values.copy_(rnd(*L.values.shape))
            L.pos.copy_(torch.arange(budget, device=device).expand_as(L.pos))  # a full cache: every call evicts
            L.norms[..., :2].copy_(torch.stack([L.keys.float().norm(dim=-1), L.values.float().norm(dim=-1)], dim=-1))
            L.seen.fill_(budget)
        # A random output projection (hidden = heads x head_dim), so the kernel pays for `wov_norm` as on a model.
        self.cache.set_output_projections([rnd(heads * head_dim, heads * head_dim)])
        self.cache._held = [budget]
        # Static cache for the no-eviction ideal: same token count, the call writes its n rows at the end.
        self.K, self.V = rnd(1, kv_heads, budget, head_dim), rnd(1, kv_heads, budget, head_dim)
        self.idx = torch.arange(budget - n, budget, device=device)
        qpos = torch.arange(budget - n, budget, device=device).view(n, 1)
        self.mask = torch.arange(budget, device=device).view(1, budget) <= qpos  # [n, budget], causal for new rows
        if cudagraphs:  # CUDA graphs may only mutate inputs with a static address
            for t in (L.keys, L.values, L.pos, L.state, L.norms, L.totals, L.seen, self.K, self.V):
                torch._dynamo.mark_static_address(t)

    def _first(self, name: str, fn):
        import torch

        with torch.no_grad():
            self.compile_s[name] = timed(fn, self.device)

    def compiled(self, inner: str = "inductor"):
        """Compiled step (the first call, which compiles, happens here and is timed into compile_s['budget'])."""
        import torch

        from fxbudget.compiler.backend import make_backend

        extra = {"cudagraphs": True} if self.cudagraphs else {}
        backend = make_backend(self.rule, inner=inner, **extra)
        layer = torch.compile(_layer_module(), backend=backend, fullgraph=True, dynamic=False)
        q, k, v, cache = self.q, self.k, self.v, self.cache

        def step():
            with torch.no_grad():
                return layer(q, k, v, cache)

        self._first("budget", step)
        return step

    def eager(self):
        """Eager step: the kernel called directly on the layer's tensors (same semantics as the compiled step)."""
        import torch

        from fxbudget.compiler.backend import kernel_window
        from fxbudget.kernel import budget_attention

        L, rule, window, n = self.layer, self.rule, kernel_window(self.rule), self.n
        q, k, v = self.q, self.k, self.v
        ar = torch.arange(n, device=self.device)

        def step():
            with torch.no_grad():
                new_pos = ar + L.seen
                L.seen.add_(n)
                return budget_attention(q, L.keys, L.values, L.pos, L.state, L.norms, L.totals, k, v, new_pos,
                                        L.inv_freq, L.wo, rule=rule, budget=L.budget, window=window)

        step()
        return step

    def static_sdpa(self, tokens: int | None = None):
        """Compiled plain SDPA over a static cache of `tokens` (default `budget`) tokens: index_copy_ of the call's
        K/V into its last `n` rows, then SDPA (causal among the new rows; no mask in decode)."""
        import torch
        import torch.nn.functional as F

        decode = self.n == 1
        if tokens is not None and tokens != self.budget:
            kv, d, n, dev = self.K.shape[1], self.K.shape[-1], self.n, self.device
            K = torch.randn(1, kv, tokens, d).to(device=dev, dtype=self.dtype)
            V = torch.randn(1, kv, tokens, d).to(device=dev, dtype=self.dtype)
            idx = torch.arange(tokens - n, tokens, device=dev)
            mask = torch.arange(tokens, device=dev).view(1, tokens) <= idx.view(n, 1)
            if self.cudagraphs:
                for t in (K, V):
                    torch._dynamo.mark_static_address(t)
        else:
            tokens, K, V, idx, mask = self.budget, self.K, self.V, self.idx, self.mask

        def fn(q, k, v, K, V, idx, mask):
            K.index_copy_(2, idx, k)
            V.index_copy_(2, idx, v)
            if decode:
                return F.scaled_dot_product_attention(q, K, V, enable_gqa=True)
            return F.scaled_dot_product_attention(q, K, V, attn_mask=mask, enable_gqa=True)

        opts = {"mode": "reduce-overhead"} if self.cudagraphs else {}
        c = torch.compile(fresh_function(fn), fullgraph=True, dynamic=False, **opts)
        args = (self.q, self.k, self.v, K, V, idx, mask)

        def step():
            with torch.no_grad():
                return c(*args)

        self._first(f"static_{tokens}", step)
        return step


def bench_model(quick: bool):
    """A benchmark's model: the embedded one (24 layers), or with `quick` a tiny random Qwen2 (4 layers, seeded) for
    smoke runs."""
    if not quick:
        from fxbudget.models import load_default

        return load_default(progress=False)[0]
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        attn_implementation="sdpa")).eval()
