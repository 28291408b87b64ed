"""Why torchtitan cannot run some of the contract: each text is raised as NotImplementedError on
every rank, so the suite refuses the example with it (conformance/verdict.py, adapter_cannot) and
never passes it. The library lines are those of torchtitan 0.3.0."""

AVERAGE = (
    "torchtitan cannot average gradients over ranks: apply_fsdp_to_decoder (distributed/fsdp.py) ends with "
    "disable_fsdp_gradient_division(model), gradient_divide_factor 1.0 on every FSDP module, so gradients are "
    "summed; its training loop divides each loss by the global count of valid tokens instead (capability token_loss)"
)
DIVIDE_FACTOR = (
    "torchtitan cannot divide summed gradients by a factor other than 1: disable_fsdp_gradient_division "
    "(distributed/fsdp.py) sets gradient_divide_factor=1.0 on every FSDP module, and no option of its sets another"
)
COMPUTE_DTYPE = (
    "torchtitan cannot compute one unit in another dtype than the rest: apply_fsdp_to_decoder takes one "
    "MixedPrecisionPolicy (training.mixed_precision_param, mixed_precision_reduce) for every unit and the root"
)
DATA_PARALLEL = (
    "torchtitan cannot wrap a model in DistributedDataParallel: its data parallelism is FSDP2 "
    "(apply_fsdp_to_decoder; replication is HSDP's dp_replicate axis of the same fully_shard), torchtitan 0.3.0 "
    "has no DDP wrapper"
)
MEAN_OVER_MICROBATCHES = (
    "torchtitan cannot take the mean over microbatches: _build_pipeline_schedule (distributed/pipeline_parallel.py, "
    "called by pipeline_llm) builds every schedule with scale_grads=False, and its loss divides each microbatch's "
    "summed loss by the global count of valid tokens (capability pipeline_token_loss)"
)
SCHEDULE_ROWS = (
    "the torchtitan adapter cannot pass a schedule given as rows of actions: torchtitan reads such a schedule from a "
    "CSV file (parallelism.pipeline_parallel_schedule_csv, _PipelineScheduleRuntime._load_csv), which this adapter "
    "does not write"
)
TRACE = "torchtitan cannot record per-action timestamps (trace): its schedules are torch's, which keep none"


def schedule_refused(name: str, microbatches: int, stages: int, error: Exception) -> str:
    """The schedule class's own refusal, as _build_pipeline_schedule raised it."""
    return (
        f"torchtitan cannot build its {name} schedule for {microbatches} microbatches on {stages} stages: "
        f"_build_pipeline_schedule (distributed/pipeline_parallel.py) raised {type(error).__name__}: {error}"
    )


def older_layout(version: str) -> str:
    """torchtitan 0.2.2 imports (triton installed beside it), but the functions the adapter calls are 0.3.0's."""
    return (
        f"the torchtitan adapter cannot run torchtitan {version}: it calls torchtitan 0.3.0's functions, and {version} has other ones: no "
        "torchtitan.distributed.fsdp (disable_fsdp_gradient_division is in models/llama3/infra/parallelize.py, with no "
        "get_fsdp_reshard_after_forward_policy), no torchtitan.config.ParallelismConfig, build_pipeline_schedule(job_config, "
        "stages, loss_fn) for _build_pipeline_schedule, dist_sum for dist_sum_tensor"
    )


def require_layout() -> None:
    """Refuses on a torchtitan older than 0.3.0 (the version, not a failed import, says which API is there)."""
    from importlib.metadata import version

    installed = version("torchtitan")
    if tuple(int(part) for part in installed.split(".")[:2]) < (0, 3):
        raise NotImplementedError(older_layout(installed))
