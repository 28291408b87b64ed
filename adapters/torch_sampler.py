"""torch's own ``torch.utils.data.DistributedSampler`` behind the suite's sampling contract: the
contract is its signature and its rules (equal replica lengths, padding by repeats, drop_last)."""
from torch.utils.data import DistributedSampler  # noqa: F401 - re-exported: the contract's name
