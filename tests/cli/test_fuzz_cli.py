"""Fuzz the command line (issue 15): a generated corpus of malformed and edge inputs and options.

Every case runs ``coalescence explain`` in-process on the tiny random Llama (``tiny_model_dir``) and
must end with exit code 0 or 2, no traceback on stderr, exactly one ``coalescence: error:`` line
after an exit 2, and nothing written to ``--archive`` or ``--out`` after an exit 2. The corpus:
wrong types in every field of every input form, missing fields, raw JSON texts (truncated, invalid
UTF-8, BOMs, NaN and Infinity literals, duplicate keys, deep nesting, huge numbers, huge texts),
JSONL files, bad declared spans, lone surrogates, RAG template files, and bad values for every
numeric option of ``explain``. Inputs that pass run with ``--method loo`` on small conversations.

Run with ``-s`` to see how many cases ran and the distribution of exit codes.
"""

from __future__ import annotations

import collections
import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from coalescence import cli

# -- the corpus ---------------------------------------------------------------------------------

CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Where is Paris? It is in Europe."},
        {"role": "assistant", "content": "In France."},
    ]
}
DECLARED = {
    "messages": [
        {"role": "user", "content": "Paris is in France. Rome is in Italy. Where is Paris?"},
        {"role": "assistant", "content": "France."},
    ],
    "players": [{"message": 0, "start": 0, "end": 19, "label": "paris"}, {"message": 0, "start": 20, "end": 37}],
}
RAG = {
    "documents": [{"id": "a", "title": "Paris", "text": "Paris is in France."}, {"id": 2, "text": "Rome is in Italy."}],
    "question": "Where is Paris?",
    "answer": "France.",
}
TOOLS = {
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny."},
        {"role": "assistant", "content": "Sunny."},
    ]
}
NO_TARGET = {"messages": [{"role": "user", "content": "Where is Paris?"}]}
BASES = {"chat": CHAT, "declared": DECLARED, "rag": RAG, "tools": TOOLS, "no-target": NO_TARGET}

# wrong values for a field: every JSON type, empty and odd ones (NaN is written as the literal)
WRONG = [None, True, 0, -1, 2.5, math.nan, "", "x", [], {}, [1, "a"], {"a": 1}]

RUN = ["--method", "loo", "--max-new-tokens", "3", "--no-progress"]


@dataclass
class Case:
    name: str
    input: str | bytes | None = None  # the input file's content (None: no file written)
    suffix: str = ".json"
    options: list[str] = field(default_factory=list)  # replaces RUN when given
    template: str | bytes | None = None  # a --template file's content


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _set(data: Any, path: tuple, value: Any, *, delete: bool = False) -> Any:
    data = copy.deepcopy(data)
    node = data
    for key in path[:-1]:
        node = node[key]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return data


def _dump(data: Any) -> str:
    return json.dumps(data)  # NaN becomes the literal NaN, as Python writes it


def field_cases() -> list[Case]:
    """Every field of every input form: each wrong value, and the field deleted."""
    cases = []
    for base_name, base in BASES.items():
        for path in _paths(base):
            name = base_name + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
            for k, value in enumerate(WRONG):
                cases.append(Case(f"{name}={value!r}#{k}", _dump(_set(base, path, value))))
            cases.append(Case(f"{name} deleted", _dump(_set(base, path, None, delete=True))))
        for value in WRONG:  # the whole input
            cases.append(Case(f"{base_name} whole={value!r}", _dump(value)))
    return cases


def raw_cases() -> list[Case]:
    good = _dump(CHAT)
    texts: dict[str, str | bytes] = {f"truncated at {n}": good[:n] for n in (0, 1, 2, 13, 14, 30, 60, 90, len(good) - 1)}
    texts |= {
        "whitespace": " \n\t ",
        "null": "null",
        "string": '"x"',
        "number": "1",
        "true": "true",
        "array": "[]",
        "object": "{}",
        "trailing garbage": good + " x",
        "two objects": good + good,
        "comment": "// c\n" + good,
        "single quotes": good.replace('"', "'"),
        "trailing comma": good[:-1] + ",}",
        "NaN": "NaN",
        "Infinity start": good.replace('"messages"', '"start": Infinity, "messages"'),
        "NaN content": good.replace('"Be brief."', "NaN"),
        "-Infinity target": good[:-1] + ', "target": -Infinity}',
        "NaN in tool arguments": _dump(TOOLS).replace('"{\\"city\\": \\"Paris\\"}"', '{"city": NaN}'),
        "1e999 in tool arguments": _dump(TOOLS).replace('"{\\"city\\": \\"Paris\\"}"', '{"n": 1e999}'),
        "duplicate messages": good[:-1] + ', "messages": []}',
        "duplicate role": good.replace('"role": "system"', '"role": "system", "role": "user"'),
        "duplicate player key": _dump(DECLARED).replace('"end": 19', '"end": 19, "end": 3'),
        "duplicate document id key": _dump(RAG).replace('"id": "a"', '"id": "a", "id": "b"'),
        "deep 50 tool arguments": _dump(TOOLS).replace('"{\\"city\\": \\"Paris\\"}"', '{"a": ' * 50 + "1" + "}" * 50),
        "deep 101": '{"messages": ' + "[" * 101 + "]" * 101 + "}",
        "deep 1000": "[" * 1000 + "]" * 1000,
        "deep 100000": "[" * 100_000,
        "deep objects 3000": '{"a": ' * 3000 + "1" + "}" * 3000,
        "5000-digit start": _dump(DECLARED).replace('"start": 0', '"start": ' + "1" * 5000),
        "5000-digit negative end": _dump(DECLARED).replace('"end": 19', '"end": -' + "9" * 5000),
        "400-digit message": _dump(DECLARED).replace('"message": 0', '"message": ' + "9" * 400, 1),
        "1e400 start": _dump(DECLARED).replace('"start": 0', '"start": 1e400'),
        "-0 start": _dump(DECLARED).replace('"start": 0', '"start": -0'),
        "0.0 start": _dump(DECLARED).replace('"start": 0', '"start": 0.0'),
        "control char in string": good.replace("Be brief.", "Be\u0001brief."),
        "escaped control chars": good.replace("Be brief.", "Be\\u0000\\u001f\\u007f brief."),
        "lone low surrogate": good.replace("Be brief.", "\\udc00"),
        "reversed surrogates": good.replace("Be brief.", "\\ude00\\ud83d"),
        "valid surrogate pair": good.replace("Be brief.", "\\ud83d\\ude00"),
        "unicode separators": good.replace("Be brief.", "Be\u2028brief.\u0085\u2029"),
        "many messages": _dump({"messages": [{"role": "user", "content": "Hi."}] * 3000 + [{"role": "assistant", "content": "Yo."}]}),
    }
    encoded: dict[str, bytes] = {
        "utf-8 BOM": b"\xef\xbb\xbf" + good.encode(),
        "double BOM": b"\xef\xbb\xbf\xef\xbb\xbf" + good.encode(),
        "utf-16 with BOM": good.encode("utf-16"),
        "utf-16-le": good.encode("utf-16-le"),
        "utf-32": good.encode("utf-32"),
        "latin-1": good.replace("Be brief.", "Soyez brèf.").encode("latin-1"),
        "invalid start byte": good.replace("Be brief.", "\x00").encode().replace(b"\x00", b"\xff"),
        "overlong slash": good.encode().replace(b"Be brief.", b"\xc0\xaf"),
        "lone continuation": good.encode().replace(b"Be brief.", b"\x80"),
        "cesu surrogate": good.encode().replace(b"Be brief.", b"\xed\xa0\xbd"),
        "truncated sequence": good.encode().replace(b"Be brief.", b"\xe2\x82"),
        "NUL bytes": good.encode().replace(b" ", b"\x00", 1),
    }
    cases = [Case(f"raw {k}", v) for k, v in texts.items()] + [Case(f"bytes {k}", v) for k, v in encoded.items()]
    # a huge message: refused early under exact (sentence, word), run as one player under turn+loo
    huge = _dump({"messages": [{"role": "user", "content": "The tower is tall. " * 60_000}], "target": "Yes."})
    cases += [
        Case("huge sentence exact", huge, options=["--unit", "sentence", "--method", "exact", "--no-progress"]),
        Case("huge word exact", huge, options=["--unit", "word", "--method", "exact", "--no-progress"]),
        Case("huge paragraph loo", huge, options=["--unit", "paragraph", *RUN]),
    ]
    return cases


def jsonl_cases() -> list[Case]:
    a, b = _dump(CHAT), _dump(RAG)
    lines = {
        "two inputs": f"{a}\n{b}\n",
        "crlf": f"{a}\r\n{b}\r\n",
        "blank lines": f"\n\n{a}\n   \n\t\n{b}",
        "no final newline": f"{a}\n{b}",
        "only blank": "\n \n\r\n",
        "empty": "",
        "bad second line": f"{a}\n{{\n",
        "bad field on line 2": f"{a}\n" + _dump(_set(RAG, ("question",), 5)),
        "null line": f"{a}\nnull\n",
        "array line": f"{a}\n[]\n",
        "u2028 in content": _dump(_set(CHAT, ("messages", 1, "content"), "A\u2028B\u0085C")).replace("\\u2028", "\u2028").replace("\\u0085", "\u0085"),
        "bom on line 2": f"{a}\n\ufeff{b}\n",
        "pretty printed": json.dumps(CHAT, indent=2),
        "cr only": f"{a}\r{b}\r",
        "form feed line": f"{a}\n\x0c\n{b}",
        "deep line": f"{a}\n" + "[" * 5000 + "]" * 5000 + "\n",
        "5000 digits line": f"{a}\n" + "1" * 5000 + "\n",
        "surrogate line 2": f"{a}\n" + b.replace("Rome", "\\ud800"),
    }
    return [Case(f"jsonl {k}", v, suffix=".jsonl") for k, v in lines.items()]


def span_cases() -> list[Case]:
    """Declared spans: every (start, end) pair of edge values on the first player."""
    values: list[Any] = [-1, 0, 1, 19, 52, 53, 10**6, "3", 3.0, None, True]
    cases = []
    for start in values:
        for end in values:
            data = _set(_set(DECLARED, ("players", 0, "start"), start), ("players", 0, "end"), end)
            cases.append(Case(f"span {start!r}:{end!r}", _dump(data)))
    for message in (-1, 1, 2, "0", 0.0, None):
        cases.append(Case(f"span message {message!r}", _dump(_set(DECLARED, ("players", 1, "message"), message))))
    overlapping = _set(DECLARED, ("players", 1, "start"), 10)
    cases.append(Case("span overlap", _dump(overlapping)))
    cases.append(Case("span same twice", _dump(_set(DECLARED, ("players", 1), DECLARED["players"][0]))))
    return cases


LONE = "\ud83d"


def surrogate_cases() -> list[Case]:
    places = [
        ("chat", ("messages", 0, "content")),
        ("chat", ("messages", 2, "content")),
        ("chat", ("target",)),
        ("declared", ("players", 0, "label")),
        ("rag", ("documents", 0, "text")),
        ("rag", ("documents", 0, "title")),
        ("rag", ("documents", 0, "id")),
        ("rag", ("question",)),
        ("rag", ("answer",)),
        ("tools", ("messages", 1, "tool_calls", 0, "function", "name")),
        ("tools", ("messages", 1, "tool_calls", 0, "function", "arguments")),
        ("tools", ("messages", 1, "tool_calls", 0, "id")),
        ("tools", ("messages", 2, "tool_call_id")),
        ("chat", ("messages", 0, "role")),
    ]
    return [Case(f"surrogate {base}.{path}", json.dumps(_set(BASES[base], path, f"a{LONE}b"))) for base, path in places]


def template_cases() -> list[Case]:
    good = {"system": "", "user": "{documents}\n{question}", "document": "[{id}] {text}", "separator": "\n"}
    templates: dict[str, str | bytes] = {
        "good": _dump(good),
        "empty object": "{}",
        "not an object": "[]",
        "invalid json": "{",
        "empty file": "",
        "utf-16": _dump(good).encode("utf-16"),
        "invalid utf-8": b'{"system": "\xff"}',
        "deep": '{"system": ' + "[" * 5000 + "]" * 5000 + "}",
        "5000 digits": '{"system": ' + "1" * 5000 + "}",
        "duplicate key": '{"system": "a", "system": "b"}',
        "unknown key": '{"colour": "red"}',
        "surrogate": json.dumps({"system": LONE}),
        "NaN": '{"separator": NaN}',
    }
    for key in good:
        for k, value in enumerate(WRONG):
            templates[f"{key}={value!r}#{k}"] = _dump(good | {key: value})
    for document in ["{text} {title.upper}", "{text} {title[x]}", "{text} {title:>2000000000}", "{text} {id!r}",
                     "{text} {0}", "{text} {}", "{text} {id", "{text} }", "{text}{text}", "no text", "{{text}}"]:
        templates[f"document {document!r}"] = _dump(good | {"document": document})
    for user in ["{question}", "{documents}", "{documents}{documents}{question}", "{documents} {question} {x}", "{{documents}} {question}"]:
        templates[f"user {user!r}"] = _dump(good | {"user": user})
    return [Case(f"template {k}", _dump(RAG), template=v) for k, v in templates.items()]


# bad numbers for every numeric option of explain, each in a setting where it applies
NUMBERS = ["0", "-1", "1", "3", "1.5", "nan", "inf", "-inf", "1e309", "abc", "", " 2", "0x10", "1_0", "-0",
           "99999999999999999999", "9" * 5000]
NUMERIC_OPTIONS = {
    "--batch-size": RUN,
    "--budget": ["--method", "permutation", "--no-progress"],
    "--seed": ["--method", "permutation", "--budget", "8", "--no-progress"],
    "--top-k": ["--hierarchy", "turn,sentence", *RUN],
    "--target-stderr": ["--method", "permutation", "--budget", "8", "--no-progress"],
    "--max-new-tokens": ["--utility", "exact_match", *RUN[:2], "--no-progress"],
    "--temperature": ["--utility", "token_f1", *RUN],
    "--top-p": ["--utility", "token_f1", "--temperature", "1", *RUN],
    "--num-samples": ["--utility", "token_f1", "--temperature", "1", *RUN],
    "--flush-rows": RUN,
    "--flush-seconds": RUN,
}
OTHER_OPTIONS = {
    "--target-span": ["0:1", "1:0", "-1:2", "0:999", "a:b", ":", "", "1:2:3", "nan:1", "0:", "1e3:2000", "99999999999999999999:1",
                      "9" * 5000 + ":1", "0:" + "9" * 5000, "0 :1"],
    "--target-substring": ["In", "zz", "", LONE, "In France.", "France.x"],
    "--roles": ["", ",", "user", "robot", "user,user", "tool", "system, user", "USER"],
    "--hierarchy": ["turn,sentence", "sentence,turn", "a,b", "turn", "turn,turn", "", ",", "document,word"],
    "--device": ["cpu", "cuda", "foo", "", "cpu:99", "meta", "mps", "hpu", "cuda:-1"],
    "--dtype": ["int8", ""],
    "--utility": ["nope", ""],
    "--method": ["nope", ""],
    "--unit": ["nope", ""],
    "--absence-policy": ["nope"],
    "--placeholder": ["", LONE, "x" * 10000],
    "--template": ["missing.json"],
}


def option_cases() -> list[Case]:
    chat, no_target = _dump(CHAT), _dump(NO_TARGET)
    cases = []
    for option, context in NUMERIC_OPTIONS.items():
        source = no_target if option == "--max-new-tokens" else chat
        for i, value in enumerate(NUMBERS):
            cases.append(Case(f"{option} #{i} {value[:20]!r}", source, options=[*context, option, value]))
    for option, values in OTHER_OPTIONS.items():
        for i, value in enumerate(values):
            extra = ["--absence-policy", "placeholder"] if option == "--placeholder" else []
            cases.append(Case(f"{option} #{i} {value[:20]!r}", chat, options=[*RUN, *extra, option, value]))
    units = ["turn", "paragraph", "sentence", "word", "tool", "document"]
    methods = ["exact", "permutation", "kernelshap", "banzhaf", "lasso", "loo"]
    small = {  # at most 4 players in any unit, so that exact and the samplers stay fast
        "chat": {"messages": [{"role": "system", "content": "Hi."}, {"role": "user", "content": "Paris?"}], "target": "France."},
        "declared": {"messages": [{"role": "user", "content": "Paris. Rome."}], "target": "France.",
                     "players": [{"message": 0, "start": 0, "end": 6}]},
    }
    for unit in units:
        for method in methods:
            for base, data in small.items():
                cases.append(Case(f"{base} {unit} {method}", _dump(data),
                                  options=["--unit", unit, "--method", method, "--budget", "8", "--no-progress"]
                                  if method not in ("exact", "loo") else ["--unit", unit, "--method", method, "--no-progress"]))
    cases.append(Case("budget with loo", chat, options=[*RUN, "--budget", "5"]))
    cases.append(Case("top-k without hierarchy", chat, options=[*RUN, "--top-k", "2"]))
    cases.append(Case("hierarchy with unit", chat, options=[*RUN, "--hierarchy", "turn,sentence", "--unit", "turn"]))
    cases.append(Case("stderr with loo", chat, options=[*RUN, "--target-stderr", "0.1"]))
    cases.append(Case("span and substring", chat, options=[*RUN, "--target-span", "0:1", "--target-substring", "In"]))
    cases.append(Case("temperature with logprob", chat, options=[*RUN, "--temperature", "0.5"]))
    cases.append(Case("system-absent with placeholder", chat, options=[*RUN, "--absence-policy", "placeholder", "--system-absent", "empty"]))
    cases.append(Case("unknown option", chat, options=[*RUN, "--nope"]))
    cases.append(Case("no input file", None, options=RUN))
    return cases


# Known gaps owned elsewhere: the case still must exit 0 or 2 without a traceback, but its "nothing
# written after exit 2" check is skipped, with the reason.
WRITES_BEFORE_REFUSAL: dict[str, str] = {}  # none: every coalition is rendered before the model loads

CORPUS = field_cases() + raw_cases() + jsonl_cases() + span_cases() + surrogate_cases() + template_cases() + option_cases()


# -- the run ----------------------------------------------------------------------------------


def _files_under(path: Path) -> list[str]:
    if not path.exists():
        return []
    return sorted(str(p) for p in [path, *path.rglob("*")])


def test_fuzz_corpus_size():
    assert len(CORPUS) >= 500
    assert len({c.name for c in CORPUS}) == len(CORPUS)
    assert set(WRITES_BEFORE_REFUSAL) <= {c.name for c in CORPUS}


def test_every_fuzz_case_exits_0_or_2_cleanly(tmp_path, tiny_model_dir, monkeypatch, capsys):
    # Test-only: load the tiny model once per (device, dtype, batch size) and reuse it across runs;
    # app.explain.load_model is an explain run's one call into the loader, and the engine never closes
    # a backend.
    from coalescence.app import explain as explain_module

    loaded: dict[tuple, Any] = {}
    real_load = explain_module.load_model

    def load_once(settings, source, **preloaded):
        key = (source.location, settings.device, settings.dtype, settings.batch_size)
        if key not in loaded:
            loaded[key] = real_load(settings, source, **preloaded)
        return loaded[key]

    monkeypatch.setattr(explain_module, "load_model", load_once)
    monkeypatch.chdir(tmp_path)  # a default archive (runs/...) would land here: checked empty below
    codes: collections.Counter[Any] = collections.Counter()
    failures: list[str] = []
    for k, case in enumerate(CORPUS):
        work = tmp_path / f"case{k}"
        work.mkdir()
        source = work / f"input{case.suffix}"
        if case.input is not None:
            if isinstance(case.input, bytes):
                source.write_bytes(case.input)
            else:
                source.write_text(case.input, encoding="utf-8", errors="surrogatepass")
        options = list(case.options or RUN)
        if case.template is not None:
            template = work / "template.json"
            if isinstance(case.template, bytes):
                template.write_bytes(case.template)
            else:
                template.write_text(case.template, encoding="utf-8", errors="surrogatepass")
            options += ["--template", str(template)]
        options = [str(work / o) if o == "missing.json" else o for o in options]
        run_dir, out = work / "run", work / "out.json"
        argv = ["explain", str(source), "--model", str(tiny_model_dir), *options, "--archive", str(run_dir), "--out", str(out)]
        try:
            code = cli.main(argv)
        except SystemExit as exc:  # argparse
            code = exc.code
        except BaseException as exc:  # noqa: BLE001 - any escape is a failure of the contract
            code = f"raised {type(exc).__name__}"
            failures.append(f"{case.name}: {type(exc).__name__}: {str(exc)[:200]}")
        captured = capsys.readouterr()
        codes[code] += 1
        if code not in (0, 2):
            if not str(code).startswith("raised"):
                failures.append(f"{case.name}: exit {code}: {captured.err.strip()[-300:]}")
            continue
        if "Traceback" in captured.err:
            failures.append(f"{case.name}: traceback on stderr: {captured.err[-300:]}")
        if code == 2:
            lines = captured.err.strip().splitlines()
            if len(lines) != 1 or not lines[0].startswith("coalescence: error: "):
                failures.append(f"{case.name}: exit 2 without one error line: {captured.err[-300:]!r}")
            written = _files_under(run_dir) + _files_under(out)
            if written and case.name not in WRITES_BEFORE_REFUSAL:
                failures.append(f"{case.name}: exit 2 but wrote {written[:3]}")
        elif not (run_dir / "manifest.json").is_file() or not out.is_file():
            failures.append(f"{case.name}: exit 0 without the archive and the JSON document")
    assert not (tmp_path / "runs").exists()
    with capsys.disabled():
        print(f"\nfuzz: {len(CORPUS)} cases, exit codes {dict(sorted(codes.items(), key=str))}, "
              f"model loads {len(loaded)}, failures {len(failures)}")
    assert not failures, "\n".join(failures[:40]) + (f"\n... {len(failures) - 40} more" if len(failures) > 40 else "")


# -- the kinds the fuzz found, each pinned with its field -------------------------------------


@pytest.mark.parametrize(
    ("data", "options", "field"),
    [
        # the answer is generated first: 600 new tokens cannot fit the tiny model's context of 512
        (NO_TARGET, ["--max-new-tokens", "600"], "--max-new-tokens"),
        (NO_TARGET, ["--max-new-tokens", "99999999999999999999"], "--max-new-tokens"),  # generated for ever before
        # every coalition's answer is generated anew
        (CHAT, ["--utility", "exact_match", "--max-new-tokens", "500"], "--max-new-tokens"),
        (CHAT, ["--device", "meta"], "--device"),  # exit 1 "model call failed" before
        (CHAT, ["--device", "hpu"], "--device"),
        (CHAT, ["--utility", "token_f1", "--temperature", "1", "--num-samples", "1025"], "--num-samples"),  # 11 GB before
    ],
)
def test_found_by_the_fuzz(tmp_path, tiny_model_dir, capsys, data, options, field):
    source = tmp_path / "in.json"
    source.write_text(json.dumps(data))
    run_dir, out = tmp_path / "run", tmp_path / "out.json"
    argv = ["explain", str(source), "--model", str(tiny_model_dir), "--method", "loo", "--no-progress", *options,
            "--archive", str(run_dir), "--out", str(out)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"coalescence: error: {field}: ") and err.count("\n") == 1, err
    assert not run_dir.exists() and not out.exists()
