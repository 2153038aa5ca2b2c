"""Regenerate-and-compare utilities on the real model: greedy rows decoded alone vs together.

Usage:
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/regenerate.py [--coalitions 32] [--batch-size 8]
        [--max-new-tokens 24] [--repeats 2]

Workload: ``--coalitions`` random coalitions (each player present with probability 1/2, seed 0) of
the sentence players of ``examples/eiffel.json``, utility ``token_f1`` (greedy regeneration, then
SQuAD token F1 against the original answer), through the full Engine (scheduler, collator,
backend), each variant on a fresh engine (no store hits).

Variants, interleaved over ``--repeats`` rounds (best wall time kept):

- (a) ``alone``: every greedy row decoded by its own ``model.generate`` call
  (``greedy_tie_margin=inf``);
- (b) ``batched``: rows of a collator batch decoded together, left-padded, in one ``generate``
  call, rows whose top-2 logit margin fell below 1e-3 at a step decoded again alone (the default);
- (c) ``sampled k=2 alone``: temperature 0.8, two samples per coalition, every sample decoded by
  its own ``generate`` call (``sample_tie_gap=inf``);
- (d) ``sampled k=2 batched``: the same samples decoded together, each row drawing from its own
  seeded generator, rows whose draw came within 1e-5 of a CDF boundary decoded again alone (the
  default).

Reports coalitions/s, the ratio to (a) (greedy) or (c) (sampled), rows decoded again alone, and
whether the batched variants' texts equal the one-at-a-time texts.
"""

from __future__ import annotations

import argparse
import time

import anyio
import numpy as np

from coalescence import Engine, get_policy, load_backend, load_conversation
from coalescence.utility import GenerationConfig, UtilitySpec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coalitions", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    backend = load_backend("smollm2-135m", max_batch_size=args.batch_size)
    policy = get_policy("drop")
    probe = Engine(backend)
    snap = probe.prepare(load_conversation("examples/eiffel.json"), unit="sentence")
    rows = list(np.random.default_rng(0).random((args.coalitions, snap.n_players)) < 0.5)
    greedy = UtilitySpec(kind="token_f1", generation=GenerationConfig(max_new_tokens=args.max_new_tokens))
    sampled = UtilitySpec(
        kind="token_f1", generation=GenerationConfig(temperature=0.8, num_samples=2, max_new_tokens=args.max_new_tokens)
    )
    variants = {
        "(a) greedy alone": (float("inf"), float("inf"), greedy),
        "(b) greedy batched": (1e-3, 1e-5, greedy),
        "(c) sampled k=2 alone": (float("inf"), float("inf"), sampled),
        "(d) sampled k=2 batched": (1e-3, 1e-5, sampled),
    }
    best: dict[str, float] = {}
    texts: dict[str, dict] = {}
    redone: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, (margin, gap, spec) in variants.items():
            backend.greedy_tie_margin, backend.sample_tie_gap = margin, gap
            before = backend.statistics().redone_alone
            engine = Engine(backend, batch_size=args.batch_size, utility=spec)
            t0 = time.perf_counter()
            anyio.run(engine.evaluate, snap, policy, rows)
            seconds = time.perf_counter() - t0
            best[name] = min(best.get(name, float("inf")), seconds)
            redone[name] = backend.statistics().redone_alone - before
            texts[name] = dict(engine.measurements)
    print(f"{len(rows)} coalitions, {snap.n_players} players, batch size {args.batch_size}, "
          f"max {args.max_new_tokens} new tokens, best of {args.repeats}")
    print(f"{'variant':24} {'seconds':>8} {'coalitions/s':>13} {'speedup':>8} {'redone alone':>13}")
    names = list(variants)
    for k, name in enumerate(names):
        base = best[names[k - k % 2]]
        print(f"{name:24} {best[name]:8.1f} {len(rows) / best[name]:13.2f} {base / best[name]:7.2f}x {redone[name]:13d}")
    print(f"(b) texts equal (a) texts for every coalition: {texts[names[0]] == texts[names[1]]}")
    print(f"(d) texts equal (c) texts for every coalition: {texts[names[2]] == texts[names[3]]}")

if __name__ == "__main__":
    main()
