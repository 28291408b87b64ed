"""Which backend each world size runs on, decided once in the driver from --backend, the number of
visible GPUs and --max-world-size. Pure data: the GPU count is an argument, so the logic is
tested without a GPU (tests/test_backends.py fakes the count).

NCCL drives one GPU per rank and refuses two ranks on one device ("Duplicate GPU detected", measured
on a 1-GPU H200), so a world of n ranks can be NCCL only when n <= G visible GPUs:

* ``auto``: worlds 1..G on NCCL (CUDA tensors), larger worlds up to --max-world-size on gloo (CPU
  tensors). A 1- or 2-GPU runner still tests every world size; a machine without a GPU is gloo only.
* ``nccl``: NCCL only; worlds larger than G are not drawn, and the plan says so.
* ``gloo``: CPU ranks only, whatever the GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass


class BackendChoiceError(ValueError):
    """The options ask for something this machine cannot give (e.g. NCCL without a GPU)."""


@dataclass(frozen=True)
class BackendPlan:
    requested: str  # the --backend option: auto, gloo or nccl
    gpus: int  # visible GPUs
    asked_max_world_size: int  # what --max-world-size (or the profile) asked for
    by_size: tuple[str, ...]  # by_size[n - 1] is the backend of a world of n ranks, for every n drawn

    @classmethod
    def resolve(cls, requested: str, gpus: int, max_world_size: int) -> BackendPlan:
        if requested not in ("auto", "gloo", "nccl"):
            raise BackendChoiceError(f"--backend must be auto, gloo or nccl, got {requested!r}")
        if max_world_size < 1:
            raise BackendChoiceError("--max-world-size must be at least 1")
        if requested == "nccl" and gpus < 1:
            raise BackendChoiceError("--backend nccl needs at least one visible GPU; none is visible")
        if requested == "gloo":
            sizes = ["gloo"] * max_world_size
        elif requested == "nccl":
            sizes = ["nccl"] * min(max_world_size, gpus)
        else:
            sizes = ["nccl" if n <= gpus else "gloo" for n in range(1, max_world_size + 1)]
        return cls(requested, gpus, max_world_size, tuple(sizes))

    @property
    def max_world_size(self) -> int:
        """The largest world drawn."""
        return len(self.by_size)

    def backend(self, size: int) -> str:
        if not 1 <= size <= self.max_world_size:
            raise ValueError(f"a world of {size} ranks is not drawn in this run ({self.coverage()})")
        return self.by_size[size - 1]

    def device_type(self, size: int) -> str:
        """Where the ranks of a world of ``size`` compute: "cuda" on NCCL, else "cpu". The oracle
        runs its per-rank computations (one slice's forward and backward) on the same kind of device,
        so that the same kernels round the same way: cuBLAS and the CPU's BLAS sum in other orders
        (measured on an H200: 2.4e-8 apart on a 2.6e-4 gradient, three times the bound for the
        n-term average alone)."""
        return "cuda" if self.backend(size) == "nccl" else "cpu"

    def backends(self) -> tuple[str, ...]:
        """The backends in use, smallest world first."""
        return tuple(dict.fromkeys(self.by_size))

    def sizes(self, backend: str) -> list[int]:
        return [n for n, b in enumerate(self.by_size, start=1) if b == backend]

    def not_drawn(self) -> str:
        """Why worlds the options asked for are not drawn ('' when every one is)."""
        if self.max_world_size >= self.asked_max_world_size:
            return ""
        gpus = f"{self.gpus} GPU{'s' if self.gpus != 1 else ''} visible"
        return f"{_span(self.max_world_size + 1, self.asked_max_world_size)} not drawn: {gpus}, --backend nccl"

    def multi_rank(self) -> bool:
        """Whether any world of two or more ranks is drawn (else nothing distributed is tested)."""
        return self.max_world_size >= 2

    def coverage(self) -> str:
        """One line: which world sizes ran on which backend, and what was not drawn and why."""
        parts = []
        for backend in self.backends():
            sizes = self.sizes(backend)
            where = f"one GPU per rank, {self.gpus} visible" if backend == "nccl" else "CPU ranks"
            parts.append(f"{_span(sizes[0], sizes[-1])} on {backend} ({where})")
        line = "; ".join(parts)
        if self.not_drawn():
            line += f"; {self.not_drawn()}"
        if not self.multi_rank():
            line += "; no world of 2 or more ranks: nothing distributed is tested"
        return line


def _span(low: int, high: int) -> str:
    return f"world {low}" if low == high else f"worlds {low}-{high}"


def visible_gpus() -> int:
    """CUDA devices this process sees (0 without a CUDA build or driver)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
