"""The bugs the issues report as "the loss curve looked normal", side by side: each is a mutant,
trained here on one fixed example with AdamW at torch's default eps (1e-8), whose update does not
see a gradient's scale (at the first step it is lr times the gradient's sign, whatever the scale).
On the same ranks' outputs:

* the loss-equality check a team's CI runs (each step's loss on the global batch against one
  process's, relative difference at most ``LOSS_RTOL``) passes;
* the suite's own judge (the conformance test's, imported) fails.

Each test checks both halves, so the claim that these bugs hide behind the loss curve is measured,
not assumed: a bug the loss check also catches fails the test here (and the correct bundled
implementation must pass both halves, which keeps the check honest). The examples use equal
counts of valid tokens per rank, where a wrong count is a pure scale of the gradient.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import reference.data_parallel as ref
import reference.token_loss as ref_tokens
from conformance.examples import TrainingExample
from conformance.test_grad_clipping import PROGRAMS as CLIP_PROGRAMS
from conformance.test_grad_clipping import ClipExample, judge_clipping
from conformance.test_grad_clipping import rank_inputs as clip_inputs
from conformance.test_token_loss import PROGRAMS as TOKEN_PROGRAMS
from conformance.test_token_loss import Example as TokenExample
from conformance.test_token_loss import judge_training
from conformance.test_token_loss import rank_inputs as token_inputs
from conformance.verdict import Judge
from harness.driver.pool import WorldPool
from harness.rank import models

ROOT = Path(__file__).resolve().parents[1]
LOSS_RTOL = 1e-4
ADAMW = {"name": "adamw", "lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
MODEL = {"kind": "tied_lm", "vocab": 7, "width": 4, "hidden": 6, "context": 3, "dtype": "float64",
         "skips_first": False, "skips_in_unit": False}


def token_example(micro_batches: int = 1, divide_factor: float = 1.0) -> TokenExample:
    n = 2
    return TokenExample(world_size=n, per_rank_batch=2, micro_batches=micro_batches, model={**MODEL, "loss": "sum"},
                        steps=3, optimizer=ADAMW, divide_factor=divide_factor, masks=("all",) * (n * micro_batches),
                        seed=5, data_seed=6)


def clip_example() -> ClipExample:
    training = TrainingExample(world_size=2, per_rank_batch=2, model=MODEL, steps=3, optimizer=ADAMW, seed=5,
                               data_seed=6)
    return ClipExample(training, micro_batches=1, norm_type=2.0, max_norm_factor=0.25)


# (mutant, what it is run as, the example): the bugs of issue 31 parts 1 and 2
CASES = {
    "token_loss/dp_still_averages": ("token", "data_parallel", token_example()),
    "token_loss/fsdp_still_averages": ("token", "fully_sharded", token_example()),
    "token_loss/local_count": ("token", "data_parallel", token_example()),
    "token_loss/counts_averaged": ("token", "fully_sharded", token_example()),
    "grad_clipping/local_norm_only": ("clip", "fully_sharded", clip_example()),
    "grad_clipping/tied_weight_counted_twice": ("clip", "fully_sharded", clip_example()),
    "grad_clipping/norms_summed_not_their_squares": ("clip", "fully_sharded", clip_example()),
    "grad_clipping/replicated_gradients_counted_per_rank": ("clip", "data_parallel", clip_example()),
}


@pytest.fixture(scope="module")
def pool():
    with WorldPool("gloo", timeout_s=60.0) as pool:
        yield pool


def train(pool, impl: str, kind: str, layout: str, example) -> list[dict]:
    if kind == "token":
        program, inputs, n = TOKEN_PROGRAMS[layout], token_inputs(example, layout), example.world_size
    else:
        program, inputs, n = CLIP_PROGRAMS[layout][0], clip_inputs(example, layout), example.training.world_size
    return pool.run(n, f"harness.rank.programs.{program}", inputs, impl=impl).outputs


def loss_curves(kind: str, example, outputs: list[dict]) -> tuple[list[float], list[float]]:
    """(the ranks' loss on the global batch at every step, one process's): for the token loss the
    sum of every slice's summed loss over the count, for the mean loss the mean over ranks summed
    over the micro-batches; one process's from its own trajectory's state before each step."""
    if kind == "token":
        batch, steps, k = example.batch(), example.steps, example.micro_batches
        count = ref_tokens.valid_targets(batch)
        trajectory = ref.train(models.build(example.model, example.seed), example.optimizer, batch, steps, k,
                               per_token=True)
        ranks = [sum(float(out["steps"][s]["loss"].sum()) for out in outputs) / count for s in range(steps)]
        evaluate, spec, scale = ref_tokens.evaluate, example.model, 1 / count
    else:
        training, batch, k = example.training, example.batch(), example.micro_batches
        steps, n = training.steps, training.world_size
        trajectory = ref.train(models.build(training.model, training.seed), training.optimizer, batch, steps, k,
                               clip=example.clip)
        ranks = [sum(float(out["steps"][s]["loss"].sum()) for out in outputs) / n for s in range(steps)]
        evaluate, spec, scale = ref.evaluate, training.model, 1.0
    states = [trajectory.initial, *trajectory.states[:-1]]
    single = [float(evaluate(ref.load_state(models.build(spec, 0), state), batch, 1, k).slice_losses[0].sum()) * scale
              for state in states]
    return ranks, single


def judged(kind: str, layout: str, example, outputs: list[dict]) -> str | None:
    """The suite's verdict on ``outputs``: None when it passes, else its message's first line."""
    judge = Judge(str(example), "tests/test_loss_blind_bugs.py")
    try:
        if kind == "token":
            judge_training(judge, example, layout, dict(enumerate(outputs)))
        else:
            judge_clipping(judge, example, dict(enumerate(outputs)))
    except AssertionError as failure:
        return str(failure).splitlines()[0]
    return None


def both_checks(pool, impl: str, kind: str, layout: str, example) -> tuple[float, str | None]:
    """(the loss curve's largest relative difference from one process's, the suite's verdict)."""
    outputs = train(pool, impl, kind, layout, example)
    ranks, single = loss_curves(kind, example, outputs)
    worst = max(abs(a - b) / max(abs(b), 1e-300) for a, b in zip(ranks, single))
    return worst, judged(kind, layout, example, outputs)


@pytest.mark.parametrize("mutant", CASES)
def test_the_loss_curve_passes_the_bug_and_the_suite_fails_it(pool, mutant):
    kind, layout, example = CASES[mutant]
    worst, verdict = both_checks(pool, str(ROOT / "mutants" / f"{mutant}.py"), kind, layout, example)
    assert worst <= LOSS_RTOL, (f"the loss curve differs by {worst:.3g} (relative) from one process's: a loss-equality "
                                f"check at {LOSS_RTOL:g} catches {mutant} too, so it is no example of a loss-blind bug")
    assert verdict is not None, f"the suite passed {mutant} on {example}"


@pytest.mark.parametrize("layout", ["data_parallel", "fully_sharded"])
@pytest.mark.parametrize("kind", ["token", "clip"])
def test_the_bundled_implementation_passes_both_checks(pool, kind, layout):
    example = token_example() if kind == "token" else clip_example()
    worst, verdict = both_checks(pool, "impls", kind, layout, example)
    assert worst <= LOSS_RTOL and verdict is None, (worst, verdict)
