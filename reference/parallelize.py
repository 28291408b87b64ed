"""Single-process truth for ``--parallelize``: the dense twin (harness/rank/decoder_lm.py, built
from the same spec and seed) at a given state, on the global batch. Never imports torch.distributed.

Why step by step from the state the ranks reached, not one independent dense trajectory: AdamW's
update m / (sqrt(v) + eps) divides by the gradient's own magnitude, so a rounding difference delta in
a gradient element near zero moves the parameter by up to lr delta / eps, and the next step starts
from that state (torchtitan PR 1341 found AdamW "not identical" and Adam "exactly the same" between
layouts; llm-foundry PR 1521 chased the same). No bound from the reduction order survives that
amplification over several steps. Each step is therefore judged one step of rounding deep:

* the loss and every gradient of step s against the dense model's at the parameters the ranks held
  before step s (``loss_and_grads``), the mean over the global batch's valid tokens;
* every parameter after step s against the optimizer's step (``replay``) from the rank's own
  parameters with the rank's own gradient (the gradient itself judged just before): an optimizer
  is elementwise, so only the plan's handling of the update (a shard stepped twice, a weight decay
  applied on a copy) can move it;
* at the first step only, each module's forward output against the dense model's (``forward``),
  to name where a wrong value first appears.

Tolerance: ``atol`` = RELATIVE (1 + |expected|) elementwise, in float64 (u = 2^-53). A plan sums
the same terms as the dense model in another order (FSDP's reduce-scatter, a row-parallel layer's
all-reduce of partial products, the data-parallel average), each sum of K terms erring by K u sum
|terms| (Higham, 2nd ed., sec. 3.1). Here K <= 128 (dim <= 8, heads x head_dim <= 8 tp <= 64,
ffn <= 3 tp <= 24, the rows x seq <= 2 dp x 4 <= 64 summed into a weight gradient at worlds up to
8), at most ~12 nested sums deep
(two blocks of attention and SwiGLU, the norms, the head, their backward), with terms below 10^2 in
magnitude (unit-scale weights, the residual projections scaled by 1 / (2 L), RMSNorm), so an error
stays below 12 x 128 x 1.1e-16 x 10^2 ~ 1.7e-11, under RELATIVE by a factor of ~600. The replayed
optimizer's step differs from the rank's by at most a few u |p| (the same elementwise formula,
perhaps foreach against single-tensor). The bugs judged (a gradient not averaged over a replica
group, a partial sum left unreduced, a divide factor applied twice) move values by O(0.01) or more.
Measured (good.py's fsdp_tp, 25 examples at worlds 1-4, 7578 checks): the largest difference of
any check was 1e-7 of its bound, i.e. about 1e-15.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from parallelism_conformance.reference.data_parallel import IGNORE, optimizer

RELATIVE = 1e-8
# torchtitan's Llama runs in float32 (harness/rank/parallelize_models.py says why), u = 2^-24: the
# worst case above, 12 x 128 x 6e-8 x 10^2 ~ 1e-2, bounds nothing a bug moves. The bound is set from
# what was measured instead: float64's largest difference was ~9 u, the same in float32 ~5e-7.
# Measured (torchtitan's parallelize_llama on its Llama, brief, 30 examples on dp_shard 2 x tp 2,
# dp_replicate 2 x tp 2 and tp 4, 9468 checks): the largest difference of any check was 0.08 of
# this bound, 8e-7 relative. A missing reduction over a dimension moves a unit-scale model's
# gradients by O(0.1) (gradients averaged where torchtitan sums them: half, 0.036 against 0.072).
RELATIVE_FLOAT32 = 1e-5


def atol(expected: Tensor) -> Tensor:
    """RELATIVE (1 + |expected|) elementwise, RELATIVE_FLOAT32 for a float32 or lower ``expected``
    (the derivations are in the module docstring and above)."""
    relative = RELATIVE if expected.dtype == torch.float64 else RELATIVE_FLOAT32
    return relative * (1 + expected.detach().to(torch.float64).abs())


def load(model: nn.Module, params: dict[str, Tensor]) -> nn.Module:
    """``model`` with every parameter set to ``params[name]`` (in place)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    return model


def mean_token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """The mean cross entropy over the valid targets (IGNORE marks padding)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE)


def loss_and_grads(model: nn.Module, inputs: Tensor, targets: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """(the mean loss over the global batch's valid tokens, {name: its gradient}) at ``model``'s
    current parameters."""
    model.zero_grad(set_to_none=True)
    loss = mean_token_loss(model(inputs), targets)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def forward(model: nn.Module, inputs: Tensor) -> dict[str, Tensor]:
    """{module path: its output} of one forward on ``inputs`` ("(root)" for the model's logits)."""
    outputs: dict[str, Tensor] = {}

    def hook(path):
        def run(module, args, output):  # a tuple's first tensor (torchtitan's modules return some), else skipped
            first = output[0] if isinstance(output, (tuple, list)) and output else output
            if isinstance(first, Tensor):
                outputs.setdefault(path or "(root)", first.detach().clone())

        return run

    handles = [module.register_forward_hook(hook(path)) for path, module in model.named_modules()]
    with torch.no_grad():
        model(inputs)
    for handle in handles:
        handle.remove()
    return outputs


class Replay:
    """The optimizer of ``spec`` stepping copies of one rank's parameters with that rank's gradients:
    what its parameters must be after each step (see the module docstring)."""

    def __init__(self, spec: dict, initial: dict[str, Tensor]):
        self.params = {name: nn.Parameter(t.detach().clone()) for name, t in initial.items()}
        self.optimizer = optimizer(spec, list(self.params.values()))

    def step(self, before: dict[str, Tensor], grads: dict[str, Tensor | None]) -> dict[str, Tensor]:
        """From the rank's parameters ``before`` the step and its ``grads`` (None: no gradient, the
        parameter skipped): the parameters after ``optimizer.step()``."""
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(before[name])
                p.grad = None if grads.get(name) is None else grads[name].detach().clone()
        self.optimizer.step()
        return {name: p.detach().clone() for name, p in self.params.items()}


def claimed_bytes(shape, itemsize: int, placements: dict, sizes: dict) -> int:
    """The bytes one rank holds of a tensor of global ``shape`` placed by ``placements`` ({mesh dim:
    repr, "Shard(dim=0)", "_StridedShard(dim=0, sf=2)", "Replicate()", "Partial(sum)"}) on a mesh of
    ``sizes`` ({mesh dim: size}), at most: each tensor dimension d sharded over mesh dims of sizes
    m_1, ..., m_k holds ceil(shape[d] / (m_1 ... m_k)) elements (torch's uneven ``Shard``: chunks of
    ceil(n / m), the last ones shorter or empty; nested, ceil(ceil(n / a) / b) = ceil(n / (a b))),
    a Replicate or Partial dim divides nothing:

        claim = itemsize * prod_d ceil(shape[d] / prod_{mesh dims sharding d} m)

    So the claim is the largest shard's, and the allowance for uneven sharding is the ceil: one row
    per sharded dimension, nothing else. {} (a plain tensor): the whole tensor."""
    divisors = [1] * len(shape)
    for dim, placement in placements.items():
        found = re.search(r"Shard\(dim=(-?\d+)", placement)
        if found and shape:
            divisors[int(found.group(1)) % len(shape)] *= int(sizes[dim])
    count = 1
    for n, m in zip(shape, divisors):
        count *= -(-int(n) // m)
    return count * int(itemsize)
