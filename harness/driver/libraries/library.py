"""What the library table (harness/driver/libraries/table.py) is made of: a library's entry and each
of its runs through the suite."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Run:
    label: str  # what the library calls it: "ZeRO-1", "OSS + ShardedDataParallel"
    adapter: str  # the --impl module
    capabilities: tuple[str, ...]
    audit: bool = True  # run the capability's communication audit too


# the capabilities a training library's runs map, as its settings name them
DP, ZERO12, ZERO3 = ("data_parallel",), ("sharded_optimizer",), ("fully_sharded",)
ANY_STAGE = DP + ZERO12 + ZERO3


@dataclass(frozen=True)
class Setting:
    """One configuration key a library's users set, as the table declares it: the values the suite
    draws, the library's own default first (Hypothesis shrinks toward the first value, so a failure
    shrinks toward the library's defaults and the report names only the keys away from them)."""

    key: str  # as the library spells it ("zero_optimization.overlap_comm": a dotted path into its config)
    values: tuple  # the library's default first
    capabilities: tuple[str, ...]  # the runs (by the capability they map) where users set it
    why: str = ""  # what it changes, with the library's source line
    since: str = ""  # the first version that has the key ("" = every version the table runs): not drawn before it

    @property
    def default(self):
        return self.values[0]


@dataclass(frozen=True)
class Library:
    name: str  # the pip name, also the key on the command line
    pinned: str
    runs: tuple[Run, ...]
    older: tuple[str, ...] = ()
    import_name: str | None = None
    system_packages: dict = field(default_factory=dict)  # command -> Debian package
    environment: dict = field(default_factory=dict)  # set for the ranks (the pytest process passes it on)
    # Python run once in the venv after installing (its op cache set): what a library builds at its
    # first use, built before any rank has a deadline to meet
    warm_up: str = ""
    shims: tuple[tuple[str, str], ...] = ()  # (what the adapter does, the library line it stands in for)
    # requirements.lock's packages (pip names) that the library's venv neither installs from the lock
    # nor is constrained by, each with why: a pin the library's own dependencies cannot meet. torch
    # is never one (the suite runs on the lock's torch; venvs.check refuses any other)
    unconstrained: dict = field(default_factory=dict)  # pip name -> why
    # requirements the venv installs beside the library (under the lock's constraints, as the library):
    # a package the library imports without declaring it, which the user's environment brings
    extra_requirements: tuple[str, ...] = ()
    # (test id prefix, as "test_file.py::test_name", or a capability) -> why it fails or is refused
    explained: dict = field(default_factory=dict)
    # documented behaviours the reference does not share, judged as "differs by design" where the
    # reference run with them reproduces the library exactly (conformance/by_design.py):
    # name (by_design.KNOWN) -> (the behaviour, the library's source or documentation that says so)
    by_design: dict = field(default_factory=dict)
    # the version the test command runs the adapters on (one example of each mapped capability), where
    # the pinned one cannot run them ("" = the pinned); its explanation says why
    runs_on: str = ""
    # version -> the standalone reproductions (tests/libraries/) run in that version's venv by the
    # project's tests, each exiting 0 while the library still behaves as its docstring says
    reproductions: dict = field(default_factory=dict)
    # the configuration keys its users set (conformance/library_configurations.py draws them); an
    # empty tuple says the adapter's path has none the contract's loop can vary, ``settings_note`` why
    settings: tuple[Setting, ...] = ()
    # where the library divides each micro-batch's loss by its own count of them (the reference then
    # averages the k micro-batches' gradients where the contract sums them): the source that says so
    averages_micro_batches: str = ""
    settings_note: str = ""

    def requirement(self, version: str) -> str:
        return f"{self.name}=={version}"

    @property
    def module(self) -> str:
        return self.import_name or self.name

    @property
    def tested(self) -> str:
        """The version the test command runs the adapters on."""
        return self.runs_on or self.pinned

    def settings_for(self, capability: str) -> tuple[Setting, ...]:
        """The keys users set on the runs that map ``capability``."""
        return tuple(s for s in self.settings if capability in s.capabilities)

    def tested_versions(self) -> tuple[str, ...]:
        """Every version the project's tests need a venv of: the adapters' and the reproductions'."""
        return tuple(dict.fromkeys((self.tested, *self.reproductions)))
