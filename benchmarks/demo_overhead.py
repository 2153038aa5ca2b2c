"""What the faithful-games work adds to the demo outside the model, measured part by part.

Before any weights load, the CLI now loads the tokenizer and the configuration itself (they were
loaded inside the model's loading before: the same GGUF parses, one each), fingerprints the model's
files (a cached digest after the first run) and renders every coalition of the plan (preflight).
Each coalition's scoring prompt is now its full rendering with the answer, cut at the answer (was:
the generation prompt). This prints each part's time and the render paths side by side.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/demo_overhead.py
"""

from __future__ import annotations

import itertools
import time

import numpy as np

from coalescence.attribution.estimators import make_estimator
from coalescence.backends.registry import load_config, load_tokenizer, model_fingerprint, resolve_model
from coalescence.snapshot import ConversationSnapshot
from coalescence.inputs import load_conversation
from coalescence.masking.policies import DropPolicy
from coalescence.masking.render import ChatRenderer
from coalescence.preflight import check_game


def best(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    source = resolve_model("smollm2-135m")
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(source)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    load_config(source)
    t_cfg = time.perf_counter() - t0
    model_fingerprint(source)  # fill the digest cache
    t_fp = best(lambda: model_fingerprint(source))
    renderer = ChatRenderer(tokenizer)
    snapshot = ConversationSnapshot.build(load_conversation("examples/eiffel.json"), unit="sentence")
    policy = DropPolicy()
    n = snapshot.n_players
    t_pre = best(lambda: check_game(renderer, snapshot, policy, make_estimator("exact").plan(n), max_context=8192))
    target = renderer.target_tokens(snapshot, policy)
    rows = [np.array(bits) for bits in itertools.product([False, True], repeat=n)]

    def old() -> None:
        for row in rows:
            renderer.encode(renderer.render_prompt(policy.render(snapshot, row)))

    def new() -> None:
        for row in rows:
            renderer.encode(renderer.scoring_prompt(policy.render(snapshot, row), target))

    t_old, t_new = best(old), best(new)
    print("| part | seconds |")
    print("|---|---:|")
    print(f"| tokenizer from the GGUF (was inside the model load) | {t_tok:.2f} |")
    print(f"| configuration from the GGUF (was inside the model load; passed on to it now) | {t_cfg:.2f} |")
    print(f"| content fingerprint, cached digest | {t_fp:.4f} |")
    print(f"| preflight: render and encode all {len(rows)} coalitions | {t_pre:.3f} |")
    print(f"| render + encode {len(rows)} prompts, generation prompt (before) | {t_old:.3f} |")
    print(f"| render + encode {len(rows)} prompts, full rendering cut at the answer (after) | {t_new:.3f} |")
    print(f"\nnew / old render: {t_new / t_old:.2f}x; added per demo run: {t_pre + t_fp + t_new - t_old:.2f} s")


if __name__ == "__main__":
    main()
