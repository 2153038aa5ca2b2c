"""A real notebook, executed by a real Jupyter kernel (nbclient, ipykernel): the explanation shows
its compact view, its one-line repr, and the whole report one call away; the progress bar of a
notebook run writes no warning."""

from __future__ import annotations

import json

import pytest

nbformat = pytest.importorskip("nbformat", reason="pip install -c constraints.txt -e '.[test]' (nbformat, nbclient, ipykernel)")
nbclient = pytest.importorskip("nbclient", reason="pip install -c constraints.txt -e '.[test]' (nbformat, nbclient, ipykernel)")
pytest.importorskip("ipykernel", reason="pip install -c constraints.txt -e '.[test]' (nbformat, nbclient, ipykernel)")

MESSAGES = [
    {"role": "system", "content": "You answer from the context."},
    {"role": "user", "content": "The Eiffel Tower was completed in 1889.\nBig Ben was finished in 1859.\nWhen was the tower completed?"},
    {"role": "assistant", "content": "In 1889."},
]


def outputs(cell, kind: str) -> list:
    return [o for o in cell["outputs"] if o["output_type"] == kind]


def test_a_notebook_shows_the_explanation(tmp_path, tiny_model_dir):
    source = tmp_path / "chat.json"
    source.write_text(json.dumps({"messages": MESSAGES}), encoding="utf-8")
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            f"import coalescence\ne = coalescence.explain({str(source)!r}, model={str(tiny_model_dir)!r}, unit='sentence')\ne"
        ),
        nbformat.v4.new_code_cell("print(repr(e))\nprint(e.snapshot.n_players)"),
        nbformat.v4.new_code_cell("e.report()"),
    ]
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    first, second, third = nb.cells
    (shown,) = outputs(first, "execute_result")
    compact = shown["data"]["text/html"]
    printed = "".join(o["text"] for o in outputs(second, "stream") if o["name"] == "stdout").splitlines()
    n = int(printed[1])
    assert compact.count("<mark") == n and "<svg" not in compact and "<script" not in compact.lower()
    assert printed[0].startswith(f"<Explanation exact: {n} players") and len(printed[0]) < 200
    (report,) = outputs(third, "execute_result")
    assert "<svg" in report["data"]["text/html"] and report["data"]["text/html"].count("<mark") >= n
    stderr = "".join(o["text"] for c in nb.cells for o in outputs(c, "stream") if o["name"] == "stderr")
    assert "Warning" not in stderr and "Traceback" not in stderr
