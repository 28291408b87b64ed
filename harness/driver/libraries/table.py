"""The libraries the suite runs through their adapters: one entry per library, as nccl-tests keeps
one table entry per collective. An entry names the library's pip requirement and the version the
matrix pins (``pinned``) plus older ones it runs side by side (``older``), the Debian packages it
needs on the machine (``system_packages``: {command it needs: the package that brings it}), the
environment its ranks run under, every shim the adapter applies with the library line it stands in
for, and its runs: an adapter module (``--impl``) and the capabilities it maps (the audit is run
with them wherever the library's traffic goes through torch.distributed, where the recorders see
it). ``explained`` says, per failing or refused test, why: a bug of the library with the
standalone reproduction in tests/libraries/ that shows it, or the contract question it raises.

Adding a library is one entry here and its adapter under adapters/."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Run:
    label: str  # what the library calls it: "ZeRO-1", "OSS + ShardedDataParallel"
    adapter: str  # the --impl module
    capabilities: tuple[str, ...]
    audit: bool = True  # run the capability's communication audit too


@dataclass(frozen=True)
class Library:
    name: str  # the pip name, also the key on the command line
    pinned: str
    runs: tuple[Run, ...]
    older: tuple[str, ...] = ()
    import_name: str | None = None
    system_packages: dict = field(default_factory=dict)  # command -> Debian package
    environment: dict = field(default_factory=dict)  # set for the ranks (the pytest process passes it on)
    shims: tuple[tuple[str, str], ...] = ()  # (what the adapter does, the library line it stands in for)
    # (test id prefix, as "test_file.py::test_name", or a capability) -> why it fails or is refused
    explained: dict = field(default_factory=dict)

    def requirement(self, version: str) -> str:
        return f"{self.name}=={version}"

    @property
    def module(self) -> str:
        return self.import_name or self.name


DEEPSPEED = Library(
    name="deepspeed", pinned="0.19.8", older=("0.18.3",),
    # deepspeed.init_distributed JIT-builds its deepspeed_shm_comm op on every machine (about 100 s
    # the first time, cached in ~/.cache/torch_extensions); a compiler that fails is an error there
    system_packages={"g++": "g++", "ninja": "ninja-build"},
    runs=(
        Run("ZeRO-0", "adapters.deepspeed", ("data_parallel",)),
        Run("ZeRO-1", "adapters.deepspeed", ("sharded_optimizer",)),
        Run("ZeRO-1 + offload_optimizer cpu", "adapters.deepspeed_offload", ("sharded_optimizer",)),
        Run("ZeRO-2", "adapters.deepspeed_zero2", ("sharded_optimizer",)),
        Run("ZeRO-2 + offload_optimizer cpu", "adapters.deepspeed_zero2_offload", ("sharded_optimizer",)),
        Run("ZeRO-3", "adapters.deepspeed", ("fully_sharded", "zero2")),
        Run("ZeRO-3 + offload_optimizer cpu", "adapters.deepspeed_offload", ("fully_sharded", "zero2")),
    ),
    explained={},
)

LIBRARIES = {library.name: library for library in (DEEPSPEED,)}
