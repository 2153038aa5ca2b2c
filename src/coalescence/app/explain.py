"""Explain runs: one code path under the CLI and the Python API.

An explain run (:class:`ExplainRun`) goes through its phases in order; each is a method, so a caller
(the CLI, :func:`explain_run`, the notebook API) can put its own output and signal handling around
them:

1. :meth:`~ExplainRun.check` the inputs and settings, nothing loaded (bad input refused here);
2. :meth:`~ExplainRun.preflight` (:mod:`coalescence.app.preflight`): the model's tokenizer and
   configuration, its content fingerprint, and every coalition the plan needs rendered with its chat
   template (:mod:`coalescence.preflight`),
   before any weights load;
3. :meth:`~ExplainRun.load`: the weights (unless a backend is given), the snapshots (a missing
   answer generated), their scored target tokens;
4. :meth:`~ExplainRun.open_archive`: the run archive created, or resumed after its identity is
   checked (nothing is written before this phase);
5. :meth:`~ExplainRun.evaluate` (async): plan, evaluate, fit, for every input;
6. :meth:`~ExplainRun.close` the archive with the run's status, then :meth:`~ExplainRun.write`
   the ``--out`` and ``--html`` documents.

What the run fits is given to it, as its *phases* (:class:`~coalescence.app.phases.RunPhases`):
the player limit, the games refused, the plan, the output paths, the manifest's record and one
conversation's evaluation and fit. An explain run's are :class:`~coalescence.app.phases.ExplainPhases`
(the default); a sweep's are :class:`~coalescence.app.sweeps.SweepPhases`, with every other phase
the same.

Errors name the settings by their names here (``budget``, ``archive``); the CLI maps them to its
options (``--budget``).
"""

from __future__ import annotations

import contextlib

from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CoalescenceError, ConfigError, EstimatorError, InputError, ReportError
from .backend import load_model
from .lifecycle import run_blocking
from .outputs import check_run_dir
from .phases import ExplainPhases, RunPhases
from .preflight import check_input_game, pinned_now, preflight_run
from .record import check_backend, check_same_date, run_record
from .settings import RunResult, RunSettings

__all__ = (
    "ExplainRun",
    "closing_run",
    "explain_run",
    "explain_run_async",
)


class ExplainRun:
    """One explain run, phase by phase (module docs).

    Args:
        source: the input: a path (``.json``, or ``.jsonl`` with one input per line), an input
            dict (any input form: messages, declared players, RAG), a list of messages, or a list of
            input dicts (a dataset, as the lines of a JSONL file).
        settings: the run's settings.
        backend: a loaded backend to use (its tokenizer, context and fingerprint too) instead of
            loading ``settings.model``.
        phases: what the run fits (:class:`~coalescence.app.phases.RunPhases`); an explain run's
            (:class:`~coalescence.app.phases.ExplainPhases`) if ``None``.

    Raises:
        InputError, ConfigError: from :meth:`check`, which the constructor runs.
    """

    def __init__(self, source: Any, settings: RunSettings, *, backend: Any = None, phases: RunPhases | None = None) -> None:
        self.source = source
        self.settings = settings
        self.phases: RunPhases = phases if phases is not None else ExplainPhases()
        self.backend = backend
        self.engine: Any = None
        self.archive: Any = None
        self.snapshots: list[Any] = []
        self.fines: list[Any] = []
        self.run_dir: Path | None = None
        self.resumed_coalitions = 0
        self.restored_conversations = 0
        self._loaded: dict[str, Any] = {}
        self.max_context = 0  # tokens: known after the preflight
        if backend is not None and settings.distributed:
            raise ConfigError("a loaded backend runs in this process; drop workers/ray_address or the backend", field="workers")
        self.check()

    # -- 1. inputs and settings ---------------------------------------------------------------
    def check(self) -> None:
        """Read the inputs and check everything the settings and the inputs alone can reveal.

        What the settings make is taken first and kept on the run (``policy``,
        ``backend_settings``, ``utility``, ``proxy_game``, the output paths, ``run_dir``, ``now``,
        and ``refused``: why no proxy game is played, as far as the settings and a given backend
        tell, or ``None``); the layers below are handed those objects (the loader the
        ``BackendSettings``, the engine the utility and the proxy game), not the settings, and
        the inputs are read and checked after, with them, and not revisited: a run's settings go
        down to the model once (three phases come back to the run: load, archive, result).

        Raises:
            InputError: bad input (naming the field, and the line of a JSONL batch).
            ConfigError: bad settings; an output path that cannot be written.
            EstimatorError: a game the method cannot run (e.g. exact on more than 16 players,
                counted only up to 17).
            ArchiveError: an archive that is not a run directory, is damaged, or holds a corrupt part.
        """
        from ..inputs import load_template, on_line, read_source
        from ..segmentation import count_players

        s = self.settings
        # the app's work on the settings first: what they made (built and checked with them),
        # handed down in place of the settings
        self.policy = s.policy()
        self.backend_settings = s.backend_settings()
        self.utility = s.utility_spec()
        self.proxy_game = s.proxy
        self.out_path, self.html_path = self.phases.outputs(self)
        if isinstance(s.archive, (str, Path)):
            self.run_dir = check_run_dir(s.archive, skip_corrupt=s.skip_corrupt)
        self.now = self.pinned_now()
        # an estimator's player limit (exact: 16) stops the count early: a long text is refused
        # after a few sentences, not after segmenting all of it
        at_most = self.phases.player_limit(self)
        self.refused = self.proxy_refusal()
        # then the inputs, checked with what the settings made
        self.conversations, self.is_batch = read_source(self.source, load_template(s.template))
        self.units = [s.hierarchy[0] if s.hierarchy else s.unit or ("document" if c.declared else "turn") for c in self.conversations]
        for k, conversation in enumerate(self.conversations):
            if conversation.target is not None:  # a generated target is checked once it exists
                on_line(k, self.is_batch, self.utility.locate, conversation.target)
        self.backend_settings.check_can(self.conversations, self.utility, is_batch=self.is_batch)
        for k, (conversation, unit) in enumerate(zip(self.conversations, self.units, strict=True)):
            try:
                n_players = on_line(k, self.is_batch, lambda c=conversation, u=unit: count_players(c, unit=u, roles=s.roles, at_most=at_most))
            except InputError as exc:  # under a hierarchy the unit is the hierarchy's: named so
                if s.hierarchy is None or not (exc.field or "").endswith("unit"):
                    raise
                message = exc.message.replace("or choose another unit", "or choose another coarse unit")
                raise InputError(message, field=(exc.field or "")[: -len("unit")] + "hierarchy") from None
            if at_most is not None and n_players > at_most:
                raise EstimatorError(
                    f"unit {unit} gives at least {n_players} players (counting stopped there), and method "
                    f"{s.method_name} allows at most {at_most}; use a coarser unit, or method regression-msr with a "
                    "budget, or method loo",
                    field=f"line {k + 1}: method" if self.is_batch else "method",  # as inputs.on_line labels a line
                )
            self.phases.validate_game(self, n_players, refused=self.refused)

    def pinned_now(self) -> datetime:
        """The instant dated chat templates render in this run (:func:`~coalescence.app.preflight.pinned_now`)."""
        return pinned_now(self.run_dir, new_run=self.settings.new_run)

    def proxy_refusal(self) -> str | None:
        """Why this run plays no proxy game, as far as the settings, the inputs and a given backend
        tell before the weights load, or ``None`` where it may (the engine then decides per
        conversation: :meth:`~coalescence.engine.Engine.proxy_refusal`)."""
        from ..engine.proxy import PROXY_OFF

        s = self.settings
        if not s.capabilities.two_fidelity:
            return f"method {s.method_name} fits the exact game alone"
        backend = self.backend_settings
        # as the backend kind declares (Ray workers run whatever their kind can: an executor)
        if self.backend is None and not backend.capabilities.proxy_game:
            return f"backend {backend.backend_name} cannot score the shared-KV proxy game"
        game = self.proxy_game
        return PROXY_OFF if game is None else game.refusal(self.backend, teacher_forced=self.utility.teacher_forced, policy_id=self.policy.id)

    def plan(self, n_players: int) -> Iterable[np.ndarray]:
        """Every coalition the run evaluates for a game of ``n_players`` (rendered by :meth:`preflight`)."""
        return self.phases.plan(self, n_players)

    def run_config(self) -> dict[str, Any]:
        """What the run fits, as the manifest's ``run_config`` records it."""
        return self.phases.run_config(self)

    # -- 2. what the tokenizer and template reveal, no weights --------------------------------------
    def preflight(self) -> None:
        """Load the tokenizer and configuration (or take the backend's), fingerprint the model,
        refuse a changed model for a resume, and render every coalition the plans need
        (:func:`~coalescence.app.preflight.preflight_run`).

        Raises:
            TemplateRefused: the chat template refuses a coalition or changes the answer.
            InputError: a conversation or coalition longer than the context; a span that covers
                no answer token.
            ArchiveError: the archive's runs used other model content (without ``new_run``).
            BackendUnavailable: the model cannot be found.
        """
        self._loaded = preflight_run(self)

    # -- 3. the model, snapshots and targets ---------------------------------------------------------
    def load(self, *, progress: Any = None, notify: Callable[[str], None] | None = None) -> Any:
        """Load the weights (unless a backend was given: :func:`~coalescence.app.backend.load_model`,
        in this process, in Ray workers or through a ``vllm serve``), make the engine, the snapshots
        and their target tokens; a missing answer is generated (greedily) and its game checked again.

        Args:
            progress: the engine's progress callbacks (e.g. a tqdm bar).
            notify: told in one line what is being loaded or started (the CLI prints it).

        Returns:
            The :class:`~coalescence.engine.Engine`.
        """
        from ..engine import Engine
        from ..inputs import on_line

        s = self.settings
        owned = self.backend is None  # loaded here: a backend that owns processes ends with the run
        if owned:
            loaded = self._loaded
            self.backend = load_model(
                self.backend_settings, loaded["source"], notify=notify, tokenizer=loaded["tokenizer"], config=loaded["config"], fingerprint=loaded["fingerprint"]
            )
        try:  # auto: the proxy game where it pays, measured
            self.engine = Engine(self.backend, progress=progress, utility=self.utility, now=self.now, proxy_game=self.proxy_game)
            # the snapshots (a missing answer generated), their targets and utilities, checked
            for k, (conversation, unit) in enumerate(zip(self.conversations, self.units, strict=True)):
                snapshot = on_line(k, self.is_batch, lambda c=conversation, u=unit: self.engine.prepare(c, unit=u, roles=s.roles, max_new_tokens=s.max_new_tokens))
                if conversation.target is None:  # checked with a stand-in answer before; now with the real one
                    on_line(k, self.is_batch, check_input_game, self, self.engine.renderer, snapshot.conversation, unit)
                self.snapshots.append(snapshot)
                fine = self.phases.fine_game(self, snapshot)
                if fine is not None:
                    self.fines.append(fine)
            for k, snap in enumerate(self.snapshots):
                on_line(k, self.is_batch, self.engine.resolved_utility, snap, self.policy)
                # where the check left the proxy game open, the engine's word (the loaded backend's too)
                refused = self.engine.proxy_refusal(snap, self.policy) if self.refused is None else self.refused
                self.phases.validate_game(self, snap.n_players, refused=refused)
            for snap in self.recorded:
                self.engine.resolved_utility(snap, self.policy)
        except BaseException:
            if owned and self.backend.shutdown_with_engine:  # e.g. the Ray workers this run started
                self.backend.shutdown()
            raise
        return self.engine

    @property
    def recorded(self) -> list[Any]:
        """Every snapshot the archive records: the inputs', then a hierarchy's fine ones."""
        return self.snapshots + [f for f, _ in self.fines]

    # -- 4. the archive --------------------------------------------------------------------------------
    def description(self) -> dict[str, Any]:
        """The run's record in the archive manifest (:func:`~coalescence.app.record.run_record`)."""
        return run_record(self)


    def open_archive(self) -> Any:
        """Create the run archive, or resume the run it holds after checking its identity; attach
        it to the engine (its coalitions are then served with no model call).

        Returns:
            The :class:`~coalescence.archive.writer.RunArchive`, or ``None`` (no archive).

        Raises:
            ArchiveError: the archive holds another run (naming the differences), is locked by
                another writer, or cannot be written.
        """
        from ..archive.writer import RunArchive

        s = self.settings
        if s.archive is None or s.archive is False:
            return None
        if self.run_dir is None:
            stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
            self.run_dir = Path("runs") / f"{stamp}-{self.snapshots[0].snapshot_id[:12]}"
        description = self.description()
        check_backend(self.run_dir, description["backend"])
        check_same_date(self.run_dir, description, self.now)
        # another utility or absence policy was refused in the preflight, before the load (check_measurement)
        archive = RunArchive.open(
            self.run_dir,
            description,
            new_run=s.new_run,
            skip_corrupt=s.skip_corrupt,
            flush_rows=s.flush_rows,
            flush_seconds=s.flush_seconds,
        )
        self.archive = archive
        self.resumed_coalitions = self.engine.attach_archive(archive) if archive.resumed else 0
        if not archive.resumed:
            self.engine.attach_archive(archive)
        return archive



    # -- 5. the run ------------------------------------------------------------------------------------
    async def evaluate(self) -> list[Any]:
        """Plan, evaluate and fit every input (async: the engine's event loop).

        Up to ``max_conversations_in_flight`` conversations are evaluated at once through the one
        engine (their coalitions share batches; each value is what a one-at-a-time run gives, up
        to float rounding). A conversation an earlier session of a resumed run finished, with the
        same method, budget, seed and target standard error, is restored from the archive, not
        planned again.

        Returns:
            One explanation per input, in input order (hierarchical for a hierarchy run).

        Raises:
            BatchFailed: a model call failed.
        """
        import anyio

        results: list[Any] = [None] * len(self.snapshots)
        todo = []
        for k, snap in enumerate(self.snapshots):
            restored = self.phases.restored(self, snap)
            if restored is not None:
                results[k] = restored
            else:
                todo.append((k, snap))
        self.restored_conversations = len(self.snapshots) - len(todo)
        pending = iter(todo)

        async def worker() -> None:
            for k, snap in pending:  # shared: each worker takes the next conversation
                results[k] = await self.phases.explain_one(self, k, snap)
                self.phases.record(self, snap, results[k])

        width = max(1, min(self.settings.max_conversations_in_flight, len(todo)))
        if width == 1:
            await worker()
            return results
        try:
            async with anyio.create_task_group() as tg:
                for _ in range(width):
                    tg.start_soon(worker)
        except BaseExceptionGroup as group:  # one conversation's error stops the others: raise it as it is
            raise _first_error(group) from None
        return results

    # -- 6. close and write ------------------------------------------------------------------------------
    def close(self, status: str) -> None:
        """Close the engine and its archive, recording ``status`` (``complete``, ``interrupted``,
        ``failed``).

        Raises:
            ArchiveError: the archive's last part or manifest cannot be written.
        """
        if self.engine is not None:
            progress = self.engine.progress
            if hasattr(progress, "close"):  # a bar's last line, before the archive's close can fail
                with contextlib.suppress(OSError):
                    progress.close()
            self.engine.close(status=status)

    def document(self, explanations: Sequence[Any]) -> dict[str, Any]:
        """The ``--out`` document: one explanation's, or ``{"archive", "explanations"}`` for a batch."""
        where = {"archive": str(self.run_dir)} if self.archive is not None else {}
        where |= {"backend": dict(self.backend.identity())} if self.backend is not None else {}
        documents = [e.to_dict() | where for e in explanations]
        if self.is_batch:
            return {"archive": str(self.run_dir) if self.archive is not None else None, "explanations": documents}
        return documents[0]

    def write(self, explanations: Sequence[Any]) -> dict[str, Any]:
        """Write the ``out`` document and the ``html`` report (each atomically) when asked for.

        Returns:
            The ``--out`` document.

        Raises:
            ArchiveWriteError, ArchiveError: a file cannot be written.
        """
        payload = self.write_out(explanations)
        self.write_html(payload)
        return payload

    def write_out(self, explanations: Sequence[Any]) -> dict[str, Any]:
        """Write the ``out`` document (atomically) when asked for; returns it.

        Raises:
            ArchiveWriteError, ArchiveError: the file cannot be written.
        """
        from ..archive.writer import write_json_atomic

        payload = self.document(explanations)
        if self.out_path is not None:
            write_json_atomic(self.out_path, payload, field="out")
        return payload

    def write_html(self, payload: dict[str, Any]) -> None:
        """Draw and write the ``html`` report of ``payload`` (the ``--out`` document) when asked for.

        The run's results are written by then: any failure here, drawing or writing, is a
        :class:`~coalescence.errors.ReportError`, never taken for a failure of the run.

        Raises:
            ReportError: the page cannot be drawn or written (the message says why and how to make
                it again from the archive).
        """
        if self.html_path is None:
            return
        from ..report import render_report, write_report

        again = f"; the results are kept: make it again with `coalescence report {self.run_dir} -o PATH`" if self.archive is not None else ""
        try:
            write_report(self.html_path, render_report(payload), field="html")
        except CoalescenceError as exc:
            raise ReportError(f"the HTML report was not written: {exc.message}{again}", field="html") from exc
        except Exception as exc:  # a drawing library's failure must not read as the run's
            first = (str(exc).strip().splitlines() or [""])[0]
            raise ReportError(f"the HTML report could not be drawn ({type(exc).__name__}: {first}){again}", field="html") from exc

    def result(self, explanations: Sequence[Any], payload: dict[str, Any]) -> RunResult:
        """The run's :class:`RunResult`."""
        return RunResult(
            explanations=tuple(explanations),
            snapshots=tuple(self.snapshots),
            run_dir=self.run_dir if self.archive is not None else None,
            is_batch=self.is_batch,
            document=payload,
            resumed_coalitions=self.resumed_coalitions,
        )


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The first error of a task group's, depth first, that is not the cancellation it caused."""
    import anyio

    cancelled = anyio.get_cancelled_exc_class()
    for exc in group.exceptions:
        found = _first_error(exc) if isinstance(exc, BaseExceptionGroup) else exc
        if not isinstance(found, cancelled):
            return found
    return group.exceptions[0]


def explain_run(source: Any, settings: RunSettings, *, backend: Any = None, progress: Any = None) -> RunResult:
    """Every phase of an explain run, synchronously (its own event loop).

    Args:
        source: a path, an input dict or a list of messages (see :class:`ExplainRun`).
        settings: the run's settings.
        backend: a loaded backend (else ``settings.model`` is loaded).
        progress: progress callbacks.

    Returns:
        The :class:`RunResult`.

    Raises:
        CoalescenceError: as the phases raise; the archive is closed with status ``failed`` (or
            ``interrupted`` on a KeyboardInterrupt) before the error propagates.
    """

    run = ExplainRun(source, settings, backend=backend)
    run.preflight()
    run.load(progress=progress)
    run.open_archive()
    explanations = closing_run(run, lambda: run_blocking(run.evaluate))
    return run.result(explanations, run.write(explanations))


async def explain_run_async(source: Any, settings: RunSettings, *, backend: Any = None, progress: Any = None) -> RunResult:
    """:func:`explain_run` for code already in an event loop (asyncio or trio): the blocking
    phases (tokenizer, weights, archive) run in a worker thread, the evaluation in the caller's loop."""
    import anyio

    def prepare() -> ExplainRun:
        run = ExplainRun(source, settings, backend=backend)
        run.preflight()
        run.load(progress=progress)
        run.open_archive()
        return run

    run = await anyio.to_thread.run_sync(prepare)
    status = "interrupted"
    try:
        explanations = await run.evaluate()
        status = "complete"
    except CoalescenceError:
        status = "failed"
        raise
    finally:
        await anyio.to_thread.run_sync(run.close, status)
    payload = await anyio.to_thread.run_sync(run.write, explanations)
    return run.result(explanations, payload)


def closing_run(run: ExplainRun, evaluate: Callable[[], list[Any]]) -> list[Any]:
    status = "interrupted"
    try:
        explanations = evaluate()
        status = "complete"
        return explanations
    except CoalescenceError:
        status = "failed"
        raise
    finally:
        run.close(status)
