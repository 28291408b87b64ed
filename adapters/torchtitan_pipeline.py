"""torchtitan's pipeline parallelism behind the suite's ``pipeline_step``: the stages as
``_pipeline_module_split`` (distributed/pipeline_parallel.py) wraps them, each a torch
``PipelineStage(module, stage_index, num_stages, device, group=...)`` at the index torchtitan's
``_get_pp_rank_to_stage_indices_mapping`` gives this rank for the schedule ("loop": r, r + p, ...;
"v" for ZBVZeroBubble), and the schedule built by ``_build_pipeline_schedule``, the function
``pipeline_llm`` calls, from a ``ParallelismConfig`` naming torchtitan's schedule
(``pipeline_parallel_schedule``: "GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"; interleaved
with one stage per rank is 1F1B, as in the contract) with microbatches of one sample's worth in
count: ``local_batch_size`` m and ``pipeline_parallel_microbatch_size`` 1, so that
n_microbatches = m (only rank 0 knows the batch). torchtitan's loss functions return (loss,
metrics); the contract's ``loss_fn`` is wrapped to return ``(loss, {})`` for its ``_scalar_loss_fn``.
A schedule that refuses the shape when it is built (torch's ``Schedule1F1B``: fewer microbatches than
stages) is refused with its own message: torchtitan has no fallback (torch's schedule-IR runtime,
which adapters/torch_pipelining.py uses there, only through a CSV file).

torchtitan builds every schedule with ``scale_grads=False``: the step's loss is the sum over
microbatches (its loss divides by the global token count), the contract's ``scale_grads=False``
(capability pipeline_token_loss). Asked for the mean (``scale_grads=True``, the contract's default),
the adapter refuses with that reason. The step runs as torch's ``schedule.step(inputs,
target=targets, losses=losses)`` (torch splits the batch with ``tensor_split``): torchtitan 0.3.0's
trainer passes ``arg_mbs=``, ``kwarg_mbs=`` and ``target_mbs=`` to ``step``, which torch 2.13's
``step`` does not take (they would reach the model as keyword arguments)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallelism_conformance.adapters import torchtitan_refusals as refusals

NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B", "zb-v": "ZBVZeroBubble"}


def _schedule_name(schedule, stages_per_rank: int) -> str:
    if callable(schedule):
        raise NotImplementedError(refusals.SCHEDULE_ROWS)
    if schedule not in NAMES:
        raise ValueError(f"unknown schedule kind {schedule!r} (known: {', '.join(NAMES)})")
    return "1F1B" if schedule == "interleaved" and stages_per_rank == 1 else NAMES[schedule]


def pipeline_step(stages, inputs, targets, loss_fn, num_microbatches, schedule="1f1b", group=None, scale_grads=True, trace=None):
    refusals.require_layout()
    if scale_grads:  # refused before torchtitan is imported: a refusal costs no import
        raise NotImplementedError(refusals.MEAN_OVER_MICROBATCHES)
    if trace is not None:
        raise NotImplementedError(refusals.TRACE)
    modules = list(stages) if isinstance(stages, (list, tuple)) else [stages]
    name = _schedule_name(schedule, len(modules))
    from torch.distributed.pipelining import PipelineStage
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed.pipeline_parallel import _build_pipeline_schedule, _get_pp_rank_to_stage_indices_mapping

    group = group or dist.group.WORLD
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    indices = _get_pp_rank_to_stage_indices_mapping(rank, p, name, p * len(modules))
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    pipeline_stages = [PipelineStage(module, index, p * len(modules), device, group=group) for module, index in zip(modules, indices)]
    parallelism = ParallelismConfig(
        pipeline_parallel_degree=p, pipeline_parallel_schedule=name, pipeline_parallel_microbatch_size=1, pipeline_parallel_schedule_csv=""
    )
    try:
        pp_schedule = _build_pipeline_schedule(
            parallelism=parallelism,
            local_batch_size=num_microbatches,
            stages=pipeline_stages,
            loss_fn=lambda output, target: (loss_fn(output, target), {}),
        )
    except ValueError as error:  # the schedule's own check, the same on every rank: torchtitan's refusal
        raise NotImplementedError(refusals.schedule_refused(name, num_microbatches, p * len(modules), error)) from error
    first = any(s.is_first for s in pipeline_stages)
    last = any(s.is_last for s in pipeline_stages)
    losses = [] if last else None
    pp_schedule.step(*((inputs,) if first else ()), target=targets if last else None, losses=losses, return_outputs=False)
    return torch.stack([loss.detach() for loss in losses]).sum() if last else None
