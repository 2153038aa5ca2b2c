"""Ray model workers: one dataset run across several processes or machines (the only module that imports ray).

Ray is an executor, orthogonal to the backend (as vLLM's ``Executor`` is to its model runner): each
worker runs every model call of the backend it holds (:data:`MODEL_CALLS`: ``score``,
``score_proxy``, ``generate_batch``, ``generate``), and :class:`RayBackend` reports that backend's
capabilities (``supports_proxy`` and its ``proxy_refusal_reason``), so whatever the backend can do,
the proxy game included, a run on workers does.

The driver keeps everything but the model forward: planning, the dedup registry and hot store, the
one archive writer, rendering and tokenisation (the tokenizer and configuration only; the driver
loads no weights). Each worker is a Ray actor holding one backend from the backends registry (the
same ``--backend``, model, device and dtype); :class:`RayBackend` stands in for a backend on the
driver and gives the engine one *lane* per worker. The engine keeps one collator per lane, so one
backend call per worker is in flight at a time, and routes each conversation (snapshot) whole to
one lane: sticky, to the live worker with the fewest conversations in flight when first seen, so
that worker's prefix cache stays warm for it.

A worker that dies (``ray.kill``, a killed process, a lost node) is marked lost at the first call
that finds it so: that call is run again on a live worker, its conversations move to the live
workers, and the run goes on. Only the coalitions in flight on the lost worker are evaluated
again; nothing reaches the archive twice (the archive writer is the driver's). When no worker is
left the call fails with :class:`~coalescence.errors.BatchFailed` (exit 1). The losses are logged,
recorded in the archive manifest's run record (``ray``) and noted in the explanations.

Ray is an optional extra (``pip install 'coalescence[ray]'``); without it a run that asks for
workers stops with one :class:`~coalescence.errors.ConfigError` line.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import errors
from .backends.base import DEFAULT_BATCH_SIZE, BackendBase
from .errors import BackendUnavailable, BatchFailed, CoalescenceError, ConfigError

if TYPE_CHECKING:
    from .backends.models import Preloaded
    from .backends.settings import BackendSettings

__all__ = (
    "import_ray",
    "ModelWorker",
    "RayBackend",
    "start_ray_backend",
)

logger = logging.getLogger(__name__)

MODEL_CALLS: dict[str, Callable[..., Any]] = {
    "score": lambda backend, requests: backend.score(requests),
    "score_proxy": lambda backend, requests: backend.score_proxy(requests),
    "generate_batch": lambda backend, requests: backend.generate_batch(requests),
    "generate": lambda backend, prompt_ids, max_new_tokens: backend.generate(prompt_ids, max_new_tokens=max_new_tokens),
}
"""The model calls a worker runs on its backend for the driver, by name, with positional arguments:
every model call of :class:`~coalescence.backends.base.ScoringBackend` (the proxy game's
``score_proxy`` included), so whatever the backend can do, its workers can."""

INSTALL_HINT = "pip install 'coalescence[ray]'"


def import_ray(field_name: str = "workers") -> Any:
    """The ``ray`` module, or one :class:`ConfigError` line naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f"Ray workers need the ray package; install it with: {INSTALL_HINT}", field=field_name) from None
    return ray


class ModelWorker:
    """The Ray actor's class: one backend, loaded once from the run's
    :class:`~coalescence.backends.settings.BackendSettings` (whole: a new option reaches the
    workers with no change here), its calls answered in order.

    Errors raised on purpose by the backend come back as values (class name, message, field) and
    are raised again on the driver as the same :mod:`coalescence.errors` class; any other
    exception becomes a :class:`BatchFailed`. An exception from Ray itself means the worker is gone.
    """

    def __init__(self, settings: BackendSettings) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self._error: tuple[str, str, str | None] | None = None
        self.backend: Any = None
        try:
            import transformers

            transformers.utils.logging.set_verbosity_error()
            transformers.utils.logging.disable_progress_bar()
            from .backends.registry import load_backend

            self.backend = load_backend(str(settings.model), settings)  # this process loads: the Ray fields are not read
        except CoalescenceError as exc:
            self._error = (type(exc).__name__, exc.message, exc.field)
        except Exception as exc:  # noqa: BLE001 - reported to the driver as a value
            self._error = ("BackendUnavailable", f"cannot load model {settings.model!r} in a Ray worker: {type(exc).__name__}: {exc}", "model")

    def info(self) -> dict[str, Any]:
        """The worker's model identity, process, node and CPUs (or the loading error)."""
        import ray

        out: dict[str, Any] = {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(), "cpus": os.cpu_count() or 1}
        if self._error is not None:
            out["error"] = self._error
            return out
        b = self.backend
        out["model"] = {
            "id": b.model_id,
            "revision": b.revision,
            "dtype": b.dtype,
            "sha256": str(b.fingerprint or ""),
        }
        out["identity"] = dict(b.identity())
        out["max_context"] = int(b.max_context)
        out["max_batch_size"] = int(b.max_batch_size)
        out["pads_rows"] = bool(b.pads_rows)
        out["supports_proxy"] = bool(b.supports_proxy)
        out["proxy_refusal_reason"] = getattr(b, "proxy_refusal_reason", None)
        return out

    def set_threads(self, threads: int) -> int:
        """``torch.set_num_threads(threads)``; returns the number in use."""
        import torch

        torch.set_num_threads(int(threads))
        return torch.get_num_threads()

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> tuple[bool, Any]:
        try:
            return True, method(*args, **kwargs)
        except CoalescenceError as exc:
            return False, (type(exc).__name__, exc.message, exc.field)
        except Exception as exc:  # noqa: BLE001 - reported to the driver as a value
            return False, ("BatchFailed", f"the model call failed in a Ray worker: {type(exc).__name__}: {exc}", None)

    def run(self, method: str, *args: Any) -> tuple[bool, Any]:
        """Run the backend's model call ``method`` (a name of :data:`MODEL_CALLS`) on ``args``:
        ``(True, result)``, or ``(False, (error class name, message, field))``."""
        if method not in MODEL_CALLS:
            return False, ("BatchFailed", f"{method!r} is not a backend model call ({', '.join(MODEL_CALLS)})", None)
        return self._call(MODEL_CALLS[method], self.backend, *args)

    def pid(self) -> int:
        return os.getpid()


def _raise_remote(payload: tuple[str, str, str | None]) -> None:
    name, message, where = payload
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, CoalescenceError)):
        cls = BatchFailed
    raise cls(message, field=where)


@dataclass(slots=True)
class _Worker:
    index: int
    actor: Any
    pid: int = 0
    node: str = ""
    threads: int = 1
    alive: bool = True
    calls: int = 0
    conversations: set[str] = field(default_factory=set)


class _Lane(BackendBase):
    """The backend of one worker for one collator (a :class:`~coalescence.backends.base.ScoringBackend`
    with one lane): calls go to the lane's worker, or, once it is lost, to the live worker its
    conversations moved to first."""

    def __init__(self, owner: RayBackend, index: int) -> None:
        self.owner = owner
        self.index = index
        self.model_id = owner.model_id
        self.revision = owner.revision
        self.dtype = owner.dtype
        self.tokenizer = owner.tokenizer
        self.max_context = owner.max_context
        self.fingerprint = owner.fingerprint
        self.max_batch_size = owner.max_batch_size
        self.pads_rows = owner.pads_rows
        self.supports_proxy = owner.supports_proxy
        self.proxy_refusal_reason = owner.proxy_refusal_reason

    def identity(self) -> dict[str, str]:
        """The workers' backend (:meth:`RayBackend.identity`)."""
        return self.owner.identity()

    def score(self, requests: Sequence[Any]) -> list[Any]:
        return self.owner.call(self.index, "score", list(requests))

    def score_proxy(self, requests: Sequence[Any]) -> list[Any]:
        return self.owner.call(self.index, "score_proxy", list(requests))

    def generate_batch(self, requests: Sequence[Any]) -> list[Any]:
        return self.owner.call(self.index, "generate_batch", list(requests))

    def generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int) -> list[int]:
        return self.owner.call(self.index, "generate", list(prompt_ids), max_new_tokens)


class RayBackend(BackendBase):
    """A backend on the driver whose model calls run in Ray workers (module docs).

    A :class:`~coalescence.backends.base.ScoringBackend` with one lane per worker:
    :meth:`acquire_lane` (the sticky worker of a conversation), :meth:`lane` and
    :meth:`release_lane`; its :meth:`run_record` is the archive's ``ray`` entry, its
    :meth:`run_notes` name lost workers, and it shuts down with the engine.

    Args:
        ray: the ray module (initialised).
        actors: the worker actors, ready.
        infos: each actor's :meth:`ModelWorker.info`.
        tokenizer: the model's tokenizer (the driver renders and decodes).
        identity: the driver's model identity ``{"id", "revision", "dtype", "sha256"}``.
        max_context: the model's context (tokens).
        max_batch_size: rows per model call (``None``: the workers' backend default).
        owns_ray: whether :meth:`shutdown` ends the Ray session too (a local cluster this run started).
    """

    shutdown_with_engine = True

    def __init__(
        self,
        ray: Any,
        actors: Sequence[Any],
        infos: Sequence[dict[str, Any]],
        *,
        tokenizer: Any,
        identity: dict[str, str],
        max_context: int,
        max_batch_size: int | None,
        owns_ray: bool,
        address: str | None = None,
    ) -> None:
        self._ray = ray
        self.model_id = identity["id"]
        self.revision = identity["revision"]
        self.dtype = identity["dtype"]
        self.fingerprint = identity["sha256"]
        # the workers' backend (as ModelWorker.info reports it; all workers load the same one)
        self.engine_identity = dict(infos[0].get("identity") or {"backend": "unknown"}) if infos else {"backend": "unknown"}
        self.tokenizer = tokenizer
        self.max_context = int(max_context)
        self.max_batch_size = int(max_batch_size or min(int(info.get("max_batch_size", DEFAULT_BATCH_SIZE)) for info in infos))
        self.pads_rows = any(bool(info.get("pads_rows", True)) for info in infos)
        # the workers' backend's capabilities are the executor's: the proxy game where every worker plays it
        self.supports_proxy = bool(infos) and all(bool(info.get("supports_proxy")) for info in infos)
        refusals = [info.get("proxy_refusal_reason") for info in infos if not info.get("supports_proxy")]
        self.proxy_refusal_reason = next((r for r in refusals if r), None)
        self.address = address
        self.workers = [
            _Worker(index=i, actor=a, pid=int(info["pid"]), node=str(info["node"])) for i, (a, info) in enumerate(zip(actors, infos, strict=True))
        ]
        self._lock = threading.Lock()
        self._assigned: dict[str, int] = {}
        self._active = [0] * len(self.workers)
        self._redirect: dict[int, int] = {}
        self._lanes: dict[int, _Lane] = {}
        self.lost: list[dict[str, Any]] = []
        self.rerun_calls = 0
        self._owns_ray = owns_ray
        self._closed = False

    # -- lanes ------------------------------------------------------------------------------------
    def _least_loaded(self) -> int:
        live = [w for w in self.workers if w.alive]
        if not live:
            raise BatchFailed(
                f"every Ray worker was lost ({len(self.lost)} of {len(self.workers)}); the evaluated coalitions are in "
                "the archive: run the same command to resume"
            )
        return min(live, key=lambda w: (self._active[w.index], len(w.conversations), w.index)).index

    def acquire_lane(self, snapshot_id: str) -> int:
        """The lane (worker index) of a conversation: its sticky worker while that one lives, else
        the live worker with the fewest conversations in flight."""
        with self._lock:
            index = self._assigned.get(snapshot_id)
            if index is None or not self.workers[index].alive:
                index = self._least_loaded()
                self._assigned[snapshot_id] = index
                self.workers[index].conversations.add(snapshot_id)
            self._active[index] += 1
            return index

    def release_lane(self, index: int) -> None:
        """Give back lane ``index`` (one evaluation on it ended)."""
        with self._lock:
            self._active[index] -= 1

    def lane(self, index: int | None) -> Any:
        """The backend of lane ``index`` (one per worker; ``None``: this backend, calls to the least
        loaded worker)."""
        if index is None:
            return self
        with self._lock:
            lane = self._lanes.get(index)
            if lane is None:
                lane = self._lanes[index] = _Lane(self, index)
            return lane

    def _target(self, index: int) -> _Worker:
        """The live worker that serves lane ``index`` now (lock held)."""
        seen = set()
        while not self.workers[index].alive:
            if index in seen:
                break
            seen.add(index)
            nxt = self._redirect.get(index)
            if nxt is None or not self.workers[nxt].alive:
                nxt = self._least_loaded()
                self._redirect[index] = nxt
            index = nxt
        if not self.workers[index].alive:
            index = self._least_loaded()
        return self.workers[index]

    def _lose(self, worker: _Worker, exc: BaseException) -> None:
        """Mark ``worker`` lost and move its conversations to the live workers (lock held)."""
        if not worker.alive:
            return
        worker.alive = False
        moved = sorted(worker.conversations)
        worker.conversations = set()
        live = [w for w in self.workers if w.alive]
        for sid in moved:
            if live:
                target = min(live, key=lambda w: (len(w.conversations), w.index))
                target.conversations.add(sid)
                self._assigned[sid] = target.index
            else:
                self._assigned.pop(sid, None)
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        self.lost.append({"worker": worker.index, "pid": worker.pid, "node": worker.node, "conversations_moved": len(moved), "error": reason})
        logger.warning(
            "Ray worker %d (pid %d) was lost (%s); its %d conversations move to the %d live workers and its "
            "coalitions in flight are evaluated again",
            worker.index, worker.pid, type(exc).__name__, len(moved), len(live),
        )  # fmt: skip

    def call(self, index: int, method: str, *args: Any) -> Any:
        """Run the backend's model call ``method`` (:data:`MODEL_CALLS`) on lane ``index``'s worker
        (worker thread); a lost worker's call runs again on a live one.

        Raises:
            BatchFailed: the model call failed, or no worker is left.
            CoalescenceError: what the worker's backend raised on purpose.
        """
        ray = self._ray
        died = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.ObjectLostError)
        first = True
        while True:
            with self._lock:
                if self._closed:
                    raise BatchFailed("the Ray workers were shut down")
                worker = self._target(index)
                worker.calls += 1
                if not first:
                    self.rerun_calls += 1
            first = False
            try:
                ok, payload = ray.get(worker.actor.run.remote(method, *args))
            except died as exc:
                with self._lock:
                    self._lose(worker, exc)
                continue
            if not ok:
                _raise_remote(payload)
            return payload

    # -- the backend protocol -------------------------------------------------------------------
    def score(self, requests: Sequence[Any]) -> list[Any]:
        return self.call(self._any(), "score", list(requests))

    def score_proxy(self, requests: Sequence[Any]) -> list[Any]:
        return self.call(self._any(), "score_proxy", list(requests))

    def generate_batch(self, requests: Sequence[Any]) -> list[Any]:
        return self.call(self._any(), "generate_batch", list(requests))

    def generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int) -> list[int]:
        return self.call(self._any(), "generate", list(prompt_ids), max_new_tokens)

    def _any(self) -> int:
        with self._lock:
            return self._least_loaded()

    # -- records ------------------------------------------------------------------------------------
    def identity(self) -> dict[str, str]:
        """The backend the workers run (``{"backend": "hf"}``...): Ray places the calls, the
        workers' engine computes the values."""
        return dict(self.engine_identity)

    def run_record(self) -> dict[str, Any]:
        """What the archive manifest's run record keeps of the workers: ``{"ray": {workers,
        threads_per_worker, nodes, calls_per_worker, lost_workers, calls_run_again}}``."""
        with self._lock:
            return {
                "ray": {
                    "workers": len(self.workers),
                    "threads_per_worker": [w.threads for w in self.workers],
                    "nodes": len({w.node for w in self.workers}),
                    "calls_per_worker": [w.calls for w in self.workers],
                    "lost_workers": list(self.lost),
                    "calls_run_again": self.rerun_calls,
                }
            }

    def run_notes(self, snapshot_id: str = "") -> tuple[str, ...]:
        """Explanation notes: the lost workers, if any (the whole run's)."""
        with self._lock:
            if not self.lost:
                return ()
            return (
                f"{len(self.lost)} of {len(self.workers)} Ray workers were lost during the run; the coalitions they "
                "had in flight were evaluated again on another worker (each is archived once)",
            )

    def shutdown(self) -> None:
        """Kill the workers (and end the Ray session this run started)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = list(self.workers)
        for w in workers:
            try:
                self._ray.kill(w.actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self._owns_ray:
            try:
                self._ray.shutdown()
            except Exception:  # noqa: BLE001
                pass

    def kill_worker(self, index: int) -> None:
        """Kill worker ``index``'s actor (tests and drills: what a crashed worker looks like)."""
        self._ray.kill(self.workers[index].actor, no_restart=True)


def start_ray_backend(source: Any, settings: BackendSettings, preloaded: Preloaded) -> RayBackend:
    """Start (or join) a Ray cluster and ``settings.workers`` model workers, each loading the
    backend kind ``settings`` names; the driver keeps the tokenizer.

    Args:
        source: the resolved model (:class:`~coalescence.backends.models.ModelSource`).
        settings: the backend settings, whole: the kind, device, dtype and batch each worker
            loads, and the executor's own fields: ``workers`` (default: 1 per GPU of a joined
            cluster, else 2), ``ray_address`` (an existing cluster, ``auto``, ``HOST:PORT``,
            ``ray://...``; ``None``: a local cluster started for this run), ``gpus_per_worker``
            and ``threads_per_worker`` (``torch.set_num_threads`` in each worker; default: the
            CPUs of its node divided among the workers placed there).
        preloaded: what the driver already read of the model (tokenizer, configuration,
            fingerprint; no weights).

    Raises:
        ConfigError: no ray package (one line naming the extra).
        BackendUnavailable: a worker cannot load the model, or loads other model content than the
            driver sees (a multi-node cluster without the same files).
    """
    from .backends.registry import model_context, model_fingerprint

    workers, ray_address = settings.workers, settings.ray_address
    gpus_per_worker, threads_per_worker = float(settings.gpus_per_worker), settings.threads_per_worker
    tokenizer, config, fingerprint = preloaded.tokenizer, preloaded.config, preloaded.fingerprint
    ray = import_ray("ray_address" if ray_address else "workers")
    owns = False
    if not ray.is_initialized():
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        try:
            if ray_address:
                ray.init(address=ray_address, log_to_driver=False, logging_level=logging.WARNING)
            else:
                n = workers or 2
                ray.init(
                    num_cpus=max(os.cpu_count() or 1, n),
                    num_gpus=None if gpus_per_worker else 0,
                    include_dashboard=False,
                    log_to_driver=False,
                    logging_level=logging.WARNING,
                )
                owns = True
        except (ConnectionError, RuntimeError, ValueError) as exc:
            where = f"the Ray cluster at {ray_address!r}" if ray_address else "a local Ray cluster"
            raise ConfigError(f"cannot start or join {where}: {' '.join(str(exc).split())[:300]}", field="ray_address" if ray_address else "workers") from exc
    if workers is None:
        gpus = int(ray.cluster_resources().get("GPU", 0)) if gpus_per_worker else 0
        workers = max(1, int(gpus // gpus_per_worker)) if gpus else 2
    if fingerprint is None:
        fingerprint = model_fingerprint(source)
    identity = {"id": source.model_id, "revision": source.revision, "dtype": settings.dtype, "sha256": fingerprint}
    worker_settings = dataclasses.replace(settings, model=source.model_id)
    actor_class = ray.remote(ModelWorker)
    actors = [
        # each worker resolves the model by the name the driver resolved (a local model's real path)
        actor_class.options(num_cpus=1, num_gpus=gpus_per_worker or 0, max_restarts=0, max_task_retries=0).remote(worker_settings)
        for _ in range(workers)
    ]
    ok = False
    try:
        t0 = time.perf_counter()
        infos = ray.get([a.info.remote() for a in actors])
        for i, info in enumerate(infos):
            if "error" in info:
                name, message, where = info["error"]
                raise BackendUnavailable(f"Ray worker {i}: {message}", field=where or "model")
            theirs = dict(info["model"])
            if theirs["id"] != identity["id"] or theirs["revision"] != identity["revision"] or theirs["sha256"] != identity["sha256"]:
                raise BackendUnavailable(
                    f"Ray worker {i} on node {info['node'][:12]} loads other model content than the driver "
                    f"(sha256 {theirs['sha256'][:12]} vs {identity['sha256'][:12]}); give every node the same model files",
                    field="model",
                )
            identity["dtype"] = theirs["dtype"]
        # the workers' own backends say how long a sequence they take (the driver read the configuration only)
        max_context = min(int(info["max_context"]) for info in infos)
        if config is not None and model_context(config, tokenizer) != max_context:
            logger.info("the workers' context is %d tokens (the configuration says %d)", max_context, model_context(config, tokenizer))
        per_node: dict[str, int] = {}
        for info in infos:
            per_node[info["node"]] = per_node.get(info["node"], 0) + 1
        threads = [threads_per_worker or max(1, int(info["cpus"]) // per_node[info["node"]]) for info in infos]
        ray.get([a.set_threads.remote(t) for a, t in zip(actors, threads, strict=True)])
        logger.info("%d Ray workers ready in %.1f s (threads %s)", workers, time.perf_counter() - t0, threads)
        result = RayBackend(
            ray,
            actors,
            infos,
            tokenizer=tokenizer,
            identity=identity,
            max_context=max_context,
            max_batch_size=settings.batch_size,
            owns_ray=owns,
            address=ray_address,
        )
        for w, t in zip(result.workers, threads, strict=True):
            w.threads = t
        ok = True
        return result
    finally:
        if not ok:
            for a in actors:
                try:
                    ray.kill(a)
                except Exception:  # noqa: BLE001
                    pass
            if owns:
                ray.shutdown()
