"""A two-level hardware hierarchy: ranks on hosts, fast links within a host (NVLink), slower ones
across hosts (the network). The lecture's rule: "frequent communication stays on fast links;
infrequent communication crosses slower ones" - tensor parallelism, which communicates in every
layer, inside a host; data parallelism, once per step, across hosts (Megatron-LM's placement,
Narayanan et al. 2021, sec. 3.3).

``HostLayout(hosts, ranks_per_host)`` places rank r on host r // ranks_per_host (launchers number
ranks host by host); ``round_robin=True`` places it on host r % hosts instead (a launcher that deals
ranks out to hosts in turn: the placement the lecture's rule warns against, for comparison).
Never imports torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass

WITHIN = "within a host"
ACROSS = "across hosts"


@dataclass(frozen=True)
class HostLayout:
    hosts: int
    ranks_per_host: int
    round_robin: bool = False

    @classmethod
    def parse(cls, text: str) -> HostLayout:
        """ "2x4": 2 hosts of 4 ranks."""
        hosts, _, per = text.lower().partition("x")
        if not (hosts.isdigit() and per.isdigit() and int(hosts) >= 1 and int(per) >= 1):
            raise ValueError(f"a host layout is HOSTSxRANKS_PER_HOST (e.g. 2x4), got {text!r}")
        return cls(int(hosts), int(per))

    @property
    def world_size(self) -> int:
        return self.hosts * self.ranks_per_host

    def host_of(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not on {self.hosts} hosts x {self.ranks_per_host} ranks")
        return rank % self.hosts if self.round_robin else rank // self.ranks_per_host

    def link(self, a: int, b: int) -> str:
        """The class of the link between ranks a and b."""
        return WITHIN if self.host_of(a) == self.host_of(b) else ACROSS

    def spans_hosts(self, group) -> bool:
        return len({self.host_of(r) for r in group}) > 1

    def could_fit_one_host(self, group) -> bool:
        """Whether a group of this size fits on one host (a placement keeping it there exists)."""
        return len(group) <= self.ranks_per_host

    def __str__(self) -> str:
        return f"{self.hosts} hosts x {self.ranks_per_host} ranks{' (ranks dealt round-robin)' if self.round_robin else ''}"
