"""Where and how wide a `--ray` run goes (`RayOptions`); no Ray or torch import."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RayOptions:
    """Where and how wide a distributed run goes.

    Args:
        address: "auto" (the running cluster: `ray start` on this machine, or `RAY_ADDRESS`), "local" (a new Ray on
            this machine only) or a cluster address ("ray://HOST:10001", "HOST:6379"), as `ray.init` takes it;
            unused when this process already called `ray.init()`.
        workers: actors to start (None: as many as the cluster has room for now); never more than the units to run.
        cpus_per_worker: Ray CPUs each worker holds; also its torch threads unless `threads` is given.
        gpus_per_worker: Ray GPUs each worker holds (0: the model on CPU; 1 or a fraction: on one GPU; more: spread
            over them with `device_map="auto"`).
        threads: torch threads per worker (None: `cpus_per_worker`, at least 1).
        max_attempts: how many times one unit may lose its worker before the run stops.
        max_restarts: how many times Ray restarts a worker that died.
    """

    address: str = "auto"
    workers: int | None = None
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    threads: int | None = None
    max_attempts: int = 3
    max_restarts: int = 3

    def validate(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.cpus_per_worker < 0 or self.gpus_per_worker < 0:
            raise ValueError("--cpus-per-worker and --gpus-per-worker must be >= 0")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.max_attempts < 1 or self.max_restarts < 0:
            raise ValueError("max_attempts must be >= 1 and max_restarts >= 0")
