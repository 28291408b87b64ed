"""How the data parallelism tests (conformance/test_data_parallel.py) run an example and judge it:
the ranks train the wrapped model on their slices of the global batch (harness/rank/programs/
data_parallel.py), and in the driver, step by step and rank by rank, every loss, gradient and
parameter is judged against one process training on the whole global batch (reference/
data_parallel.py); where that fails, a design the library under test declares is judged whole
(conformance/by_design.py)."""

from __future__ import annotations

import parallelism_conformance.reference.data_parallel as ref
import parallelism_conformance.reference.likely_bugs as likely_bugs
from parallelism_conformance.conformance import by_design
from parallelism_conformance.conformance.data_parallel_examples import Example
from parallelism_conformance.conformance.library_configurations import accumulated
from parallelism_conformance.conformance.verdict import Judge, check_names, mismatch, run_refusable
from parallelism_conformance.harness.rank import models

PROGRAM = "data_parallel:train"


def run_training(ranks, example: Example) -> tuple[dict, dict, ref.Trajectory, dict]:
    """Every rank's outputs, the global batch, the reference trajectory from rank 0's initial
    model, and which names are frozen parameters or buffers (judged exactly)."""
    batch = models.make_batch(example.model, example.batch_size, example.data_seed)
    micro = [ref.split_batch(b, example.world_size) for b in ref.split_micro_batches(batch, example.micro_batches)]
    outputs = run_refusable(
        ranks,
        example,
        example.world_size,
        PROGRAM,
        [
            {
                "model": example.model_of(r),
                "seed": example.seed_of(r),
                "optimizer": example.optimizer,
                "steps": example.steps,
                "batches": [slices[r] for slices in micro],
                "bucket_size_mb": example.bucket_size_mb,
                "set_to_none": example.set_to_none,
            }
            for r in range(example.world_size)
        ],
    )
    model = models.build(example.model_of(0), example.seed_of(0))
    exact = {name: "frozen parameter" for name, p in model.named_parameters() if not p.requires_grad}
    exact.update({name: "buffer" for name, _ in model.named_buffers()})
    scale = ranks.micro_batch_scale(example.micro_batches)
    trajectory = ref.train(model, example.optimizer, batch, example.steps, example.micro_batches, example.set_to_none, micro_batch_scale=scale)
    # what a library that declares it does (conformance/by_design.py), computed only if judged
    trajectory.designed = (
        ranks.designs,
        lambda: ref.train(
            models.build(example.model_of(0), example.seed_of(0)),
            example.optimizer,
            batch,
            example.steps,
            example.micro_batches,
            example.set_to_none,
            unused_get_zero_grad=True,
            micro_batch_scale=scale,
        ),
    )
    return outputs, batch, trajectory, exact


def judge_training(
    judge: Judge, example: Example, outputs: dict, batch: dict, expected: ref.Trajectory, exact: dict, device: str = "cpu"
) -> None:
    """The state right after wrapping, then step by step: every rank's loss and gradients against
    one step of the reference from the state the ranks held before the step (rank 0's, already
    judged), every rank's state after the step against the reference trajectory, and bitwise
    agreement across ranks. Where that fails, a design the library declares, judged whole."""
    designs, variant = getattr(expected, "designed", (None, None))
    by_design.judged(
        designs,
        lambda: judge_steps(judge, example, outputs, batch, expected, exact, device),
        {by_design.UNUSED_GET_ZERO_GRAD: lambda: judge_steps(judge, example, outputs, batch, variant(), exact, device, every_grad=True)},
    )


def judge_steps(
    judge: Judge, example: Example, outputs: dict, batch: dict, expected: ref.Trajectory, exact: dict, device: str, every_grad: bool = False
) -> None:
    """judge_training's checks (``every_grad``: every trainable parameter holds a .grad after each
    step, zero where unused: the design unused_parameters_get_zero_grad)."""
    world = range(example.world_size)
    trainable = frozenset(name for name, p in models.build(example.model_of(0), example.seed_of(0)).named_parameters() if p.requires_grad)
    frozen = sorted(name for name, kind in exact.items() if kind == "frozen parameter")
    for r in world:
        what = f"rank {r} right after wrapping"
        check_names(judge, outputs[r]["wrapped"], expected.initial, f"{what}: parameters and buffers")
        own = ref.state(models.build(example.model_of(r), example.seed_of(r))) if r else {}
        for name, want in expected.initial.items():
            kind = exact.get(name, "parameter")
            judge.tensor(
                outputs[r]["wrapped"][name],
                want,
                what=f"{what}: {kind} '{name}' (every rank must start from rank 0's parameters and buffers)",
                suspects=lambda: [(f"rank {r}'s own initial value: rank 0's {kind}s are not broadcast", own[name], None)] if own else [],
            )
        if len(outputs[r]["steps"]) != example.steps:
            judge.fail(f"rank {r}: the program recorded {len(outputs[r]['steps'])} steps, expected {example.steps}")
    before, had_grad = outputs[0]["wrapped"], frozenset()
    kept = (
        "zero_grad(set_to_none=False) keeps a zero .grad on every parameter that has had one"
        if not example.set_to_none
        else "a parameter that no forward used in this step keeps .grad None"
    )
    for s in range(example.steps):
        step = f"step {s + 1}"
        truth = ref.evaluate(
            ref.load_state(models.build(example.model, 0), before),
            batch,
            example.world_size,
            example.micro_batches,
            trainable if every_grad else (had_grad if not example.set_to_none else frozenset()),
            device=device,
            micro_batch_scale=expected.micro_batch_scale,
        )
        for r in world:
            got = outputs[r]["steps"][s]
            judge.tensor(
                got["loss"],
                truth.slice_losses[r],
                atol=ref.loss_atol(truth, r),
                what=f"rank {r} losses at {step} (per micro-batch, the mean loss over its own slice)",
            )
            check_names(
                judge,
                got["grads"],
                truth.grads,
                f"rank {r} at {step}: parameters with a .grad after finish_gradient_synchronization",
                f"; frozen parameters {frozen} never get one, and {kept}, as in one process",
            )
            wrong = [name for name, want in truth.grads.items() if mismatch(got["grads"][name], want, ref.grad_atol(truth, name))]
            every = f"; every parameter with a wrong gradient, in model order: {', '.join(wrong)}" if len(wrong) > 1 else ""
            for name, want in truth.grads.items():
                atol = ref.grad_atol(truth, name)
                judge.tensor(
                    got["grads"][name],
                    want,
                    atol=atol,
                    what=f"rank {r} gradient of '{name}' after finish_gradient_synchronization at {step} "
                    f"(the mean over ranks = the global-batch gradient"
                    f"{accumulated(example.micro_batches, expected.micro_batch_scale)}){every}",
                    suspects=lambda: likely_bugs.data_parallel_gradient(truth.slice_grads, name, r, atol),
                )
            check_names(judge, got["state"], expected.states[s], f"rank {r} after {step}: parameters and buffers")
            for name, want in expected.states[s].items():
                if name in exact:
                    judge.tensor(
                        got["state"][name],
                        want,
                        what=f"rank {r} {exact[name]} '{name}' after {step}"
                        + (" (requires_grad=False: never changes)" if exact[name] == "frozen parameter" else ""),
                    )
                else:
                    judge.tensor(
                        got["state"][name], want, atol=ref.param_atol(expected, s + 1, name), what=f"rank {r} parameter '{name}' after {step}"
                    )
        for name in truth.grads:
            judge.bitwise_identical({r: outputs[r]["steps"][s]["grads"][name] for r in world}, what=f"gradient of '{name}' at {step}")
        for name in expected.states[s]:
            judge.bitwise_identical({r: outputs[r]["steps"][s]["state"][name] for r in world}, what=f"'{name}' after {step}")
        before, had_grad = outputs[0]["steps"][s]["state"], had_grad | set(truth.grads)
