"""`fxbudget compare --ray`: the grid's samples run on Ray actors; this process plans and is the only writer.

A work unit is one sample with every `(protocol, rule, budget)` configuration still to run on it (`Runner.plan()`),
so each shared prefill still runs once per sample. Each worker is a Ray actor that loads the model once and holds
`cpus_per_worker` CPUs and `gpus_per_worker` GPUs (more than one GPU: the model is spread over them with
`device_map="auto"`, each layer's cache slots on its layer's device). A worker streams a unit's rows back as each
finishes (the progress bar counts them); the driver appends the unit's rows to the results file, through the same
crash-safe writer as a serial run, once all of them have arrived, so a unit is written completely or not at all. The
rows are the ones a serial run writes, keys included: resume, `--shard` and `fxbudget report` work unchanged.

A worker that dies (killed, out of host memory, its node lost) or runs out of GPU memory loses only its unit in
flight: Ray restarts it (`max_restarts`: a new process, on any node with room) and the unit goes back to the front of
the queue, to whichever worker is free first. A unit that loses its worker `max_attempts` times stops the run; so
does any other exception raised while running a unit (a bug is not retried). Ray places, restarts and feeds the
workers; the driver only hands each free worker the next unit.

Workers run this process's `fxbudget` code (shipped with Ray's `runtime_env` `py_modules`); its dependencies
(torch, transformers, ...) and the model path must exist on every node.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import sys
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..models.source import ModelSource, resolve_model
from ..models import load_model
from ..rules import get
from . import interrupt, results
from .malloc import tune_malloc
from .ray_options import RayOptions
from .runner import REFERENCE, Grid, Runner, Unit, plan_rows

log = logging.getLogger("fxbudget")

INSTALL_HINT = "pip install 'flexbudget[ray]' (or pip install 'ray[default]')"


_PACKAGE = Path(__file__).resolve().parent.parent  # fxbudget/


def code_digest() -> str:
    """A hash of this process's fxbudget sources: a driver and its workers must run the same code."""
    h = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        h.update(str(path.relative_to(_PACKAGE)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


class RayMissingError(ImportError):
    """`--ray` without Ray installed."""


def require_ray():
    """The `ray` module, or `RayMissingError` saying how to install it."""
    try:
        import ray
    except ImportError as e:
        raise RayMissingError(f"--ray needs Ray, an optional extra: {INSTALL_HINT}") from e
    return ray


class _Worker:
    """A Ray actor (`ray.remote` is applied when a run starts, Ray being optional): loads the model once on what Ray
    gave it, then runs units and streams their rows."""

    def __init__(self, source: ModelSource, grid: Grid, out_dir: str, max_new_tokens: int | None, threads: int,
                 tune: bool, dtype: str | None = None):
        import ray

        if tune:
            tune_malloc()
        torch.set_num_threads(threads)
        gpus = len(ray.get_gpu_ids())  # Ray set CUDA_VISIBLE_DEVICES to them: cuda:0 .. gpus-1
        device_map = None if gpus == 0 else {"": 0} if gpus == 1 else "auto"
        model, tok, name = load_model(source, progress=False, device_map=device_map, dtype=dtype)
        # Its out_dir is never written (only the driver's Runner.prepare creates it).
        self.runner = Runner(model, tok, name, grid, out_dir, progress=False, max_new_tokens=max_new_tokens)

    def info(self) -> dict:
        import ray

        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(), "code": code_digest(),
                "model": self.runner.model_name, "env": self.runner.env}

    def fingerprints(self, rules: list[str]) -> dict[str, str]:
        """Trace these rules' kernel fingerprints (seconds to a minute each on CPU: what makes a serial run's first
        sample slow); the driver splits the rules over the workers and hands every worker all of them."""
        grid = self.runner.grid
        return {rule.name: self.runner._fingerprint(rule)
                for rule in (get(name, **grid.rule_params.get(name, {})) for name in rules)}

    def know_fingerprints(self, fingerprints: dict[str, str]) -> None:
        """Take fingerprints traced by other workers (same code, model and versions: checked at start)."""
        self.runner._fingerprints.update(fingerprints)

    def run_unit(self, unit: Unit, todo: list):
        """A Ray generator: one item per row as it finishes, with this process's id and cumulative timings."""
        t0 = time.perf_counter()
        for row in self.runner.unit_rows(unit, todo):
            yield {"row": row, "pid": os.getpid(), "unit_s": time.perf_counter() - t0,
                   "compile_s": self.runner.compile_s, "run_s": self.runner.run_s}


@dataclass
class _Flight:
    """A unit in flight on one worker: the rows received so far."""

    worker: int
    unit: Unit
    todo: list
    start: float
    rows: list = field(default_factory=list)
    pid: int | None = None
    worker_s: float = 0.0


class RayRunner:
    """Runs a `Grid` on Ray workers and appends rows to `out_dir/results*.jsonl`, as `Runner` does (same files, rows
    and keys; resumable, shardable). This process does not load the model.

    Args:
        model_spec: what `fxbudget.models.load_model` takes (None: the embedded model; a path, a hub id or a
            `ModelSource`); a path must exist on every node (it is made absolute here), a hub id is loaded by each
            worker through its node's HF cache.
        grid, out_dir, shard, progress, max_new_tokens: as for `Runner`.
        options: the cluster and the workers' resources.
        tune_malloc: workers keep freed heap pages, as `fxbudget compare` does (`harness/malloc.py`).
        dtype: the workers' model dtype (None: bfloat16 on a GPU worker, float32 on a CPU one).
    Raises:
        RayMissingError: Ray is not installed.
    """

    def __init__(self, model_spec, grid: Grid, out_dir: str | Path, *, shard: tuple[int, int] = (0, 1),
                 progress: bool = True, max_new_tokens: int | None = None, options: RayOptions | None = None,
                 tune_malloc: bool = True, dtype: str | None = None):
        self.ray = require_ray()
        self.options = options or RayOptions()
        self.options.validate()
        source = model_spec if isinstance(model_spec, ModelSource) else resolve_model(model_spec)
        if source.kind in ("dir", "gguf"):  # the workers may start elsewhere: an absolute path
            source = dataclasses.replace(source, location=str(Path(source.location).resolve()))
        self.source, self.dtype = source, dtype
        self.spec = source.location
        self.model_name = source.name
        self.writer = Runner(None, None, self.model_name, grid, out_dir, shard=shard, progress=progress,
                             max_new_tokens=max_new_tokens)
        self.path, self.out_dir, self.tune = self.writer.path, self.writer.out_dir, tune_malloc
        self.compile_s = self.run_s = 0.0
        self.workers: list[dict] = []  # what each worker reported when it started (pid, node, model, env)
        self.busy: dict[int, tuple[Unit, int]] = {}  # worker pid -> (its unit in flight, rows received)
        self.retried: list[tuple[Unit, str]] = []  # units that lost their worker, and why
        self.discarded_rows = 0  # rows received from workers that died before their unit was complete
        self.unit_seconds: list[tuple[float, float]] = []  # per unit written: (dispatch to last row, worker's own)
        self.startup_s = 0.0  # from run() until every worker is ready (Ray's start, model loads, fingerprints)
        self.fingerprints: dict[str, str] = {}  # rule -> kernel fingerprint, traced once for all workers
        self.fingerprint_s = 0.0  # of startup_s: tracing them

    def plan(self):
        """This shard's samples and their configurations not yet in the results (`Runner.plan`)."""
        return self.writer.plan()

    def run(self) -> list[dict]:
        """Run every pending row on Ray workers; returns the rows written by this call."""
        ray = self.ray
        plan = self.plan()
        if not plan:  # nothing left: keep the run.json of the run that wrote the rows (this process has no model)
            if not (self.writer.out_dir / "run.json").exists():
                self.writer.prepare()
            return []
        t0 = time.perf_counter()
        started = self._connect()
        actors = []
        try:
            actors = self._start_workers(len(plan))
            self._share_fingerprints(actors, plan)
            self.startup_s = time.perf_counter() - t0
            o = self.options
            ray_info = {"address": o.address if started else "(ray.init() of the caller)", "workers": len(actors),
                        "cpus_per_worker": o.cpus_per_worker, "gpus_per_worker": o.gpus_per_worker,
                        "ray": ray.__version__, "nodes": len({w["node"] for w in self.workers})}
            if self.writer.progress:
                print(f"[fxbudget] {len(actors)} Ray workers on {ray_info['nodes']} nodes ready in "
                      f"{self.startup_s:.0f} s", file=sys.stderr)
            return self._execute(actors, self.writer.prepare(ray=ray_info))
        finally:
            for actor in actors:
                ray.kill(actor)
            if started:
                ray.shutdown()

    def _connect(self) -> bool:
        """Join the cluster unless this process already did; returns whether it connected here."""
        ray = self.ray
        if ray.is_initialized():
            return False
        try:  # ship this process's fxbudget to the workers (a job-level option only)
            ray.init(address=self.options.address, runtime_env={"py_modules": [str(_PACKAGE)]})
        except ConnectionError as e:
            raise RuntimeError(f"--ray {self.options.address}: {e} Start a cluster with `ray start --head` (then "
                               "--ray auto on the head node, or --ray ray://HEAD:10001 elsewhere), or use --ray "
                               "local for a Ray on this machine only") from None
        return True

    def _room(self) -> tuple[int | None, dict]:
        """How many workers the cluster has room for now (None: unbounded, no resources asked), and what is free."""
        o, free = self.options, self.ray.available_resources()
        room = [math.floor(free.get(name, 0.0) / need + 1e-9)
                for name, need in (("CPU", o.cpus_per_worker), ("GPU", o.gpus_per_worker)) if need > 0]
        return (min(room) if room else None), free

    def _start_workers(self, units: int) -> list:
        ray, o = self.ray, self.options
        room, free = self._room()
        wanted = o.workers if o.workers is not None else room if room is not None else units
        if wanted < 1 or (room is not None and wanted > room):
            raise RuntimeError(
                f"the Ray cluster has {free.get('CPU', 0):g} CPUs and {free.get('GPU', 0):g} GPUs free now: room for "
                f"{room} workers of {o.cpus_per_worker:g} CPUs and {o.gpus_per_worker:g} GPUs, "
                f"{wanted} asked (--workers, --cpus-per-worker, --gpus-per-worker; `ray status` shows the cluster)")
        threads = o.threads or max(1, int(o.cpus_per_worker))
        worker = ray.remote(_Worker).options(num_cpus=o.cpus_per_worker, num_gpus=o.gpus_per_worker,
                                             max_restarts=o.max_restarts, max_task_retries=0)
        g = self.writer
        actors = [worker.remote(self.source, g.grid, str(g.out_dir), g.max_new, threads, self.tune, self.dtype)
                  for _ in range(min(wanted, units))]
        try:
            self.workers = ray.get([a.info.remote() for a in actors])
        except ray.exceptions.RayActorError as e:
            for a in actors:
                ray.kill(a)
            raise RuntimeError(f"a Ray worker failed to start (loading model {self.spec or self.model_name}): "
                               f"{e}") from None
        # One run's rows come from one environment: this fxbudget code, one model and library versions everywhere.
        code = code_digest()
        seen = {(w["model"], *(w["env"].get(k) for k in ("torch", "transformers", "dtype", "device")))
                for w in self.workers}
        problem = None
        if any(w["code"] != code for w in self.workers):
            problem = ("Ray workers run another fxbudget than this process (the job was started elsewhere without "
                       "it): let fxbudget start the job, or install this checkout on every node")
        elif len(seen) > 1:
            problem = (f"Ray workers differ in (model, torch, transformers, dtype, device): {sorted(seen)}; install "
                       "the same versions on every node and give every worker the same resources")
        if problem:
            for a in actors:
                ray.kill(a)
            raise RuntimeError(problem)
        self.writer.env = self.workers[0]["env"]  # run.json records a worker's environment (rows record their own)
        return actors

    def _share_fingerprints(self, actors: list, plan: list) -> None:
        """Trace each pending rule's kernel fingerprint once, the rules split over the workers, and give every worker
        all of them: otherwise each worker would trace every rule on its first sample."""
        ray = self.ray
        t0 = time.perf_counter()
        rules = sorted({rule for _, todo in plan for _, rule, _ in todo if rule != REFERENCE})
        parts = [rules[i::len(actors)] for i in range(len(actors))]
        try:
            for part in ray.get([a.fingerprints.remote(p) for a, p in zip(actors, parts) if p]):
                self.fingerprints.update(part)
            ray.get([a.know_fingerprints.remote(self.fingerprints) for a in actors])
        except ray.exceptions.RayError as e:  # a worker lost now: the run goes on, workers trace what they miss
            log.warning("sharing kernel fingerprints failed (%s): each worker traces its own", _reason(e))
        self.fingerprint_s = time.perf_counter() - t0

    def _execute(self, actors: list, plan: list) -> list[dict]:
        from ray import exceptions as rx
        from tqdm.auto import tqdm

        ray = self.ray
        lost = (rx.RayActorError, rx.WorkerCrashedError, rx.NodeDiedError, rx.ObjectLostError, rx.OutOfMemoryError)
        queue, idle = deque(plan), list(range(len(actors)))
        attempts, totals = Counter(), {}
        running: dict = {}  # Ray generator -> _Flight
        restarting: dict = {}  # ref of a dead worker's `info` (Ray runs it once the worker is back) -> worker
        written: list[dict] = []
        bar = tqdm(total=plan_rows(plan), unit="row", disable=not self.writer.progress,
                   dynamic_ncols=True)
        try:
            with self.path.open("a") as f:
                while queue or running:
                    interrupt.checkpoint("ray row")  # a Ctrl-C stops between the rows the workers send
                    while idle and queue:
                        w = idle.pop(0)
                        unit, todo = queue.popleft()
                        running[actors[w].run_unit.remote(unit, todo)] = _Flight(w, unit, todo, time.perf_counter())
                    if not running and not restarting:
                        raise RuntimeError(f"every Ray worker died more than {self.options.max_restarts} times; "
                                           f"{len(queue)} samples not run (rerun to resume)")
                    (ready,), _ = ray.wait([*running, *restarting], num_returns=1)
                    if ready in restarting:
                        w = restarting.pop(ready)
                        try:
                            self.workers[w] = ray.get(ready)
                            actors[w].know_fingerprints.remote(self.fingerprints)  # runs before its next unit
                            idle.append(w)
                        except lost as e:  # out of restarts: the run goes on with the others
                            log.warning("a Ray worker is gone for good: %s", _reason(e))
                        continue
                    flight = running[ready]
                    try:
                        item = ray.get(next(ready))
                    except StopIteration:
                        del running[ready]
                        idle.append(flight.worker)
                        written += self._write(f, flight)
                        bar.set_description(f"{len(self.unit_seconds)}/{len(plan)} samples")
                        continue
                    except (*lost, rx.RayTaskError) as e:
                        del running[ready]
                        gpu_oom = isinstance(e, rx.RayTaskError) and isinstance(e.cause, torch.OutOfMemoryError)
                        if not isinstance(e, lost) and not gpu_oom:
                            raise  # an exception of the unit's own code: not retried
                        if gpu_oom:  # the worker lives on with a fragmented allocator: let Ray start a fresh one
                            ray.kill(actors[flight.worker], no_restart=False)
                        self._lost(flight, e, attempts, bar, queue)
                        # Ray restarts the worker; a task sent before it is back would fail, this one waits for it.
                        restarting[actors[flight.worker].info.options(max_task_retries=-1).remote()] = flight.worker
                        continue
                    flight.rows.append(item["row"])
                    flight.pid, flight.worker_s = item["pid"], item["unit_s"]
                    self.busy[item["pid"]] = (flight.unit, len(flight.rows))
                    totals[item["pid"]] = (item["compile_s"], item["run_s"])
                    self.compile_s = sum(c for c, _ in totals.values())
                    self.run_s = sum(r for _, r in totals.values())
                    bar.update(1)
                    bar.set_postfix_str(f"{len(actors)} workers, compile {self.compile_s:.0f}s, run "
                                        f"{self.run_s:.0f}s" + (f", {len(self.retried)} retried" if self.retried
                                                                 else ""))
        finally:
            bar.close()
        return written

    def _write(self, f, flight: _Flight) -> list[dict]:
        """Append a finished unit's rows (all of them, checked) through the crash-safe writer."""
        keys = [row["key"] for row in flight.rows]
        expected = plan_rows([(flight.unit, flight.todo)])  # one per request under a shared-context protocol
        if len(keys) != expected or len(set(keys)) != len(keys):
            raise RuntimeError(f"unit {flight.unit} returned {len(keys)} rows for {len(flight.todo)} configurations "
                               f"({expected} rows)")
        for row in flight.rows:
            results.append_row(f, row)
        self.busy.pop(flight.pid, None)
        self.unit_seconds.append((time.perf_counter() - flight.start, flight.worker_s))
        return flight.rows

    def _lost(self, flight: _Flight, error: Exception, attempts: Counter, bar, queue: deque) -> None:
        """A unit's worker died: drop the rows it sent, put the unit back in front of the queue (or stop)."""
        reason = _reason(error)
        self.busy.pop(flight.pid, None)
        self.discarded_rows += len(flight.rows)
        bar.update(-len(flight.rows))
        attempts[flight.unit] += 1
        if getattr(error, "actor_init_failed", False):
            raise RuntimeError(f"a Ray worker could not start again after it died ({reason})") from error
        if attempts[flight.unit] >= self.options.max_attempts:
            raise RuntimeError(f"sample {asdict(flight.unit)} lost its worker {attempts[flight.unit]} times (last: "
                               f"{reason}); the samples finished so far are written, rerun to resume") from error
        log.warning("a Ray worker died running sample %s (%s): it runs again", asdict(flight.unit), reason)
        self.retried.append((flight.unit, reason))
        queue.appendleft((flight.unit, flight.todo))


def _reason(error: Exception) -> str:
    """An exception's type and first line."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
