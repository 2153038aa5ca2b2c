"""shapiq in another Python: the worker behind :class:`~.external.ExternalShapiq`.

Run as a script by an interpreter that has shapiq (and numpy) but not necessarily coalescence or
torch: ``python _worker.py``. It imports nothing of coalescence. Requests come one JSON
object per line on standard input, answers one JSON object per line on standard output:

- ``{"op": "describe"}`` -> ``{"version", "python", "approximators": {name: {"valid_indices":
  [...], "params": [...]}}}``: every Shapley-value and interaction approximator of this shapiq.
- ``{"op": "run", "name", "n", "seed", "options", "budget", "order", "pool"}`` -> ``{"asked":
  [bit strings], "values": [n floats], "terms": [[players, value], ...]}``: one run of the
  approximator (constructed with ``n``, ``random_state = seed`` and ``options``) at shapiq's
  ``budget``. With ``pool`` null the game is the stand-in (a fixed synthetic utility per
  coalition, the formula of the adapter's ``_standin_values``); with ``pool`` ({bit string:
  utility}) every game call is answered from it. ``asked`` are the coalitions the approximator
  asked for, as strings of '0'/'1' (player 0 first); ``values`` its order-1 terms; ``terms`` every
  set of 2..``order`` players with its value.
- Errors: ``{"error": message, "kind": "config" | "outside"}`` ("outside": a coalition not in
  the pool was asked for).
"""

from __future__ import annotations

import copy
import inspect
import itertools
import json
import sys
import warnings

import numpy as np


class Outside(Exception):
    pass


def standin(rows: np.ndarray) -> np.ndarray:
    n = rows.shape[1]
    rng = np.random.default_rng(n)
    weights = rng.normal(size=n)
    pairs = rng.normal(size=(n, n)) / max(n, 1)
    x = rows.astype(np.float64)
    return x @ weights + np.einsum("ki,ij,kj->k", x, pairs, x)


def bits(rows: np.ndarray) -> list[str]:
    return ["".join("1" if b else "0" for b in row) for row in rows]


def main() -> None:
    warnings.simplefilter("ignore")
    import shapiq

    approximators = shapiq.approximator
    classes = {
        c.__name__: c for c in (*approximators.SV_APPROXIMATORS, *approximators.SI_APPROXIMATORS) if not inspect.isabstract(c)
    }
    pristine: dict[tuple, object] = {}

    def describe() -> dict:
        return {
            "version": shapiq.__version__,
            "python": ".".join(map(str, sys.version_info[:3])),
            "approximators": {
                name: {
                    "valid_indices": sorted(getattr(cls, "valid_indices", ())),
                    "params": list(inspect.signature(cls.__init__).parameters),
                }
                for name, cls in sorted(classes.items())
            },
        }

    def run(req: dict) -> dict:
        name, n, seed = req["name"], int(req["n"]), int(req["seed"])
        options = dict(sorted(req["options"].items()))
        key = (name, n, seed, json.dumps(options, sort_keys=True))
        if key not in pristine:
            if len(pristine) >= 32:
                pristine.pop(next(iter(pristine)))
            pristine[key] = classes[name](n=n, random_state=seed, **options)
        approximator = copy.deepcopy(pristine[key])
        pool = req.get("pool")
        asked: list[np.ndarray] = []

        def game(coalitions: np.ndarray) -> np.ndarray:
            rows = np.atleast_2d(np.asarray(coalitions, dtype=bool))
            asked.append(rows.copy())
            if pool is None:
                return standin(rows)
            try:
                return np.array([pool[k] for k in bits(rows)], dtype=np.float64)
            except KeyError:
                raise Outside from None

        try:
            result = approximator.approximate(budget=int(req["budget"]), game=game)
        except Outside:
            return {"error": "asked for a coalition outside the pool", "kind": "outside"}
        except (ValueError, TypeError, ZeroDivisionError, np.linalg.LinAlgError) as exc:
            return {"error": str(exc), "kind": "config"}
        order = req.get("order") or 1
        rows = np.concatenate(asked) if asked else np.zeros((0, n), bool)
        return {
            "asked": bits(rows),
            "values": [float(result[(i,)]) for i in range(n)],
            "terms": [
                [list(players), float(result[players])]
                for size in range(2, order + 1)
                for players in itertools.combinations(range(n), size)
            ],
        }

    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            answer = describe() if req.get("op") == "describe" else run(req)
        except Exception as exc:  # noqa: BLE001 - the worker answers every request, whatever failed
            answer = {"error": f"{type(exc).__name__}: {exc}", "kind": "failed"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
