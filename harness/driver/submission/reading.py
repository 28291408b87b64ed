"""The submission read once a session, in the driver, before any rank starts: its files located
(files.py), its reaches into the grader (reaches.py) and what it takes from the bundled
implementations (taken.py), with what each costs under the options in effect. Pure data: the
plugin (harness/driver/plugin/submission.py) turns it into failed tests and flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import parallelism_conformance
from parallelism_conformance.harness.driver.submission import bundled
from parallelism_conformance.harness.driver.submission.files import Submission, locate
from parallelism_conformance.harness.driver.submission.reaches import Reach, reaches
from parallelism_conformance.harness.driver.submission.taken import Taken, taken

REVIEW_TAG = "review: grader access"
LISTED = 8  # reaches named in a message; the rest counted
PROJECT_FOLDERS = ("mutants", "outsiders", "tests", "starter", "parallelize_examples")  # a checkout's own implementations


@dataclass
class Reading:
    """What the driver read in the submission, and the verdicts it asks for: ``reject_reaches``
    (--reject-grader-access: every test 0), ``reject_bundled`` (--bundled-code: a taken
    capability's tests 0)."""

    files: list[str] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)
    reaches: list[Reach] = field(default_factory=list)
    taken: list[Taken] = field(default_factory=list)
    reject_reaches: bool = False
    reject_bundled: bool = True

    def review(self) -> str:
        """The note every test carries while the submission reaches into the grader ("" when not)."""
        if not self.reaches:
            return ""
        return f"flagged for review: the submission reaches into the grader ({_listed(self.reaches)})"

    def rejection(self, capability: str) -> str | None:
        """Why the tests of ``capability`` score 0 before they run, or None."""
        if self.reaches and self.reject_reaches:
            return (
                f"0 points: the submission reaches into the grader, and this course rejects that "
                f"(--reject-grader-access): {_listed(self.reaches)}"
            )
        takes = [t for t in self.taken if capability in t.capabilities]
        if takes and self.reject_bundled:
            return (
                f"0 points: {capability} is not the submission's own code: it is the suite's bundled "
                f"implementation: {_listed(takes)}. Write it yourself (CONTRACT.md)."
            )
        return None

    def as_data(self) -> dict:
        """results.json's ``extra_data.submission``: what was read and found, for course staff."""
        return {
            "files": self.files,
            "unread": self.unread,
            "grader_access": [str(r) for r in self.reaches],
            "bundled_code": [{"where": str(t), "capabilities": sorted(t.capabilities)} for t in self.taken],
            "rejected": {"grader_access": self.reject_reaches and bool(self.reaches), "bundled_code": self.reject_bundled and bool(self.taken)},
        }

    def lines(self) -> list[str]:
        """What the terminal says of it (nothing for a submission with nothing to say)."""
        out = []
        if self.reaches:
            out.append(("REJECTED" if self.reject_reaches else "flagged for review") + f": reaches into the grader: {_listed(self.reaches)}")
        if self.taken:
            verdict = "0 for" if self.reject_bundled else "reported, not scored (--bundled-code report):"
            out.append(
                f"bundled code: {verdict} {', '.join(sorted(set().union(*(t.capabilities for t in self.taken))))}: {_listed(self.taken)}"
            )
        return out


def the_projects_own(impl: str, env: dict[str, str], cwd: str) -> bool:
    """Whether ``impl`` is one of the project's own implementations, in its checkout's folders of
    them (mutants, fixtures, outsiders, the starter): they import the bundled code by design (a
    mutant is the bundled code with one bug), and the project's tests grade them under the grading
    profile to try other defences. A student's file is never there (a checkout's root is not)."""
    submission = locate(impl, env, cwd)
    where = submission.entry or (submission.root / "x" if submission.root else None)
    if where is None:
        return False
    for entry in parallelism_conformance.__path__:
        for folder in PROJECT_FOLDERS:
            if (Path(entry) / folder).is_dir() and where.resolve().is_relative_to((Path(entry) / folder).resolve()):
                return True
    return False


def _listed(items) -> str:
    shown = "; ".join(map(str, items[:LISTED]))
    return shown + (f"; and {len(items) - LISTED} more" if len(items) > LISTED else "")


def read(impl: str, env: dict[str, str], cwd: str, *, reject_reaches: bool = False, reject_bundled: bool = True) -> Reading:
    """The submission ``impl`` names, read (an --impl of the suite's own or torch's has nothing to read)."""
    submission: Submission = locate(impl, env, cwd)
    found = Reading(
        files=[submission.shown(p) for p in submission.trees],
        unread=list(submission.unread),
        reject_reaches=reject_reaches,
        reject_bundled=reject_bundled,
    )
    if not submission.trees:
        return found
    own = submission.own_module_names()
    for path, tree in submission.trees.items():
        found.reaches += reaches(tree, submission.shown(path), own)
    found.taken = taken(submission, bundled.index())
    return found


def flag_entries(entries: list[dict], submission: dict | None, output_format: str) -> None:
    """Every test entry of results.json tagged for review, its output led by why, when the driver
    found reaches into the grader in the submission (``submission``: Reading.as_data)."""
    reached = (submission or {}).get("grader_access")
    if not reached:
        return
    note = f"flagged for review: the submission reaches into the grader ({_listed(reached)})"
    if output_format == "html":
        import html

        note = f"<p>{html.escape(note)}</p>"
    for entry in entries:
        entry["tags"] = [*entry.get("tags", []), REVIEW_TAG]
        entry["output"] = f"{note}\n\n{entry['output']}" if entry.get("output") else note
