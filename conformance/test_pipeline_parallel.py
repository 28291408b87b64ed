"""Conformance of pipeline parallelism (``pipeline_step`` and ``generate_schedule``), against
reference/pipeline_parallel.py (the dense model) and reference/pipeline_schedules.py +
reference/pipeline_simulator.py (schedules as data: validator, simulator, theory).

On the ranks (capability ``pipeline_parallel``): each example draws the number of ranks p, the
stages per rank v, a schedule (gpipe, 1f1b, interleaved with m a multiple of p, or a random valid
schedule handed over as a callable), the number of microbatches m (1-8), the layers of every stage
(1-3, uneven), the widths of a Linear+Tanh stack in float64, and a batch of k * m samples (one
test: k * m + extra, microbatches of unequal sizes). Every rank builds the same model and keeps its stages; rank 0 gets
the inputs, rank p - 1 the targets. In the driver: the last rank's loss and every rank's
gradient of every local parameter against the dense model's (the mean over microbatches of the
per-microbatch loss), within reference.pipeline_parallel's normwise float64 bound, about
(m + L) * 1e-15 times the gradient's scale; the other ranks return no loss. The schedule asked for
must be the schedule run: hooks on the stage modules record each rank's order of forwards and
backwards, which must be a random schedule's compute order exactly, and for the classic kinds must
never hold more microbatch activations at once than the kind allows (conformance/executed_schedule.py).

Graded schedules (capability ``pipeline_schedules``): the implementation's generate_schedule output
must pass the reference validator, run without deadlock in the simulator, and meet theory exactly
(Fractions) with equal per-stage costs: bubble (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(vm+p-1)
interleaved; peak live activations m (GPipe), min(m, p - r) (1F1B), min(vm, warm-up + 1)
(interleaved).

The reference the verdict relies on (every reference schedule valid and meeting theory, mutated
schedules rejected, deadlocks detected) is tested once, in tests/test_reference_pipeline_schedules.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

import parallelism_conformance.reference.likely_bugs as likely_bugs
import parallelism_conformance.reference.pipeline_parallel as ref
import parallelism_conformance.reference.pipeline_schedules as sched
from parallelism_conformance.conformance.examples import Layout
from parallelism_conformance.conformance.examples import schedule_shapes as shapes
from parallelism_conformance.conformance.executed_schedule import judge_executed_schedule
from parallelism_conformance.conformance.verdict import Judge, run_or_skip
from parallelism_conformance.harness.rank import pipeline_models
from parallelism_conformance.reference.pipeline_simulator import Costs, simulate

PROGRAM = "pipeline_parallel:train_step"
GENERATE = "pipeline_parallel:generate_schedule"
LOSS = "mse"


# ------------------------------------------------------------------------------------ strategies
@dataclass(frozen=True)
class Example:
    kind: str  # gpipe, 1f1b, interleaved, zb-h1, zb-v; random / random-split / random-v (a random valid
    # schedule, with whole backwards, or backwards split into I and W, or split on the V placement, passed as a
    # callable); looped-bfs / zb-h2 (the reference's rows, passed as a callable)
    num_ranks: int
    num_microbatches: int
    stages_per_rank: int
    layers_per_stage: tuple[int, ...]
    widths: tuple[int, ...]
    batch_size: int
    seed: int
    data_seed: int
    schedule_seed: int
    calls: int = 1  # pipeline_step calls on the same batch before the gradients are judged (accumulation)
    clip: tuple[float, float] | None = None  # (max_norm, norm_type): clip_grad_norm_ over the stages after the step
    padded: tuple[int, ...] = ()  # rows whose targets are padding (NaN): with them, the loss normalised by the valid rows
    tied: bool = False  # the last layer tied to the first (capability pipeline_tied): then sync_tied_gradients
    dropout: float = 0.0  # every layer's dropout (capability pipeline_dropout), drawn from each rank's own stream
    streams: tuple[int, ...] = ()  # with dropout: the seed of each rank's default generator

    @property
    def model(self) -> dict:
        return {
            "widths": list(self.widths),
            "dtype": "float64",
            **({"tied": True} if self.tied else {}),
            **({"dropout": self.dropout} if self.dropout else {}),
        }

    def tied_copies(self) -> list[tuple[int, str]]:
        """(stage, name in the stage) of the tied weight's two uses: the first layer of stage 0 and
        the last layer of the last stage (the same stage when there is one)."""
        return [(0, "0.linear.weight"), (len(self.layers_per_stage) - 1, f"{self.layers_per_stage[-1] - 1}.weight")]

    @property
    def placement(self) -> str:
        return sched.V_SHAPE if self.kind == "random-v" else sched.placement_of(self.kind)

    @property
    def as_rows(self) -> bool:
        """Handed over as a callable schedule (its rows), not by name."""
        return self.kind.startswith("random") or self.kind in sched.REFERENCE_ONLY_KINDS

    def rows(self) -> sched.Schedule:
        """The schedule handed over as a callable (``as_rows``)."""
        p, m, v = self.num_ranks, self.num_microbatches, self.stages_per_rank
        if self.kind in sched.REFERENCE_ONLY_KINDS:
            return sched.generate(self.kind, p, m, v)
        return sched.random_schedule(p, m, v, self.schedule_seed, split_backward=self.kind != "random", placement=self.placement)

    @property
    def last_rank(self) -> int:
        """The rank holding the last stage: it gets the targets and returns the loss."""
        return sched.stage_rank(self.num_ranks * self.stages_per_rank - 1, self.num_ranks, self.placement)

    def __str__(self) -> str:
        kind = self.kind if not self.kind.startswith("random") else f"{self.kind} (seed {self.schedule_seed})"
        return (
            f"p={self.num_ranks}, v={self.stages_per_rank}, schedule={kind}, m={self.num_microbatches}, "
            f"layers per stage={list(self.layers_per_stage)}, widths={list(self.widths)}, "
            f"batch={self.batch_size}, seed={self.seed}, data_seed={self.data_seed}"
            + (f", {self.calls} pipeline_step calls accumulating" if self.calls > 1 else "")
            + (f", then clip_grad_norm_(max_norm={self.clip[0]:.6g}, norm_type={self.clip[1]})" if self.clip else "")
            + (
                f", padded rows {list(self.padded)}: the summed loss over the valid rows / their count, scale_grads=False"
                if self.padded
                else ""
            )
            + (", the last layer tied to the first, then sync_tied_gradients" if self.tied else "")
        )

    def batch(self) -> dict:
        """The batch, with the targets of the ``padded`` rows NaN (padding)."""
        batch = pipeline_models.make_batch(self.model, self.batch_size, self.data_seed)
        if self.padded:
            batch["targets"][list(self.padded)] = float("nan")
        return batch


@st.composite
def examples(draw, max_ranks: int, kinds=sched.KINDS, unequal: bool = False) -> Example:
    """Microbatches of equal sizes (batch a multiple of m), or with ``unequal`` of sizes that
    differ by one (torch.tensor_split: the first batch % m microbatches get one more sample)."""
    kind, p, m, v = draw(shapes(max_ranks, kinds))
    if unequal and m == 1:
        m = 2 * p if kind == "interleaved" else 2
    layers = draw(st.lists(st.integers(1, 3), min_size=p * v, max_size=p * v), label="layers per stage")
    widths = draw(st.lists(st.integers(1, 5), min_size=sum(layers) + 1, max_size=sum(layers) + 1), label="widths")
    extra = draw(st.integers(1, m - 1), label="extra samples") if unequal else 0
    batch = m * draw(st.integers(1, 3), label="samples per microbatch") + extra
    seeds = [draw(st.integers(0, 2**16), label=name) for name in ("seed", "data_seed", "schedule_seed")]
    return Example(kind, p, m, v, tuple(layers), tuple(widths), batch, *seeds)


# ------------------------------------------------------------------------------------- on ranks
def run_step(judge: Judge, ranks, example: Example) -> dict:
    batch = example.batch()
    p = example.num_ranks
    common = {
        "model": example.model,
        "seed": example.seed,
        "layers_per_stage": list(example.layers_per_stage),
        "stages_per_rank": example.stages_per_rank,
        "num_microbatches": example.num_microbatches,
        "loss": LOSS,
    }
    if example.as_rows:
        common.update(schedule=None, schedule_rows=example.rows().to_strings())
    else:
        common.update(schedule=example.kind)
    if example.placement != sched.LOOP:
        common.update(placement=example.placement)
    if example.calls > 1:
        common.update(calls=example.calls)
    if example.clip is not None:
        common.update(clip={"max_norm": example.clip[0], "norm_type": example.clip[1]})
    if example.padded:
        common.update(loss="masked_sum", per_token=True)
    if example.tied:
        common.update(tied=example.tied_copies())
    per_rank = [
        {
            **common,
            "inputs": batch["inputs"] if r == 0 else None,
            "targets": batch["targets"] if r == example.last_rank else None,
            **({"rng_seed": example.streams[r]} if example.streams else {}),
        }
        for r in range(p)
    ]
    return run_or_skip(judge, ranks, Layout(p), PROGRAM, per_rank)


def dense(example: Example, stages: list | None = None, forward_orders: list[list[int]] | None = None) -> ref.Dense:
    """The dense model's loss and gradients on the example's batch; ``stages``: the stages to run
    (by default built fresh from the example's seed; a trainer passes its own, as they move);
    ``forward_orders``: with dropout, the stages of each rank's forwards in the order it ran them
    (reference/pipeline_parallel.py, dense_step)."""
    batch = example.batch()
    if stages is None:
        stages = pipeline_models.split(pipeline_models.build(example.model, example.seed), list(example.layers_per_stage))
    if not example.padded:
        return ref.dense_step(
            stages,
            batch["inputs"],
            batch["targets"],
            pipeline_models.loss_fn(LOSS),
            example.num_microbatches,
            streams=list(example.streams) or None,
            forward_orders=forward_orders,
        )
    count = pipeline_models.valid_rows(batch["targets"])
    return ref.dense_step(
        stages,
        batch["inputs"],
        batch["targets"],
        lambda output, target: pipeline_models.masked_squared_error(output, target) / count,
        example.num_microbatches,
        scale_grads=False,
    )


def judge_step(
    judge: Judge, example: Example, outputs: dict, order: sched.Schedule | None = None, forward_orders: list[list[int]] | None = None
) -> None:
    """``order``: the compute order each rank must run, when it is not ``expected_order``'s;
    ``forward_orders``: see ``dense``."""
    judge_executed_schedule(judge, example, outputs, order)
    expected = dense(example, forward_orders=forward_orders)
    p, last = example.num_ranks, example.last_rank
    for r in range(p):
        got = outputs[r]
        if r == last:
            judge.tensor(
                got["loss"],
                expected.loss,
                atol=expected.loss_atol,
                suspects=lambda: likely_bugs.pipeline_loss(expected.loss, example.num_microbatches, expected.loss_atol),
                what=f"rank {r} (holds the last stage) loss: the "
                + ("sum (scale_grads=False)" if example.padded else "mean")
                + f" over the {example.num_microbatches} microbatches of the per-microbatch loss",
            )
        elif got["loss"] is not None:
            judge.fail(
                f"rank {r} returned a loss ({got['loss']!r}); only the rank holding the last stage, "
                f"rank {last}, returns it (the others return None)"
            )
        want = {name for name in expected.grads if sched.stage_rank(int(name.split(".")[0].removeprefix("stage")), p, example.placement) == r}
        if set(got["grads"]) != want:
            judge.fail(
                f"rank {r}: parameters with a .grad after pipeline_step: expected {sorted(want)}, got "
                f"{sorted(got['grads'])} (missing {sorted(want - set(got['grads']))})"
            )
        calls = example.calls  # the same batch each call: .grad holds calls times the gradient (exact for 2)
        for name in sorted(want):
            judge.tensor(
                got["grads"][name],
                expected.grads[name] * calls,
                atol=expected.grad_atol[name] * calls,
                suspects=lambda: likely_bugs.pipeline_gradient(expected.microbatch_grads, name, expected.grad_atol[name], calls),
                what=f"rank {r} gradient of '{name}' (of the "
                + ("sum (scale_grads=False)" if example.padded else "mean")
                + " over microbatches of the per-microbatch loss"
                + (f", accumulated over {calls} pipeline_step calls)" if calls > 1 else ")"),
            )


def check_drawn_step(data, ranks, target, request, kinds=sched.KINDS, unequal: bool = False) -> Example:
    """Draw an example of ``kinds``, run it on the ranks, judge it (judge_step); the example back."""
    example = data.draw(examples(target.max_world_size, kinds=kinds, unequal=unequal), label="example")
    event(f"{example.kind}, p={example.num_ranks}, v={example.stages_per_rank}")
    judge = Judge(str(example), target.reproduce(request.node.nodeid))
    judge_step(judge, example, run_step(judge, ranks, example))
    return example


@pytest.mark.capability("pipeline_parallel")
@given(data=st.data())
def test_pipeline_step_matches_the_dense_model(data, ranks, target, request):
    check_drawn_step(data, ranks, target, request)


@pytest.mark.capability("pipeline_parallel")
@given(data=st.data())
def test_gradients_accumulate_across_pipeline_steps(data, ranks, target, request):
    """Two pipeline_step calls on the same batch before the gradients are read (gradient
    accumulation across steps, as a trainer runs several before one optimizer step): .grad holds
    twice the gradient. Dividing the whole .grad by m at the end of a step, as a stage's
    ``scale_grads`` does, divides what earlier steps accumulated again (torchtitan#1733)."""
    example = dataclasses.replace(data.draw(examples(target.max_world_size), label="example"), calls=2)
    judge = Judge(str(example), target.reproduce(request.node.nodeid))
    judge_step(judge, example, run_step(judge, ranks, example))


@pytest.mark.capability("pipeline_token_loss")
@given(data=st.data())
def test_a_loss_normalised_by_the_valid_rows_sums_the_microbatches(data, ranks, target, request):
    """pipeline_step(..., scale_grads=False) (torch's name): the loss_fn sums the squared errors of
    the valid rows and divides by the valid rows of the whole batch (padding rows' targets NaN,
    some microbatches without one valid row), so the step's loss is the sum over microbatches, with
    no 1/m. Dividing by m anyway divides the gradient twice (torchtitan#2972's mismatch between PP
    and non-PP gradients under global-token normalisation)."""
    example = data.draw(examples(target.max_world_size), label="example")
    padded = data.draw(
        st.lists(st.booleans(), min_size=example.batch_size, max_size=example.batch_size).filter(lambda rows: not all(rows)),
        label="padded rows",
    )
    example = dataclasses.replace(example, padded=tuple(i for i, pad in enumerate(padded) if pad))
    judge = Judge(str(example), target.reproduce(request.node.nodeid))
    judge_step(judge, example, run_step(judge, ranks, example))


@pytest.mark.capability("pipeline_parallel")
@given(data=st.data())
def test_unequal_microbatches_match_the_dense_model(data, ranks, target, request):
    """A batch that is not a multiple of m: microbatches by torch.tensor_split, sizes differ by one."""
    check_drawn_step(data, ranks, target, request, unequal=True)


@pytest.mark.capability("pipeline_parallel")
@given(data=st.data())
def test_any_valid_schedule_runs_and_matches_the_dense_model(data, ranks, target, request):
    """A random valid, deadlock-free schedule (no classic shape) passed as a callable schedule."""
    check_drawn_step(data, ranks, target, request, kinds=("random",))


@pytest.mark.capability("pipeline_parallel")
@given(data=st.data())
def test_looped_bfs_runs_and_matches_the_dense_model(data, ranks, target, request):
    """Looped BFS (breadth first over the rank's chunks, Lamy-Poirier 2023; torch's
    ScheduleLoopedBFS order), the reference's rows passed as a callable schedule."""
    check_drawn_step(data, ranks, target, request, kinds=("looped-bfs",))


# -------------------------------------------------------------------- the implementation's schedules
def graded_schedule(judge: Judge, ranks, kind: str, p: int, m: int, v: int) -> dict:
    """The implementation's generate_schedule(kind, p, m, v), run on one rank (it is pure)."""
    return run_or_skip(judge, ranks, Layout(1), GENERATE, [{"kind": kind, "num_ranks": p, "num_microbatches": m, "stages_per_rank": v}])[0]


def check_theory(judge: Judge, schedule: sched.Schedule, kind: str, what: str) -> None:
    p, m, v = schedule.num_ranks, schedule.num_microbatches, schedule.stages_per_rank
    for costs in (Costs(1, 1), Costs(1, 2)):
        try:
            result = simulate(schedule, costs)
        except sched.ScheduleError as error:  # DeadlockError included
            judge.fail(f"{what}: {error}")
        bubble = sched.theory_bubble_fraction(kind, p, m, v)
        if result.bubble_fraction != bubble:
            judge.fail(
                f"{what}: with F={costs.forward}, B={costs.backward} per stage the simulated bubble fraction "
                f"is {result.bubble_fraction} (makespan {result.makespan}), theory says {bubble}\n"
                f"{result.render()}\n\n{sched.render_grid(schedule, compute_only=True)}"
            )
    peaks = [sched.theory_peak_live(kind, p, m, v, r) for r in range(p)]
    if result.peak_live != peaks:
        judge.fail(
            f"{what}: peak live activations per rank {result.peak_live}, theory says {peaks}\n{sched.render_grid(schedule, compute_only=True)}"
        )


# read by harness/driver/plugin/strata.py: interleaved with one stage a rank is 1F1B (a generator that
# gives it interleaved's warm-up got through at 1 of 5 seeds: docs/kill-robustness.md), then v = 2
SCHEDULE_STRATA = [("interleaved", p, 2 * p, 1) for p in (2, 3, 4)] + [("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2), ("1f1b", 4, 6, 1)]
STRATA = {"test_generated_schedules_are_valid_and_meet_theory": lambda f, p: [{"shape": shape} for shape in SCHEDULE_STRATA]}


@pytest.mark.capability("pipeline_schedules")
@given(data=st.data())
def test_generated_schedules_are_valid_and_meet_theory(data, ranks, reproduce):
    kind, p, m, v = data.draw(shapes(8, max_v=3), label="shape")
    judge = Judge(f"generate_schedule({kind!r}, num_ranks={p}, num_microbatches={m}, stages_per_rank={v})", reproduce)
    out = graded_schedule(judge, ranks, kind, p, m, v)
    if "rows" not in out:
        judge.fail(f"generate_schedule refused valid arguments: {out.get('refused')}")
    try:
        schedule = sched.Schedule.from_strings(out["rows"], m, v)
        if schedule.num_ranks != p:
            judge.fail(f"generate_schedule returned {schedule.num_ranks} rows for {p} ranks")
        sched.validate(schedule)
    except ValueError as error:  # ScheduleError included
        judge.fail(f"the generated schedule is not valid: {error}")
    check_theory(judge, schedule, kind, "the generated schedule")


@pytest.mark.capability("pipeline_schedules")
@given(data=st.data())
def test_interleaved_refuses_m_not_a_multiple_of_p(data, ranks, reproduce):
    p = data.draw(st.integers(2, 8), label="p")
    m = data.draw(st.integers(1, 16).filter(lambda k: k % p), label="m")
    judge = Judge(f"generate_schedule('interleaved', num_ranks={p}, num_microbatches={m}, stages_per_rank=2)", reproduce)
    out = graded_schedule(judge, ranks, "interleaved", p, m, 2)
    if "refused" not in out:
        judge.fail("interleaved 1F1B with m not a multiple of p must raise a ValueError that says so; it returned a schedule")
    if "multiple" not in out["refused"]:
        judge.fail(f"the ValueError must say that m must be a multiple of p; it says: {out['refused']}")
