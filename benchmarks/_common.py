"""Shared benchmark helpers: environment header, interleaved timing, markdown output.

Generic on purpose (no fxbudget imports at module level), so every benchmark script can use it:

    from _common import setup_threads, env_info, header_lines, interleaved, median_us, md_table, write_md

`benchmarks/` is not a package: scripts run as `python benchmarks/<name>.py`, so this module is importable as
`_common` from them (their own directory is on `sys.path`). Other callers can `sys.path.insert(0, "benchmarks")`.

Stable API (do not rename): setup_threads, env_info, header_lines, command_line, load_str, sync, timed,
interleaved, median, median_us, md_table, write_md, ROOT.
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


def setup_threads(n: int = 1) -> int:
    """Pin torch to `n` intra-op threads (and OMP_NUM_THREADS, if the caller did not set it); returns `n`.

    Set OMP_NUM_THREADS on the command line too: OpenMP reads it when torch is first imported.
    """
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    import torch

    torch.set_num_threads(n)
    return n


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

    info = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "load": load_str(),
        "device": device,
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
        f"- torch threads {info['torch_threads']}, OMP_NUM_THREADS={info['omp_num_threads']}",
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


def md_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """A markdown table; floats are printed with 1 decimal unless pre-formatted as strings."""
    def cell(x):
        return f"{x:.1f}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return lines


def write_md(path: str | Path, lines: Sequence[str]) -> str:
    """Write `lines` as a markdown file (parents created), print it, and return the text."""
    text = "\n".join(lines).rstrip() + "\n"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)
    return text
