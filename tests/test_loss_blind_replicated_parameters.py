"""Issue 31 part 4's bugs side by side with a loss curve: a parameter replicated over a
sequence-parallel group (the LayerNorm in front of the tensor-parallel MLP, a mixture of experts'
router) whose gradient each member keeps from its own sequence shard, never all-reduced
(Megatron-LM#1446 and gpt-neox#1257: LayerNorm gradients that differ per tensor-parallel rank;
torchtitan#2387 and #4054: MoE router weights that diverge across TP ranks, "loss curves look
normal").

Each mutant trains its layer for ``STEPS`` AdamW steps (torch's default eps) on a linear loss
sum(y * G) of a fixed upstream gradient G, and the loss on the whole sequence (the members'
losses summed) is compared with one process training the dense layer the same way (the oracle's
forward and gradients, reference/tensor_parallel.py and reference/moe_routing.py): the check a
team's CI runs passes (relative difference at most ``LOSS_RTOL`` at every step), while the suite's
own judge (the conformance test's, called on the same example) fails. AdamW's first step moves
each element by lr times its gradient's sign, and a shard's gradient mostly has the whole
sequence's sign, which is why these bugs hide. The bundled implementation passes both halves.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import parallelism_conformance.reference.moe_routing as ref_moe
import parallelism_conformance.reference.tensor_parallel as ref_tp
from parallelism_conformance.conformance.examples import Layout, MixtureExample
from parallelism_conformance.conformance.tensor_parallel_examples import Example as TensorParallelExample
from parallelism_conformance.conformance.test_moe_topk import judge_trained_moe
from parallelism_conformance.conformance.test_tensor_parallel import check_mlp
from parallelism_conformance.conformance.verdict import Judge
from parallelism_conformance.harness.driver.plugin.fixtures import Ranks
from tests.loss_blind import ADAMW, STEPS, impl_of, worst_difference

LOSS_RTOL = 1e-4
NOISE = 0.05  # how far a token's input and upstream gradient stray from the sequence's common one


def alike(like: torch.Tensor, seed: int) -> torch.Tensor:
    """A tensor of ``like``'s shape whose rows (tokens) are one random row plus NOISE times noise
    of their own: tokens alike across the sequence, as a sequence's statistics are in training."""
    g = torch.Generator().manual_seed(seed)
    rows = like.reshape(-1, like.shape[-1])
    common = torch.randn(rows.shape[-1], generator=g, dtype=like.dtype)
    return (common + NOISE * torch.randn(rows.shape, generator=g, dtype=like.dtype)).reshape(like.shape)


@dataclasses.dataclass(frozen=True)
class AlikeTokensMLP(TensorParallelExample):
    """The conformance test's example whose input and upstream gradient have tokens alike."""

    def tensors(self) -> dict:
        t = super().tensors()
        return {**t, "x": alike(t["x"], self.seed + 1), "g": alike(t["g"], self.seed + 2)}


@dataclasses.dataclass(frozen=True)
class AlikeTokensMoE(MixtureExample):
    """The conformance test's example whose members' tokens (shards of one sequence) and upstream
    gradients are alike."""

    def tensors(self) -> dict:
        t = super().tensors()
        xs, grads = alike(torch.cat(t["xs"]), self.seed + 1), alike(torch.cat(t["grads"]), self.seed + 2)
        return {**t, "xs": list(xs.split(list(self.tokens))), "grads": list(grads.split(list(self.tokens)))}


NORM = AlikeTokensMLP(
    layout=Layout(2), dtype=torch.float64, in_features=4, out_features=4, leading=(1, 32), bias=True, seed=3, ffn=4, norm=True
)
MOE = AlikeTokensMoE(layout=Layout(2), experts_per_rank=1, h=4, f=3, tokens=(16, 16), seed=11)
TOP_K, AUX_WEIGHT = 1, 0.1
MUTANTS = {"tp_norm/sequence_parallel_norm_not_reduced": "norm", "moe_sequence_parallel/router_gradient_never_reduced": "router"}


def dense_training(parameters: dict[str, torch.Tensor], step) -> list[float]:
    """One process: ``step(parameters)`` -> (loss, {name: gradient}) ``STEPS`` times, AdamW on the
    float64 parameters in between; the loss of each step."""
    leaves = {name: p.detach().clone().requires_grad_(True) for name, p in parameters.items() if p is not None}
    optimizer = torch.optim.AdamW(
        list(leaves.values()), lr=ADAMW["lr"], betas=tuple(ADAMW["betas"]), eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"]
    )
    losses = []
    for _ in range(STEPS):
        loss, grads = step({name: p.detach() for name, p in leaves.items()})
        losses.append(float(loss))
        for name, p in leaves.items():
            p.grad = grads[name].clone()
        optimizer.step()
    return losses


def norm_curves(pool, impl: str) -> tuple[list[float], list[float]]:
    t, n = NORM.tensors(), NORM.n
    (w1, b1), (w2, b2) = t["params"]
    x, g, (nw, nb, eps) = t["x"], t["g"], t["norm"]
    dense = {"fc1_weight": w1, "fc1_bias": b1, "fc2_weight": w2, "fc2_bias": b2, "norm_weight": nw, "norm_bias": nb, "norm_eps": eps}
    outputs = pool.run(
        n,
        "parallelism_conformance.harness.rank.programs.tensor_parallel:train_steps",
        [
            {
                "dense": dense,
                "options": {"sequence_parallel": True},
                "x": ref_tp.sequence_shard(x, n, i),
                "grad_output": ref_tp.sequence_shard(g, n, i),
                "optimizer": ADAMW,
                "steps": STEPS,
                "group": None,
            }
            for i in range(n)
        ],
        impl=impl,
    ).outputs
    ranks = [sum(float(out["losses"][s]) for out in outputs) for s in range(STEPS)]

    def step(p):
        out = ref_tp.normed_mlp(
            x, (p["norm_weight"], p["norm_bias"], eps), (p["fc1_weight"], p["fc1_bias"]), (p["fc2_weight"], p["fc2_bias"]), g
        )
        return (out["output"] * g).sum(), {name: out["grad_" + name] for name in p}

    return ranks, dense_training({k: v for k, v in dense.items() if k != "norm_eps"}, step)


def router_curves(pool, impl: str) -> tuple[list[float], list[float]]:
    t, n = MOE.tensors(), MOE.layout.size
    outputs = pool.run(
        n,
        "parallelism_conformance.harness.rank.programs.expert_parallel:train_steps",
        [
            {
                "router_weight": t["router"],
                "experts": t["experts"],
                "x": t["xs"][i],
                "grad_output": t["grads"][i],
                "top_k": TOP_K,
                "aux_weight": AUX_WEIGHT,
                "optimizer": ADAMW,
                "steps": STEPS,
                "sequence_parallel": True,
                "group": None,
            }
            for i in range(n)
        ],
        impl=impl,
    ).outputs
    ranks = [sum(float(out["losses"][s]) for out in outputs) for s in range(STEPS)]
    # every expert's (W1, b1, W2, b2), named expert<j>.<k>
    flat = {"router": t["router"], **{f"expert{j}.{k}": tensor for j, expert in enumerate(t["experts"]) for k, tensor in enumerate(expert)}}

    def step(p):
        experts = [tuple(p[f"expert{j}.{k}"] for k in range(4)) for j in range(len(t["experts"]))]
        out = ref_moe.moe(t["xs"], p["router"], experts, t["grads"], TOP_K, AUX_WEIGHT)
        loss = sum((y * grad).sum() for y, grad in zip(out["outputs"], t["grads"])) + AUX_WEIGHT * out["aux_loss"]
        grads = {"router": out["grad_router"], **{f"expert{j}.{k}": out["grad_experts"][j][k] for j in range(len(experts)) for k in range(4)}}
        return loss, grads

    return ranks, dense_training(flat, step)


def verdict(pool, impl: str, layer: str) -> str | None:
    """The conformance test's judgement of the same example: None when it passes, else its first line."""
    ranks = Ranks(pool, SimpleNamespace(impl=impl))
    try:
        if layer == "norm":
            check_mlp(Judge(f"{NORM}, sequence_parallel=True", __file__), ranks, NORM, sequence_parallel=True)
        else:
            judge_trained_moe(Judge(f"{MOE}, top_k={TOP_K}", __file__), ranks, MOE, TOP_K, AUX_WEIGHT, None, sequence_parallel=True)
    except AssertionError as failure:
        return str(failure).splitlines()[0]
    return None


@pytest.mark.parametrize("mutant", MUTANTS)
def test_the_loss_curve_passes_the_bug_and_the_suite_fails_it(training_pool, mutant):
    layer = MUTANTS[mutant]
    ranks, single = (norm_curves if layer == "norm" else router_curves)(training_pool, impl_of(mutant))
    worst = worst_difference(ranks, single)
    assert worst <= LOSS_RTOL, (
        f"the loss curve differs by {worst:.3g} (relative) from one process's: a loss-equality "
        f"check at {LOSS_RTOL:g} catches {mutant} too, so it is no example of a loss-blind bug"
    )
    assert verdict(training_pool, impl_of(mutant), layer) is not None, f"the suite passed {mutant}"


@pytest.mark.parametrize("layer", ["norm", "router"])
def test_the_bundled_implementation_passes_both_checks(training_pool, layer):
    ranks, single = (norm_curves if layer == "norm" else router_curves)(training_pool, "parallelism_conformance.impls")
    worst = worst_difference(ranks, single)
    found = verdict(training_pool, "parallelism_conformance.impls", layer)
    assert worst <= 1e-12 and found is None, (worst, found)
