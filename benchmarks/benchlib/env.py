"""The header of every result file: machine, threads, allocator, versions, load and command."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
RESULTS = ROOT / "benchmarks" / "results"  # the suites' result files
STUDY_RESULTS = ROOT / "benchmarks" / "studies" / "results"  # the one-off studies'
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
