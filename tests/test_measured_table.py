"""scripts/bench writes the measured table (perf/figures.py): a run replaces its own rows, keeps the
others with the date they were measured, and never touches the text around the table."""

from __future__ import annotations

from parallelism_conformance.perf.figures import BEGIN, END, Figures, write


def _table_rows(text: str) -> dict[str, list[str]]:
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in block.splitlines() if line.startswith("| ")]
    return {cells[0]: cells for cells in rows[2:]}


def test_a_run_replaces_its_rows_and_keeps_the_rest(tmp_path):
    path = tmp_path / "measured.md"
    path.write_text(f"# Measured\n\nprose before\n\n{BEGIN}\n{END}\n\nprose after\n")
    first = Figures()
    first.record("ring against gloo, n=4", "1.04x", ">= 0.9x", True)
    first.record("audit overhead, n=2", "1.40x", "<= 1.25x", False)
    write(path, first)
    rows = _table_rows(path.read_text())
    assert rows["ring against gloo, n=4"][1:3] == ["1.04x", ">= 0.9x: met"]
    assert rows["audit overhead, n=2"][2] == "<= 1.25x: MISSED"
    second = Figures()
    second.record("audit overhead, n=2", "1.10x", "<= 1.25x", True)
    second.record("TP against DTensor", "n=2: 1.1x | odd")  # no gate; a '|' cannot break the table
    write(path, second)
    text = path.read_text()
    rows = _table_rows(text)
    assert list(rows) == ["ring against gloo, n=4", "audit overhead, n=2", "TP against DTensor"]
    assert rows["ring against gloo, n=4"][1] == "1.04x" and rows["audit overhead, n=2"][1:3] == ["1.10x", "<= 1.25x: met"]
    assert rows["TP against DTensor"][1:3] == ["n=2: 1.1x / odd", ""]
    assert text.startswith("# Measured\n\nprose before\n\n") and text.endswith(f"{END}\n\nprose after\n")
    assert text.count(BEGIN) == 1 and "Last written by `scripts/bench` on" in text


def test_a_file_without_the_markers_gets_a_table_at_its_end(tmp_path):
    path = tmp_path / "measured.md"
    path.write_text("# Measured\n\nonly prose\n")
    figures = Figures()
    figures.record("warm world, n=2", "2.2 ms")
    write(path, figures)
    text = path.read_text()
    assert text.startswith("# Measured\n\nonly prose\n") and list(_table_rows(text)) == ["warm world, n=2"]
