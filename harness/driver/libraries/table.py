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

FAIRSCALE = Library(
    name="fairscale", pinned="0.4.13", older=("0.4.12",),
    environment={"ENABLE_NCCL_BASE_COLLECTIVES": "0"},  # fairscale's own switch off NCCL's _base collectives
    runs=(
        Run("OSS + ShardedDataParallel", "adapters.fairscale", ("sharded_optimizer",)),
        Run("OSS + torch DDP", "adapters.fairscale_oss", ("sharded_optimizer",)),
        Run("FullyShardedDataParallel", "adapters.fairscale", ("fully_sharded", "zero2")),
    ),
    shims=(
        ("torch.cuda.current_stream() and torch.cuda.Stream() give a stream that waits for nothing, inside "
         "fairscale's FSDP module only (adapters/fairscale_cpu.py)",
         "fully_sharded_data_parallel.py: self._streams[...].wait_stream(torch.cuda.current_stream()), "
         "torch.cuda.current_stream().wait_stream(...)"),
        ("torch.cuda.stream(s) is a context that does nothing, inside fairscale's FSDP module only",
         "fully_sharded_data_parallel.py: with torch.cuda.stream(self._streams[\"post_backward\"]) / "
         "[\"all_gather\"]"),
        ("each FSDP instance's _streams dict gives the stand-in stream for any name (FSDP fills it only where "
         "torch.cuda.is_available())", "fully_sharded_data_parallel.py, _setup_streams: "
         "self._streams[\"all_gather\"] = torch.cuda.Stream()"),
        ("Tensor.record_stream(stand-in stream) on a CPU tensor does nothing (any other call is torch's)",
         "fully_sharded_data_parallel.py, _free_full_params: p._full_param_padded.record_stream(current_stream)"),
    ),
    explained={},
)

LIBRARIES = {library.name: library for library in (DEEPSPEED, FAIRSCALE)}
