"""This rank's pipeline stages, for the programs of harness/rank/programs/pipeline_parallel.py:
which stages it holds and builds, the arguments pipeline_step is handed for them, their gradients
as reported, and the hooks that record the order in which they ran."""

from __future__ import annotations

import torch

from parallelism_conformance.harness.rank import pipeline_models
from parallelism_conformance.harness.rank.context import RankContext


def _owner(stage: int, p: int, placement: str) -> int:
    """The rank of a stage: the loop (s % p) or the V (s for s < p, then 2p - 1 - s), as the
    contract places them (the driver's copy is reference.pipeline_schedules.stage_rank)."""
    if placement == "v":
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


def local_stages(ctx: RankContext, model: dict, seed: int, layers_per_stage: list[int], stages_per_rank: int, placement: str = "loop"):
    p = ctx.world_size
    if len(layers_per_stage) != p * stages_per_rank:
        raise ValueError(f"{len(layers_per_stage)} stages for {p} ranks x {stages_per_rank} stages per rank")
    stages = pipeline_models.split(pipeline_models.build(model, seed).to(ctx.device), layers_per_stage)
    mine = [s for s in range(len(stages)) if _owner(s, p, placement) == ctx.rank]
    return mine, [stages[s] for s in mine]


def placement_argument(placement: str) -> dict:
    """The keyword ``placement`` goes to pipeline_step only off the loop placement, so an
    implementation written before the V (capability zero_bubble_v) is called as it expects."""
    return {} if placement == "loop" else {"placement": placement}


def schedule_argument(schedule: str | None, schedule_rows: list | None):
    if schedule_rows is None:
        return schedule
    return lambda num_ranks, num_microbatches, stages_per_rank: schedule_rows


def stage_grads(stage_indices: list[int], modules) -> dict:
    return {
        f"stage{s}.{name}": p.grad.detach().clone()
        for s, module in zip(stage_indices, modules)
        for name, p in module.named_parameters()
        if p.grad is not None
    }


def over_the_batchs_valid_rows(summed, targets):
    """``summed`` (a sum over the valid rows) divided by the valid rows of the whole batch, C: the
    last stage holds every target, so it counts them (elsewhere the loss is never called)."""
    count = pipeline_models.valid_rows(targets) if targets is not None else 1

    def loss_fn(output, target):
        return summed(output, target) / count

    return loss_fn


def watch(indices: list[int], modules) -> list[str]:
    """The order in which this rank's stages ran forward and backward, as "F<stage>" / "B<stage>",
    from hooks on the stage modules the harness built: a forward hook, and a tensor hook on the
    stage's first parameter (the last one its backward reaches, once per microbatch), which fires
    whenever that parameter's gradient is computed: by a whole backward, or by a W however it is
    made (``backward(inputs=...)``, or torch.distributed.pipelining's ``autograd.grad`` on gradient
    edges, which assigns ``.grad`` without accumulating and so runs no post-accumulate hook); an I
    (the input's gradient only) does not fire it."""
    events: list[str] = []
    held = [{id(p) for p in module.parameters()} for module in modules]
    for k, (stage, module) in enumerate(zip(indices, modules)):

        def forward(module, inputs, output, stage=stage):
            # a forward without autograd (torch.distributed.pipelining's shape inference) or on the
            # meta device holds no activation for a backward: it is not a step of the schedule
            if torch.is_grad_enabled() and getattr(output, "device", None) is not None and output.device.type != "meta":
                events.append(f"F{stage}")

        module.register_forward_hook(forward)
        # a weight tied to another stage on this rank (capability pipeline_tied) has its gradient
        # computed by both stages' backwards: the first parameter this stage holds alone is watched
        first = next((p for p in module.parameters() if not any(id(p) in other for j, other in enumerate(held) if j != k)), None)
        if first is not None:
            first.register_hook(lambda grad, stage=stage: events.append(f"B{stage}"))
    return events
