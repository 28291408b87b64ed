"""The parity matrix of ``--parallelize`` (issue 57): every mesh factorisation of worlds 1 to
--max-world-size against its verdict, the table teams build by hand from loss curves ("FSDP 2
against FSDP 2 + TP 2"), here from the per-mesh tests of conformance/test_parallelize.py.

Nothing runs twice: a pytest plugin (``Matrix``, registered by that test module's collection when a
function is given) reads each mesh's test report as it comes and, at the end, prints the table in
the terminal summary and, with ``--parallelize-matrix PATH.md``, writes it as markdown there and as a
PNG heat map beside it (PATH.png; only where matplotlib is installed, the ``plots`` extra: the
markdown then says so). A cell is ``pass``, the first diverging step with the parameter, the rank,
the largest element error and the mesh dimension the ranks differ along (from the judge's message),
the rank's error for a plan that raised, ``skipped`` with the dimension the function does not
declare, or ``not run`` (deselected, or the run stopped first). A mesh whose values pass but whose
ranks hold more than their placements claim (conformance/parallelize_memory.py) reads ``costs more:
memory 1.5x, rank 0 (buffer 'copy')``: a pass, its ratio said (``FAIL: costs more ...`` under
--require-bounds yes). Beside each verdict, the mesh's traffic per step along each dimension (the
largest rank's, as the driver's relay carried it) and its ratio to what the placements imply
(conformance/parallelize_traffic.py), from the traffic test's report."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

TEST = "test_the_plan_trains_step_by_step_as_one_process"
TRAFFIC_TEST = "test_the_plans_traffic_per_mesh_dimension_against_its_placements"  # its column: bytes per step
# the judge's failure (conformance/test_parallelize.py, StepJudge.check): step, rank, what, whose
STEP = re.compile(r"AssertionError: step (\d+), rank (\d+): (.+?) of ('[^']+'|the loss)")
VALUES = re.compile(r"expected (\S+), got (\S+?),")
ALONG = re.compile(r"the ranks' values differ along ([\w, ]+?) \(")
MEMORY = re.compile(r"memory: rank (\d+) holds .*?, ([\d.e+inf]+)x its placements' claim .*?; above it: (\w+(?: state)? '[^']+')")
RAISED = re.compile(r"^E\s+(\w*(?:Error|Exception|Failure|Hung|Crashed|Deadlocked)): (.*)$", re.M)


def cell(longrepr: str) -> str:
    """A failed mesh's verdict in one line, read from its report's text."""
    found = STEP.search(longrepr)
    if found is None and MEMORY.search(longrepr):
        return "FAIL: " + memory_cell(longrepr)
    if found is None:
        raised = RAISED.findall(longrepr)
        if not raised:
            return "FAIL (see the test's report)"
        kind, message = raised[-1]  # the innermost: a rank's own error after the driver's RankFailure
        return f"FAIL: {kind}: {message[:140]}"
    step, rank, what, whose = found.groups()
    text = f"FAIL at step {step}: {what} of {whose}, rank {rank}"
    values = VALUES.search(longrepr, found.end())
    if values:
        try:
            text += f", error {abs(float(values.group(1)) - float(values.group(2))):.3g}"
        except ValueError:
            pass
    along = ALONG.search(longrepr, found.end())
    if along:
        text += f", ranks differ along {along.group(1)}"
    return text


def memory_cell(text: str) -> str:
    """'costs more: memory 1.5x, rank 0 (buffer 'copy', ...)' from a memory finding in ``text``."""
    found = MEMORY.search(text)
    rank, ratio, first = found.groups()
    line = text[found.start() :].split("\n", 1)[0]
    return f"costs more: memory {ratio}x, rank {rank} ({first}{', ...' if line.count(' B against ') > 1 else ''})"


@dataclass(eq=False)  # a plugin is a key of pluggy's tables: hashed by identity
class Matrix:
    """The plugin: ``meshes`` {test id: (((dim, size), ...) over every dimension, why skipped or '')},
    in the order the test module collected them."""

    spec: str
    meshes: dict
    path: str | None = None
    verdicts: dict = field(default_factory=dict)
    traffic: dict = field(default_factory=dict)

    def pytest_runtest_logreport(self, report):
        if f"{TRAFFIC_TEST}[" in report.nodeid and report.when == "call":
            mesh, said = report.nodeid.rsplit("[", 1)[1].rstrip("]"), dict(report.user_properties)
            if report.failed:
                self.traffic[mesh] = "FAIL: " + report.longreprtext.strip().splitlines()[-1][:160]
            elif "traffic" in said:
                shown, ratio = said["traffic"].removesuffix(" per step (the largest rank's)"), float(said["traffic_ratio"])
                self.traffic[mesh] = shown + (f" ({ratio:.2f}x the placements')" if ratio else "")
                if ratio > 1 and self.verdicts.get(mesh) == "pass":  # right values, more bytes than the placements imply
                    self.verdicts[mesh] = f"costs more: traffic {ratio:.2f}x the placements'"
            return
        if f"{TEST}[" not in report.nodeid:
            return
        mesh = report.nodeid.rsplit("[", 1)[1].rstrip("]")
        if report.failed:
            self.verdicts[mesh] = cell(report.longreprtext)
        elif report.skipped and report.when == "setup":
            self.verdicts[mesh] = "skipped"
        elif report.passed and report.when == "call":
            notes = [value for key, value in report.user_properties if key == "note" and MEMORY.search(value)]
            self.verdicts[mesh] = memory_cell(max(notes, key=lambda n: float(MEMORY.search(n).group(2)))) if notes else "pass"

    def rows(self) -> list[tuple[int, tuple, str]]:
        """(world size, ((dim, size), ...), verdict), by world, then in collection order."""
        return [row[:3] for row in self.rows_with_traffic()]

    def rows_with_traffic(self) -> list[tuple[int, tuple, str, str]]:
        """rows(), each with the mesh's traffic per step ('' where not measured)."""
        rows = []
        for mesh_id, (mesh, why) in self.meshes.items():
            world = 1
            for _, size in mesh:
                world *= size
            verdict = self.verdicts.get(mesh_id, "not run")
            rows.append((world, mesh, f"skipped: {why}" if why else verdict, self.traffic.get(mesh_id, "")))  # undeclared: skipped
        return sorted(rows, key=lambda row: row[0])

    def smallest_failing(self) -> str | None:
        """'world 2, dp_shard=2: FAIL at step 1 ...': the failing mesh of the fewest ranks (the first
        collected among equals), where Hypothesis's shrinking within each mesh's test ends; None
        where none failed."""
        failed = [(world, mesh, verdict) for world, mesh, verdict in self.rows() if verdict.startswith("FAIL")]
        if not failed:
            return None
        world, mesh, verdict = failed[0]
        label = " x ".join(f"{name}={size}" for name, size in mesh if size > 1) or "one rank"
        return f"world {world}, {label}: {verdict}"

    def markdown(self, png_note: str = "") -> str:
        rows = self.rows_with_traffic()
        dims = [name for name, _ in rows[0][1]] if rows else []
        lines = [
            f"# Parity matrix: `{self.spec}`",
            "",
            "Each mesh factorisation against one process (conformance/test_parallelize.py).",
            "",
            "| world | " + " | ".join(dims) + " | verdict | traffic per step (the largest rank's) |",
            "|---:|" + "---:|" * len(dims) + "---|---|",
        ]
        for world, mesh, verdict, traffic in rows:
            sizes = " | ".join(str(size) for _, size in mesh)
            lines.append(f"| {world} | {sizes} | {verdict.replace('|', '/')} | {traffic.replace('|', '/')} |")
        costly = sum(verdict.startswith("costs more") for _, _, verdict, _ in rows)
        passed = sum(verdict == "pass" for _, _, verdict, _ in rows) + costly  # right values: a pass, its cost said
        failed = sum(verdict.startswith("FAIL") for _, _, verdict, _ in rows)
        also = f" ({costly} of them costing more memory or traffic than the placements claim)" if costly else ""
        lines += ["", f"{passed} pass{also}, {failed} fail, {len(rows) - passed - failed} skipped or not run." + png_note, ""]
        smallest = self.smallest_failing()
        if smallest:
            lines += [f"The smallest failing mesh: {smallest}.", ""]
        return "\n".join(lines)

    def pytest_terminal_summary(self, terminalreporter):
        if not self.verdicts and not self.traffic:
            return
        terminalreporter.section(f"the parity matrix of {self.spec}")
        for world, mesh, verdict, traffic in self.rows_with_traffic():
            label = " x ".join(f"{name}={size}" for name, size in mesh)
            terminalreporter.write_line(f"world {world}  {label:<40} {verdict}" + (f"; traffic: {traffic}" if traffic else ""))
        smallest = self.smallest_failing()
        if smallest:
            terminalreporter.write_line(f"the smallest failing mesh: {smallest}")
        if self.path:
            png_note = write(self, Path(self.path))
            terminalreporter.write_line(f"written: {self.path}.{png_note}")


def write(matrix: Matrix, path: Path) -> str:
    """The markdown at ``path`` and the heat map at ``path`` with the suffix .png; a note on the PNG."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        heat_map(matrix.rows(), path.with_suffix(".png"), matrix.spec)
        note = f" Heat map: {path.with_suffix('.png').name}."
    except ImportError:
        note = " No heat map: matplotlib is not installed (`pip install parallelism-conformance[plots]`)."
    path.write_text(matrix.markdown(note))
    return note


COLOURS = {"pass": "#4caf50", "costs more": "#ffb300", "FAIL": "#e53935", "skipped": "#bdbdbd", "not run": "#ffffff"}


def heat_map(rows: list, path: Path, spec: str) -> None:
    """Columns the tp size, rows the data-parallel part (every other dimension), a cell per mesh
    coloured by its verdict and labelled with it (the failing step). ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.patches import Rectangle

    key = lambda mesh: " x ".join(f"{n}={s}" for n, s in mesh if n != "tp") or "(no dp)"
    columns = sorted({dict(mesh).get("tp", 1) for _, mesh, _ in rows})
    lines = list(dict.fromkeys(key(mesh) for _, mesh, _ in rows))
    figure, axes = plt.subplots(figsize=(2.2 + 1.6 * len(columns), 0.9 + 0.45 * len(lines)))
    for _, mesh, verdict in rows:
        x, y = columns.index(dict(mesh).get("tp", 1)), lines.index(key(mesh))
        kind = next((k for k in COLOURS if verdict.startswith(k)), "not run")
        axes.add_patch(Rectangle((x, y), 1, 1, facecolor=COLOURS[kind], edgecolor="black"))
        short = verdict.split(":")[0].replace("FAIL at ", "") if kind == "FAIL" else kind
        short = verdict.split(",")[0].replace("costs more: ", "") if kind == "costs more" else short
        axes.text(x + 0.5, y + 0.5, short, ha="center", va="center", fontsize=8)
    axes.set_xlim(0, len(columns))
    axes.set_ylim(len(lines), 0)
    axes.set_xticks([i + 0.5 for i in range(len(columns))], [f"tp={c}" for c in columns])
    axes.set_yticks([i + 0.5 for i in range(len(lines))], lines, fontsize=8)
    axes.set_title(f"parity matrix: {spec.replace(chr(92), '/').rsplit('/', 1)[-1]}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
