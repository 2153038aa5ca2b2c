"""Prefix-split attention against one sdpa call, forward by forward (SmolLM2-135M, CPU).

For each shape (prefix keys P already in the cache, N new tokens, continuation = causal, tree = a
two-branch trie under a shared stem), one forward of the N tokens on a copy of the cached prefix,
with the backend's masks: sdpa (one call, the dense mask over P + N keys) and the split
(``coalescence.backends.attention``: prefix part unmasked without copies of its keys, local part
causal or tree-masked, merged by log-sum-exp). Interleaved, best of ``--repeats``; the speed-up is
sdpa time / split time, and max |dlogit| the largest difference of the two forwards' logits.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/split_attention.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from transformers import DynamicCache

from coalescence import load_backend
from coalescence.backends.attention import NAME, PrefixSplit

SHAPES = [  # prefix keys, new tokens, kind
    (300, 600, "continuation"),
    (1400, 900, "continuation"),
    (2000, 600, "continuation"),
    (700, 1400, "tree"),
    (2000, 600, "tree"),
    (2500, 120, "tree"),
    (2450, 24, "tree"),
]


def tree(n: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A stem of n/4 nodes, then two branches: the additive mask [1, 1, n, p + n] and positions."""
    stem = n // 4
    half = stem + (n - stem) // 2
    seen = torch.ones(n, n, dtype=torch.bool).tril()
    seen[half:, stem:half] = False
    mask = torch.zeros((1, 1, n, p + n))
    mask[0, 0, :, p:].masked_fill_(~seen, torch.finfo(torch.float32).min)
    depth = list(range(half)) + list(range(stem, stem + n - half))
    return mask, (p + torch.tensor(depth))[None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    backend = load_backend("smollm2-135m", max_batch_size=1)
    model = backend.model
    assert model.config._attn_implementation == NAME, "prefix-split attention is not installed"
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| kind | prefix keys | new tokens | sdpa tokens/s | split tokens/s | speed-up | max \\|dlogit\\| |")
    print("|:---|---:|---:|---:|---:|---:|---:|")
    for p, n, kind in SHAPES:
        ids = torch.randint(100, 5000, (1, p + n))
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            model(input_ids=ids[:, :p], cache=cache, use_cache=True, logits_to_keep=1)
            if kind == "continuation":
                mask, positions = torch.ones((1, p + n), dtype=torch.long), torch.arange(p, p + n)[None]
            else:
                mask, positions = tree(n, p)
            keep = torch.tensor([n // 2, n - 1])

            def forward(split: bool) -> tuple[float, torch.Tensor]:
                extra = {"prefix_split": PrefixSplit(p, kind == "continuation")} if split else {}
                state = copy.deepcopy(cache)
                t0 = time.perf_counter()
                out = model(input_ids=ids[:, p:], attention_mask=mask, position_ids=positions, cache=state,
                            use_cache=True, logits_to_keep=keep, **extra)  # fmt: skip
                return time.perf_counter() - t0, out.logits[0]

            forward(False), forward(True)  # warm-up
            best = {False: float("inf"), True: float("inf")}
            logits = {}
            for _ in range(args.repeats):
                for split in (False, True):
                    t, logits[split] = forward(split)
                    best[split] = min(best[split], t)
        d = float((logits[True] - logits[False]).abs().max())
        print(f"| {kind} | {p:,} | {n:,} | {n / best[False]:,.0f} | {n / best[True]:,.0f} | {best[False] / best[True]:.2f} | {d:.1e} |")


if __name__ == "__main__":
    main()
