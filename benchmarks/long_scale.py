"""A long document with about 300 sentence players, explained through the CLI: wall time, peak memory,
archive size and what the progress bar says.

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/long_scale.py [--budget 32] [--players 300]
        [--backend hf] [--batch-size 16] [--out runs/long_scale]

The input is built from the shipped long games (``benchmarks/data/long_*.json``) and the
12-document RAG game (``rag12_stdlib.json``): their contexts joined by blank lines, in that order,
cut after the sentence that reaches ``--players`` players or the model's context (SmolLM2-135M:
8,192 positions, answer and template included, so about 7,900 context tokens). The question and
answer are ``long_unicode``'s. The run is one ``coalescence explain ... --unit sentence --budget B``
in a child process (``--method auto``: the sparse surrogate at this many players and budget), with
an archive; peak memory is the child's maximum resident set (``getrusage(RUSAGE_CHILDREN)``),
which includes the model, the prefix cache (its 1 GiB bound), masks and archive buffers.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "data"
SOURCES = ("long_unicode", "long_design", "long_glossary")


def _contexts() -> list[str]:
    out = []
    for name in SOURCES:
        raw = json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))
        (span,) = raw["players"]
        out.append(raw["messages"][span["message"]]["content"][span["start"] : span["end"]])
    rag = json.loads((DATA / "rag12_stdlib.json").read_text(encoding="utf-8"))
    out += [d["text"] for d in rag.get("documents", [])]
    return out


def build(players: int, limit_tokens: int) -> dict:
    """The input record: long_unicode's system prompt, question and answer around the joined contexts,
    cut to ``players`` sentences and ``limit_tokens`` tokens of the whole rendered conversation."""
    from coalescence import segment_players
    from coalescence.conversation import Conversation

    base = json.loads((DATA / "long_unicode.json").read_text(encoding="utf-8"))
    system, user, answer = (m["content"] for m in base["messages"])
    head = user[: base["players"][0]["start"]]
    context = "\n\n".join(_contexts())
    record = _record(system, head, context, answer)
    conv = Conversation.from_dict(record)
    spans = [(p.start - len(head), p.end - len(head)) for p in segment_players(conv, unit="sentence")]
    cut = spans[min(players, len(spans)) - 1][1]
    tokenizer = _tokenizer()
    while True:
        record = _record(system, head, context[:cut], answer)
        n_tokens = count_tokens(tokenizer, record)
        if n_tokens <= limit_tokens:
            return record
        cut = max(end for start, end in spans if end < cut)


def _record(system: str, head: str, context: str, answer: str) -> dict:
    user = head + context
    return {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}, {"role": "assistant", "content": answer}],
        "players": [{"message": 1, "start": len(head), "end": len(user), "label": "ctx"}],
    }


def count_tokens(tokenizer, record: dict) -> int:
    """Tokens of the whole rendered conversation (template, context and answer)."""
    text = tokenizer.apply_chat_template(record["messages"], tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _tokenizer():
    from coalescence import load_backend

    return load_backend("smollm2-135m").tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--players", type=int, default=300)
    ap.add_argument("--limit-tokens", type=int, default=8000, help="the rendered conversation's tokens at most")
    ap.add_argument("--backend", default="hf", choices=("hf", "vllm"))
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "runs" / "long_scale"))
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    record = build(args.players, args.limit_tokens)
    (out / "input.json").write_text(json.dumps(record, ensure_ascii=False), encoding="utf-8")
    tokens = count_tokens(_tokenizer(), record)
    cmd = [
        str(Path(sys.executable).parent / "coalescence"), "explain", str(out / "input.json"), "--model", "smollm2-135m",
        "--backend", args.backend, "--unit", "sentence", "--budget", str(args.budget), "--batch-size", str(args.batch_size),
        "--archive", str(out / "run"), "--out", str(out / "explanation.json"),
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB -> GiB
    if proc.returncode != 0:
        raise SystemExit(f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    explanation = json.loads((out / "explanation.json").read_text())  # one conversation: one explanation
    archive_bytes = sum(p.stat().st_size for p in (out / "run").rglob("*") if p.is_file())
    bar = [line for line in proc.stderr.replace("\r", "\n").splitlines() if "%|" in line]
    print("| players | tokens | budget | backend | method | wall s | peak RSS GiB | archive MiB |")
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {len(explanation['players'])} | {tokens} | {args.budget} | {args.backend} | {explanation['method']} | "
        f"{wall:.0f} | {peak:.2f} | {archive_bytes / 2**20:.2f} |"
    )
    print(f"\nwall seconds in the explanation: {explanation['wall_seconds']:.0f}; progress bar, first and last:")
    print("\n".join(bar[:1] + bar[-1:]))


if __name__ == "__main__":
    main()
