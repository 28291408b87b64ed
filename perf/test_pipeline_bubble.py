"""The pipeline bubble measured on real ranks against the simulator's prediction.

For p = 2..4 ranks and m = 1..8 microbatches (GPipe and 1F1B; interleaved with v = 2 where m is a
multiple of p), the bundled runtime (impls.pipeline_parallel) runs a step with ``trace``: every
rank records (action, start, end) with time.perf_counter, one clock for every process of the host.
Compute is made dominant and CPU-free: every layer sleeps DELAY_MS in its forward and twice that in
its backward (harness/rank/pipeline_models.py), one layer per stage(-chunk), so gloo's latency and
Python's overhead are small beside it and four ranks fit on two shared cores.

    measured bubble  = sum over ranks of (makespan - time in F and B) / (p * makespan), with the
                       makespan from the first action's start to the last action's end;
    predicted bubble = reference.pipeline_simulator on the same schedule with costs measured in
                       the same step: each stage's mean F and B, and the mean time a send and a
                       receive occupy their rank and a message is in flight (0.1-3 ms each here,
                       small beside F and B but paid on every hop of the critical path).

Goal: |measured - predicted| <= 0.05 for every configuration (median of REPEATS measured steps,
after one warm-up step). Theory, (p-1)/(m+p-1) and (p-1)/(vm+p-1), is printed beside them. The
zero-bubble rows split backward into I and W: ZB-H1 (a kind the runtime is asked for) and ZB-H2
(its rows handed over as a callable schedule: the reference generates it; see
reference.pipeline_schedules.theory_steady_period for what it gains when steps run back to back).
ZB-V runs on the V placement (two stages per rank, rank 0 holding the first and the last; a kind
the runtime is asked for), looped BFS as the reference's rows. Gantt charts of one measured and
one simulated step, side by side (1F1B and ZB-V), are written as PNGs into $PIPELINE_GANTT_DIR (or
--perf-out, perf/out by default) and their paths printed. $PIPELINE_BUBBLE_KINDS (comma-separated)
restricts the run to some schedules.

    python -m pytest perf/test_pipeline_bubble.py -s        (about 2 minutes)
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import pytest

import parallelism_conformance.reference.pipeline_schedules as sched
from parallelism_conformance.harness.driver.pool import WorldPool
from parallelism_conformance.harness.rank import pipeline_models
from parallelism_conformance.reference.pipeline_simulator import Costs, simulate

IMPL = "parallelism_conformance.impls.pipeline_parallel"
PROGRAM = "parallelism_conformance.harness.rank.programs.pipeline_parallel:timed_steps"
DELAY_MS = 15.0
REPEATS = 3  # measured steps per configuration, after one warm-up step
GOAL = 0.05
WIDTH = 4
CHARTS = (("1f1b", 4, 8, 1), ("zb-v", 4, 8, 2))


def configurations() -> list[tuple[str, int, int, int]]:
    configs = [(kind, p, m, 1) for kind in ("gpipe", "1f1b") for p in range(2, 5) for m in range(1, 9)]
    configs += [("interleaved", p, m, 2) for p in range(2, 5) for m in range(p, 9, p)]
    configs += [("zb-h1", p, m, 1) for p in range(2, 5) for m in range(p, 9)]  # its theory needs m >= p
    # ZB-H2 is not a kind pipeline_step is asked for: its rows go to the runtime as a callable schedule
    configs += [("zb-h2", p, m, 1) for p in range(2, 5) for m in range(p, 9)]
    configs += [("looped-bfs", p, m, 2) for p in range(2, 5) for m in (p, 2 * p)]
    configs += [("zb-v", p, m, 2) for p in range(2, 5) for m in range(2 * p - 1, 9)]  # its theory needs m >= 2p - 1
    configs += [("dualpipev", p, m, 2) for p in range(2, 5) for m in range(2 * p, 9, 2)]  # the reference's rows
    only = [kind for kind in os.environ.get("PIPELINE_BUBBLE_KINDS", "").split(",") if kind]
    return [c for c in configs if not only or c[0] in only or c in CHARTS]


def measured_bubble(traces: list[list], p: int) -> tuple[float, list[dict], list[list]]:
    """Bubble fraction of one step, each stage's F and B durations, the timelines from t = 0."""
    start = min(t[1] for trace in traces for t in trace)
    end = max(t[2] for trace in traces for t in trace)
    makespan = end - start
    durations: list[dict] = []
    busy = []
    for trace in traces:
        compute = [(sched.Action.parse(a), b - a_start) for a, a_start, b in trace if not _is_comm(a)]
        busy.append(sum(d for _, d in compute))
        durations.append(compute)
    timelines = [[(sched.Action.parse(a), s - start, e - start) for a, s, e in trace] for trace in traces]
    return sum(makespan - b for b in busy) / (p * makespan), durations, timelines


def _is_comm(action: str) -> bool:
    return "SEND" in action or "RECV" in action


def communication_costs(timelines: list[list]) -> dict:
    """Means over the step's messages: ``send``, a send's time on its rank; ``receive``, a receive's
    time when its message was sent before it was posted (the receiving side's own cost); and
    ``latency``, for the other receives, from the send's end to the receive's end less ``receive``.
    Means, not medians: on a loaded machine a few messages wait milliseconds for a core, and those
    delays add up along the critical path."""
    ends = {action: end for timeline in timelines for action, _, end in timeline}
    sends, early, late = [], [], []
    for timeline in timelines:
        for action, start, end in timeline:
            if action.kind in (sched.SEND_F, sched.SEND_B):
                sends.append(end - start)
            elif action.kind in (sched.RECV_F, sched.RECV_B) and action.matching() in ends:
                sent = ends[action.matching()]
                (early if sent <= start else late).append((start, end, sent))
    receive = statistics.mean(e - s for s, e, _ in early) if early else 0.0
    latency = statistics.mean(max(0.0, e - sent - receive) for _, e, sent in late) if late else 0.0
    return {"send": statistics.mean(sends) if sends else 0.0, "receive": receive, "latency": latency}


def predicted(schedule: sched.Schedule, durations: list[list], timelines: list[list]):
    """The simulator on ``schedule`` with each stage's measured mean F and B (or I and W: the
    backward is their sum, the weight pass W; both kinds in one schedule: each its own mean) and
    the measured communication costs."""
    by_kind: dict[str, dict] = {kind: {} for kind in sched.COMPUTE}
    for per_rank in durations:
        for action, seconds in per_rank:
            by_kind[action.kind].setdefault(action.stage, []).append(seconds)
    mean = {kind: {s: statistics.mean(v) for s, v in stages.items()} for kind, stages in by_kind.items()}
    backward = mean[sched.B] or {s: mean[sched.I][s] + mean[sched.W][s] for s in mean[sched.I]}
    # a schedule with whole and split backwards (DualPipeV) times its I on its own
    split = {"input": mean[sched.I]} if mean[sched.B] and mean[sched.I] else {}
    costs = Costs(mean[sched.F], backward, weight=mean[sched.W] or None, **split, **communication_costs(timelines))
    return simulate(schedule, costs)


@pytest.fixture(scope="module")
def measurements():
    results = {}
    with WorldPool("gloo", timeout_s=120) as pool:
        for kind, p, m, v in configurations():
            spec = {"widths": [WIDTH] * (p * v + 1), "dtype": "float32", "delay_ms": DELAY_MS}
            batch = pipeline_models.make_batch(spec, 2 * m, seed=0)
            common = {
                "model": spec,
                "seed": 0,
                "layers_per_stage": [1] * (p * v),
                "stages_per_rank": v,
                "num_microbatches": m,
                "loss": "mse",
                "repeats": REPEATS + 1,
                "group": None,
                "placement": sched.placement_of(kind),
                **(
                    {"schedule": None, "schedule_rows": sched.generate(kind, p, m, v).to_strings()}
                    if kind in sched.REFERENCE_ONLY_KINDS
                    else {"schedule": kind}
                ),
            }
            schedule = sched.generate(kind, p, m, v)
            last = schedule.rank_of(p * v - 1)
            args = [
                {**common, "inputs": batch["inputs"] if r == 0 else None, "targets": batch["targets"] if r == last else None} for r in range(p)
            ]
            outputs = pool.run(p, PROGRAM, args, impl=IMPL).outputs
            steps = []
            for step in range(1, REPEATS + 1):
                bubble, durations, timelines = measured_bubble([outputs[r]["traces"][step] for r in range(p)], p)
                steps.append((bubble, predicted(schedule, durations, timelines), timelines))
            steps.sort(key=lambda s: abs(s[0] - s[1].bubble_fraction))
            results[(kind, p, m, v)] = steps[len(steps) // 2]
    return results


def communication_ms(simulation) -> str:
    c = simulation.costs
    return f"{1e3 * c.send:.2f}/{1e3 * c.receive:.2f}/{1e3 * c.latency:.2f}"


def test_measured_bubble_matches_the_simulator(measurements, figures):
    print(
        f"\n{'schedule':<12} {'p':>2} {'m':>2} {'v':>2}  {'theory':>7}  {'simulated':>9}  {'measured':>8}  "
        f"{'diff':>6}  {'measured/simulated':>18}  {'send/recv/latency ms':>20}"
    )
    misses = []
    for (kind, p, m, v), (bubble, simulation, _) in measurements.items():
        theory = float(sched.theory_bubble_fraction(kind, p, m, v))
        predicted_bubble = float(simulation.bubble_fraction)
        diff = bubble - predicted_bubble
        ratio = bubble / predicted_bubble if predicted_bubble else float("nan")
        print(
            f"{kind:<12} {p:>2} {m:>2} {v:>2}  {theory:>7.3f}  {predicted_bubble:>9.3f}  {bubble:>8.3f}  "
            f"{diff:>+6.3f}  {ratio:>18.3f}  {communication_ms(simulation):>20}"
        )
        if abs(diff) > GOAL:
            misses.append(f"{kind} p={p} m={m} v={v}: measured {bubble:.3f}, simulated {predicted_bubble:.3f}")
    worst = max(abs(b - float(s.bubble_fraction)) for b, s, _ in measurements.values())
    print(f"largest |measured - simulated| = {worst:.3f} (goal <= {GOAL}); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for kind in dict.fromkeys(k for k, *_ in measurements):
        gaps = {key: abs(b - float(s.bubble_fraction)) for key, (b, s, _) in measurements.items() if key[0] == kind}
        sizes = sorted({key[1] for key in gaps})
        figures.record(
            f"pipeline bubble measured on ranks against the simulator: {kind}, p={sizes[0]}..{sizes[-1]}",
            f"worst gap {max(gaps.values()):.3f} over {len(gaps)} configurations",
            f"<= {GOAL}",
            max(gaps.values()) <= GOAL,
        )
    assert not misses, f"measured bubble off the simulator's prediction by more than {GOAL}:\n" + "\n".join(misses)


@pytest.mark.parametrize("chart", CHARTS, ids=lambda c: f"{c[0]}-p{c[1]}-m{c[2]}")
def test_gantt_chart_of_a_measured_and_a_simulated_step(measurements, pytestconfig, chart):
    pyplot = pytest.importorskip("matplotlib.pyplot", reason="the Gantt chart needs matplotlib (pip install matplotlib)")
    kind, p, m, v = chart
    bubble, simulation, timelines = measurements[chart]
    simulated = [[(action, float(start), float(end)) for start, end, action in timeline] for timeline in simulation.timelines]
    figure, axes = pyplot.subplots(1, 2, figsize=(16, 0.9 * p + 1.6), sharey=True)
    panels = [
        (f"measured on {p} gloo ranks: bubble {bubble:.3f}", timelines),
        (f"simulated with the measured costs: bubble {float(simulation.bubble_fraction):.3f}", simulated),
    ]
    for axis, (title, rows) in zip(axes, panels):
        for rank, row in enumerate(rows):
            for action, start, end in row:
                if action.kind not in sched.COMPUTE:
                    continue
                color = {sched.F: "tab:blue", sched.W: "tab:green"}.get(action.kind, "tab:orange")
                axis.barh(rank, (end - start) * 1e3, left=start * 1e3, color=color, edgecolor="black", linewidth=0.4)
                axis.text((start + end) / 2 * 1e3, rank, str(action.microbatch), ha="center", va="center", fontsize=7)
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("ms")
    axes[0].invert_yaxis()  # once: the panels share their y axis
    axes[0].set_yticks(range(p), [f"rank {r}" for r in range(p)])
    figure.suptitle(
        f"{kind}, p={p}, m={m}, v={v}: forward (blue), backward or its input half (orange), weight "
        f"half (green) per microbatch; "
        f"theory {float(sched.theory_bubble_fraction(kind, p, m, v)):.3f}"
    )
    figure.tight_layout()
    folder = Path(os.environ.get("PIPELINE_GANTT_DIR") or pytestconfig.getoption("--perf-out"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"pipeline_gantt_{kind}_p{p}_m{m}.png"
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
    print(f"\nGantt chart: {path}")
    assert path.stat().st_size > 0
