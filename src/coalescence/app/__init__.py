"""The application layer: explain, replay, sweep and hierarchical runs over the engine, one code
path under the CLI and the Python API.

:mod:`.settings` (what a run is asked to do), :mod:`.explain` (an explain run, phase by phase),
:mod:`.replay` and :mod:`.fit` (fits from an archive, with or without the model), :mod:`.sweeps`,
:mod:`.hierarchy` (a coarse level, then detail), :mod:`.record` (the run's manifest record and what a
resumed run must agree with), :mod:`.preflight` (an explain run's checks before the weights load),
:mod:`.backend` (how the model executes, and the one path that loads it), :mod:`.outputs` (output
paths checked before any work), :mod:`.report` (a report's input, a run directory fitted here).
"""

from .explain import ExplainRun, explain_run, explain_run_async
from .fit import ArchiveFit, fit_archive
from .hierarchy import HierarchicalExplanation, explain_hierarchical
from .replay import ReplayRun, replay_run
from .report import report_source
from .settings import ReplaySettings, RunResult, RunSettings
from .sweeps import SweepPhases, SweepSettings, sweep_run

__all__ = (
    "ArchiveFit",
    "ExplainRun",
    "HierarchicalExplanation",
    "ReplayRun",
    "ReplaySettings",
    "RunResult",
    "RunSettings",
    "SweepPhases",
    "SweepSettings",
    "explain_hierarchical",
    "explain_run",
    "explain_run_async",
    "fit_archive",
    "replay_run",
    "report_source",
    "sweep_run",
)
