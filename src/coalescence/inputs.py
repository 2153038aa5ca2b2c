"""Input forms: chat messages (with optional declared players), the RAG form, and JSONL batches.

Three shapes of one input (a JSON object):

- ``{"messages": [...], "target"?}``: OpenAI chat messages (see
  :meth:`~coalescence.conversation.Conversation.from_dict`).
- the same with ``"players": [{"message": i, "start": a, "end": b, "label"?}]``: character spans
  of prompt messages that are the players (``--unit document``; finer units split inside them).
- the RAG form ``{"documents": [{"id", "title"?, "text"}], "question": "...", "answer"?: "..."}``:
  rendered into chat messages through a :class:`RagTemplate`, each document one declared player
  (its whole rendered block, header included).

A ``.jsonl`` file holds one input per line (:func:`load_inputs`); each becomes its own snapshot.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .conversation import Conversation
from .errors import ConfigError, InputError
from .registry import Registry
from .userinput import check_text, parse_json, refuse_misspelt_fields, short_repr

__all__ = (
    "DEFAULT_RAG_TEMPLATE",
    "READERS",
    "RagTemplate",
    "conversation_from_input",
    "load_conversation",
    "load_inputs",
    "load_template",
    "on_line",
    "read_source",
    "register_reader",
    "rows_to_conversations",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class RagTemplate:
    """How the RAG form becomes chat messages.

    The user message is ``user`` with ``{documents}`` replaced by the document blocks joined with
    ``separator`` and ``{question}`` by the question; each block is ``document`` with ``{id}``,
    ``{title}`` and ``{text}`` replaced (``str.format`` fields, plain: no index, attribute,
    conversion or format spec; write ``{{`` for a literal brace).
    A non-empty ``system`` becomes a system message before it. The answer, when given, is the
    target.

    Args:
        system: system message text, or ``""`` for none.
        user: user message template; must contain ``{documents}`` and ``{question}`` once each.
        document: one document's block; must contain ``{text}``.
        separator: text between two document blocks.

    Raises:
        InputError: a template that lacks a required field, a ``document`` field other than plain
            ``{id}``, ``{title}``, ``{text}``, or a value that is not Unicode text (field
            ``--template``).
    """

    system: str = "Answer the question using only the documents below."
    user: str = "{documents}\n\nQuestion: {question}"
    document: str = "Document [{id}] {title}\n{text}"
    separator: str = "\n\n"

    def __post_init__(self) -> None:
        for name in ("system", "user", "document", "separator"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise InputError(f"{name!r} must be a string, got {short_repr(value)}", field="template")
            try:
                check_text(value, name)
            except InputError as exc:
                raise InputError(f"{name!r} {exc.message}", field="template") from None
        for key in ("{documents}", "{question}"):
            if self.user.count(key) != 1:
                raise InputError(f"'user' must contain {key} exactly once, got {short_repr(self.user)}", field="template")
        try:
            fields = [(name, spec, conversion) for _, name, spec, conversion in string.Formatter().parse(self.document) if name is not None]
        except ValueError as exc:  # a lone brace
            raise InputError(f"'document' is not a format string: {exc}; write {{{{ and }}}} for braces", field="template") from None
        if [name for name, _, _ in fields].count("text") != 1:
            raise InputError(f"'document' must contain {{text}} exactly once, got {short_repr(self.document)}", field="template")
        for name, spec, conversion in fields:
            if name not in ("id", "title", "text") or spec or conversion:
                shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
                raise InputError(
                    f"'document' may use the fields {{id}}, {{title}} and {{text}} only, plainly (no index, "
                    f"attribute, conversion or format spec); got {short_repr(shown)}",
                    field="template",
                )

    def render(self, documents: list[dict[str, str]], question: str) -> tuple[str, list[tuple[int, int]]]:
        """The user message text and each document block's ``(start, end)`` span in it."""
        def fill(side: str) -> str:
            side = side.replace("{question}", "\0q\0").replace("{{", "{").replace("}}", "}")
            return side.replace("\0q\0", question)

        before, after = self.user.split("{documents}")
        head, tail = fill(before), fill(after)
        parts, spans = [head], []
        cursor = len(head)
        for k, doc in enumerate(documents):
            if k:
                parts.append(self.separator)
                cursor += len(self.separator)
            block = self.document.format(id=doc["id"], title=doc["title"], text=doc["text"])  # fields checked above
            parts.append(block)
            spans.append((cursor, cursor + len(block)))
            cursor += len(block)
        parts.append(tail)
        return "".join(parts), spans


DEFAULT_RAG_TEMPLATE = RagTemplate()
"""The default RAG template (documented in docs/input.md)."""


def load_template(path: str | Path | None) -> RagTemplate:
    """Read a :class:`RagTemplate` from a JSON file ``{"system"?, "user"?, "document"?,
    "separator"?}`` (missing keys take the defaults); ``None`` gives the default template.

    Raises:
        InputError: unreadable file, invalid JSON, unknown keys or a bad template (``--template``).
    """
    if path is None:
        return DEFAULT_RAG_TEMPLATE
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read the template {str(path)!r}: {exc}", field="template") from exc
    data = parse_json(text, what=f"the template {Path(path).name}", field="template")
    if not isinstance(data, Mapping):
        raise InputError("the template must be a JSON object", field="template")
    unknown = sorted(set(data) - {"system", "user", "document", "separator"})
    if unknown:
        raise InputError(f"unknown key {short_repr(unknown[0])}; use system, user, document, separator", field="template")
    return RagTemplate(**data)


CHAT_FIELDS = ("messages", "target", "players")
"""The chat form's fields (an input's other fields are ignored, but a near miss of these is refused)."""

RAG_FIELDS = ("documents", "question", "answer")
"""The RAG form's fields."""

DOCUMENT_FIELDS = ("id", "title", "text")
"""A RAG document's fields."""


def _rag_input(data: Mapping[str, Any], template: RagTemplate) -> dict[str, Any]:
    """The RAG form as a chat input with declared players (one per document)."""
    docs = data.get("documents")
    if not isinstance(docs, list) or not docs:
        raise InputError('must be a non-empty list of {"id", "title"?, "text"}', field="documents")
    clean: list[dict[str, str]] = []
    ids: set[str] = set()
    for i, doc in enumerate(docs):
        where = f"documents[{i}]"
        if not isinstance(doc, Mapping):
            raise InputError('must be an object {"id", "title"?, "text"}', field=where)
        refuse_misspelt_fields(doc, DOCUMENT_FIELDS, f"{where}.")
        text = doc.get("text")
        if not isinstance(text, str):
            raise InputError(f"must be a string, got {type(text).__name__}", field=f"{where}.text")
        check_text(text, f"{where}.text")
        doc_id = doc.get("id", str(i))
        if not isinstance(doc_id, (str, int)) or isinstance(doc_id, bool):
            raise InputError(f"must be a string, got {short_repr(doc_id)}", field=f"{where}.id")
        doc_id = check_text(str(doc_id), f"{where}.id")
        if doc_id in ids:
            raise InputError(f"duplicate document id {short_repr(doc_id)}; ids must be unique", field=f"{where}.id")
        ids.add(doc_id)
        title = doc.get("title", "")
        if not isinstance(title, str):
            raise InputError(f"must be a string, got {type(title).__name__}", field=f"{where}.title")
        check_text(title, f"{where}.title")
        clean.append({"id": doc_id, "title": title, "text": text})
    question = data.get("question")
    if not isinstance(question, str) or not question.strip():
        raise InputError("must be a non-empty string", field="question")
    check_text(question, "question")
    user, spans = template.render(clean, question)
    messages = [{"role": "system", "content": template.system}] if template.system else []
    m = len(messages)
    messages.append({"role": "user", "content": user})
    out: dict[str, Any] = {
        "messages": messages,
        "players": [
            {"message": m, "start": a, "end": b, "label": f"doc[{d['id']}]"} for d, (a, b) in zip(clean, spans, strict=True)
        ],
    }
    answer = data.get("answer")
    if answer is not None:
        if not isinstance(answer, str):
            raise InputError(f"must be a string, got {type(answer).__name__}", field="answer")
        check_text(answer, "answer")
        out["target"] = answer
    return out


def conversation_from_input(data: Any, template: RagTemplate | None = None) -> Conversation:
    """Build a conversation from one parsed input object, in any of the forms (module docs).

    Args:
        data: the parsed JSON object.
        template: the RAG template (default :data:`DEFAULT_RAG_TEMPLATE`).

    Raises:
        InputError: naming the field at fault (``documents[2].text``, ``players[1].end``, ...).
    """
    if isinstance(data, Mapping) and "documents" in data:
        if "messages" in data:
            raise InputError('give either "messages" or the RAG form "documents", not both', field="documents")
        refuse_misspelt_fields(data, RAG_FIELDS)
        data = _rag_input(data, template or DEFAULT_RAG_TEMPLATE)
    elif isinstance(data, Mapping):
        refuse_misspelt_fields(data, CHAT_FIELDS)
    return Conversation.from_dict(data)


def _prefixed(exc: InputError | ConfigError, line: int) -> InputError | ConfigError:
    field = f"line {line}: {exc.field}" if exc.field else f"line {line}"
    return (ConfigError if isinstance(exc, ConfigError) else InputError)(exc.message, field=field)


def on_line(k: int, is_batch: bool, check: Callable[..., Any], *args: Any) -> Any:
    """Run ``check(*args)`` for input ``k`` (0-based); in a JSONL batch (``is_batch``) an
    :class:`~coalescence.errors.InputError` or :class:`~coalescence.errors.ConfigError` it raises
    (a setting this input cannot take, e.g. ``max_new_tokens`` past its context) names the input's
    line (field ``line N: FIELD``), as the reader's own errors do.

    Raises:
        InputError, ConfigError: ``check``'s, with the line in its field in a batch.
    """
    try:
        return check(*args)
    except (InputError, ConfigError) as exc:
        if not is_batch:
            raise
        raise _prefixed(exc, k + 1) from None


def _absent_nulls(value: Any) -> Any:
    """A table's cell as the JSON input it stands for: a null struct field is an absent field
    (Parquet gives every row's struct every field any row has), except ``content``, whose null
    is a value (an assistant message that only calls tools). A NaN is a null, inside a record as
    in a cell (pandas writes NaN for a missing value in an object column and in its records)."""
    if _is_null(value):
        return None
    if isinstance(value, Mapping):
        return {k: _absent_nulls(v) for k, v in value.items() if not _is_null(v) or k == "content"}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ndarray":  # pandas keeps Arrow lists as arrays
        return [_absent_nulls(v) for v in value]
    return value


def _parquet_inputs(path: Path, template: RagTemplate | None) -> list[Conversation]:
    """The conversations of a Parquet dataset: one row per conversation, the input's fields as
    columns (see :func:`rows_to_conversations`). Errors name the row (``row 3: messages[1].content``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except FileNotFoundError:
        raise InputError(f"no such file {str(path)!r}", field="input") from None
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"cannot read {str(path)!r} as Parquet: {' '.join(str(exc).split())}", field="input") from exc
    return rows_to_conversations(table.column_names, table.to_pylist(), path.name, template)


def rows_to_conversations(
    columns: Sequence[str], rows: Iterable[Mapping[str, Any]], what: str, template: RagTemplate | None = None
) -> list[Conversation]:
    """The conversations of a table, one row each (a Parquet file, a pandas ``DataFrame``, a
    Hugging Face ``datasets.Dataset``): ``messages`` a list of ``{role, content, ...}`` records or
    a JSON string; the optional ``target``, ``players``, or the RAG form's ``documents``,
    ``question``, ``answer``; a null field is absent, inside records too (but a null ``content``
    is null).

    Raises:
        InputError: no ``messages`` (or ``documents``) column, no row, or an invalid row (naming
            it: ``row 3: messages[1].content``).
    """
    if "messages" not in columns and "documents" not in columns:
        raise InputError(f"{what} has no 'messages' (or RAG 'documents') column; its columns are {list(columns)}", field="input")
    conversations = []
    for n, row in enumerate(rows):
        data = {k: _absent_nulls(v) for k, v in row.items() if not _is_null(v)}
        for key in ("messages", "players", "documents"):
            if isinstance(data.get(key), str):  # a column of JSON text
                data[key] = parse_json(data[key], what=f"{what} row {n}", field=f"row {n}: {key}")
        try:
            conversations.append(conversation_from_input(data, template))
        except InputError as exc:
            field = f"row {n}: {exc.field}" if exc.field else f"row {n}"
            raise InputError(exc.message, field=field) from exc
    if not conversations:
        raise InputError(f"{what} holds no row", field="input")
    return conversations


def _is_null(value: Any) -> bool:
    """A missing cell: ``None``, or the NaN pandas puts in an object column's empty cells."""
    return value is None or (isinstance(value, float) and value != value)


def _read_text(p: Path) -> str:
    """A file's text (UTF-8, a byte-order mark dropped); one-line errors naming the field ``input``."""
    try:
        return p.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise InputError(f"no such file {str(p)!r}", field="input") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read {str(p)!r}: {exc}", field="input") from exc


def load_conversation(path: str | Path, template: RagTemplate | None = None) -> Conversation:
    """Read one conversation from a JSON file: the chat form (:meth:`Conversation.from_dict`) or
    the RAG form, rendered with ``template`` (default :data:`DEFAULT_RAG_TEMPLATE`).

    Raises:
        InputError: the file is missing, unreadable, not UTF-8 or not valid JSON (with line and
            column), beyond the parser's limits (:mod:`coalescence.userinput`), or its content is invalid.
    """
    p = Path(path)
    return conversation_from_input(parse_json(_read_text(p), what=p.name, field="input"), template)


def load_inputs(path: str | Path, template: RagTemplate | None = None) -> tuple[list[Conversation], bool]:
    """Read the inputs of a run: one JSON object, one per line of a ``.jsonl`` file, or one per
    row of a ``.parquet`` dataset.

    Args:
        path: a ``.json`` file (one input), a ``.jsonl`` file (JSON Lines: one input per
            non-blank line, lines separated by ``"\n"`` only), a ``.parquet`` file (one input
            per row: a ``messages`` column and the optional fields as columns), or a file of a
            suffix registered with :func:`register_reader` (read by its reader, :data:`READERS`).
        template: the RAG template for inputs in the RAG form.

    Returns:
        The conversations, in file order, and whether the file is a dataset (JSONL or Parquet).

    Raises:
        InputError: the file is missing or unreadable, invalid JSON (with line and column) or
            beyond the parser's limits (:mod:`coalescence.userinput`), empty, or an invalid input (a
            JSONL error names the line: ``line 3: players[0].end``).
    """
    p = Path(path)
    reader = READERS.get(p.suffix.lower(), _json_input)  # any other suffix: one JSON input
    return reader(p, template)


def _json_input(p: Path, template: RagTemplate | None) -> tuple[list[Conversation], bool]:
    return [load_conversation(p, template)], False


def _parquet_reader(p: Path, template: RagTemplate | None) -> tuple[list[Conversation], bool]:
    return _parquet_inputs(p, template), True


def _jsonl_inputs(p: Path, template: RagTemplate | None) -> tuple[list[Conversation], bool]:
    """One input per non-blank line; errors name the line."""
    text = _read_text(p)
    conversations = []
    # JSON Lines separates records by "\n" only (a CRLF line's "\r" is JSON whitespace): never
    # str.splitlines, which also splits on U+2028, U+0085 and others, all legal inside JSON strings
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip(" \t\r"):
            continue
        data = parse_json(line, what=f"{p.name} line {n}", field="input", single_line=True)
        try:
            conversations.append(conversation_from_input(data, template))
        except InputError as exc:
            raise _prefixed(exc, n) from exc
    if not conversations:
        raise InputError(f"{p.name} holds no input (one JSON object per line)", field="input")
    return conversations, True


def _table_rows(source: Any) -> tuple[list[str], Iterable[Mapping[str, Any]], str] | None:
    """``(columns, rows, name)`` of an in-memory table: a pandas ``DataFrame`` or a Hugging Face
    ``datasets.Dataset`` (recognised by their interfaces: neither package is imported here)."""
    if hasattr(source, "to_dict") and hasattr(source, "columns") and hasattr(source, "iloc"):  # pandas.DataFrame
        return [str(c) for c in source.columns], source.to_dict(orient="records"), "the DataFrame"
    if hasattr(source, "column_names") and hasattr(source, "features") and hasattr(source, "__iter__"):  # datasets.Dataset
        return list(source.column_names), iter(source), "the Dataset"
    return None


def read_source(source: Any, template: RagTemplate | None = None) -> tuple[list[Conversation], bool]:
    """The conversations of an explain run's input, in order, and whether it is a dataset.

    Args:
        source: a path (see :func:`load_inputs`), an input dict (any input form), a list of input
            dicts (a dataset, as a JSONL file's lines: each has ``messages`` or ``documents``), a
            list of messages (one conversation), or a table with a ``messages`` (or ``documents``)
            column: a pandas ``DataFrame`` or a Hugging Face ``datasets.Dataset`` (a dataset, one
            conversation per row, as a Parquet file's).
        template: the RAG template for inputs in the RAG form.

    Raises:
        InputError: bad input (a dataset's error names the input: ``input 3: messages[0].role``),
            a source of another type, or a dictionary of tables (a ``datasets.DatasetDict``,
            naming its splits: pick one) (field ``input``).
    """
    if isinstance(source, (str, Path)):
        return load_inputs(source, template)
    table = _table_rows(source)
    if table is not None:
        columns, rows, what = table
        return rows_to_conversations(columns, rows, what, template), True
    if isinstance(source, Mapping):
        splits = [str(k) for k, v in source.items() if _table_rows(v) is not None]
        if splits and len(splits) == len(source):  # datasets.DatasetDict (load_dataset without split=)
            raise InputError(
                f"is a dictionary of dataset splits ({', '.join(splits)}), not one input; pick one split, "
                f"e.g. source[{splits[0]!r}]",
                field="input",
            )
        return [conversation_from_input(source, template)], False
    if isinstance(source, Sequence) and source and all(
        isinstance(item, Mapping) and ("messages" in item or "documents" in item) for item in source
    ):
        conversations = []
        for k, item in enumerate(source):
            try:
                conversations.append(conversation_from_input(item, template))
            except InputError as exc:
                raise InputError(exc.message, field=f"input {k}: {exc.field}" if exc.field else f"input {k}") from exc
        return conversations, True
    if isinstance(source, Sequence) and not isinstance(source, (bytes, bytearray)):
        return [conversation_from_input({"messages": list(source)}, template)], False
    raise InputError(f"must be a path, an input dict or a list of messages, got {type(source).__name__}", field="input")


Reader = Callable[[Path, RagTemplate | None], tuple[list[Conversation], bool]]
"""``reader(path, template) -> (conversations, is_dataset)``: one input format, by file suffix."""

def _check_reader(suffix: str, reader: object) -> None:
    if not suffix.startswith(".") or len(suffix) < 2:
        raise ConfigError(f"a file suffix starts with a dot, e.g. '.csv'; got {suffix!r}", field="suffix")
    if not callable(reader):
        raise ConfigError(f"must be callable, got {type(reader).__name__}", field="reader")


READERS: Registry[Reader] = Registry("input format", field="suffix", check=_check_reader, normalize=str.lower)
"""Input readers by lower-case file suffix (:func:`register_reader`); any other suffix is read as
one JSON input."""


def register_reader(suffix: str, reader: Reader, *, replace: bool = False) -> None:
    """Register an input format: files whose name ends in ``suffix`` (e.g. ``".csv"``; compared
    lower-case) are read by ``reader(path, template) -> (conversations, is_dataset)``, for the CLI's
    INPUT and the API's paths alike.

    Raises:
        ConfigError: ``suffix`` does not start with a dot, ``reader`` is not callable, or the
            suffix already has another reader and ``replace`` is false.
    """
    if not isinstance(suffix, str) or not suffix:
        raise ConfigError(f"a file suffix starts with a dot, e.g. '.csv'; got {suffix!r}", field="suffix")
    READERS.register(suffix, reader, replace=replace)


for _suffix, _reader in ((".json", _json_input), (".jsonl", _jsonl_inputs), (".parquet", _parquet_reader)):
    register_reader(_suffix, _reader)
del _suffix, _reader
