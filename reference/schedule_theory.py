"""What the papers give in closed form for each schedule: bubble fraction, steady-state period and
peak live activations per rank (checked against the simulator in tests/)."""

from __future__ import annotations

from fractions import Fraction

from parallelism_conformance.reference.schedule_generators import interleaved_warmup


def theory_bubble_fraction(kind: str, num_ranks: int, num_microbatches: int, stages_per_rank: int = 1, t_f=1, t_i=1, t_w=1) -> Fraction:
    """Idle time over p * makespan when every stage(-chunk) costs the same and messages are free:
    (p - 1) / (m + p - 1) for GPipe and 1F1B, (p - 1) / (v m + p - 1) interleaved (any t_f, t_b).
    ZB-H1, with a backward split into I (t_i) and W (t_w), t_w <= t_f, t_w <= t_i, m >= p (Qi et
    al. 2024, section 3.1): each rank idles (p - 1)(t_f + t_i - t_w) of a makespan
    m (t_f + t_i + t_w) + (p - 1)(t_f + t_i - t_w): (p - 1) / (3m + p - 1) when all three are equal.
    ZB-V (two stages per rank in a V, costs per stage, t_f = t_i = t_w, m >= 2p - 1): the lower
    bound, a makespan of 6m + p - 1 with p - 1 idle per rank, (p - 1) / (6m + p - 1), half ZB-H1's
    idle time at the same memory. Looped BFS (any t_f, t_b): a makespan of
    (v m + p - 1 + (v - 1) max(0, p - m)) (t_f + t_b): interleaved's bubble once m >= p; with fewer
    microbatches than ranks each further chunk waits p - m for the first microbatch to come round."""
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    if kind == "dualpipev":  # the overlapped pairs run in sequence
        if not t_f == t_i == t_w:
            raise ValueError(f"DualPipeV's bubble here is derived for t_f = t_i = t_w; got {t_f}, {t_i}, {t_w}")
        return Fraction(p - 1, 6 * m + p - 1)
    if kind == "zb-v":  # per stage costs; a stage is half a rank's layers
        if m < 2 * p - 1 or not t_f == t_i == t_w:
            raise ValueError(f"ZB-V's bubble is derived for m >= 2p - 1 and t_f = t_i = t_w; got p={p}, m={m}, t_f={t_f}, t_i={t_i}, t_w={t_w}")
        return Fraction(p - 1, 6 * m + p - 1)
    if kind == "looped-bfs":
        busy = v * m
        return 1 - Fraction(busy, busy + p - 1 + (v - 1) * max(0, p - m))
    if kind == "zb-h2":  # one step alone, at the unit costs it is built for (see theory_steady_period)
        if m < p or not t_f == t_i == t_w:
            raise ValueError(
                f"ZB-H2's single-step bubble is derived for m >= p and t_f = t_i = t_w; got p={p}, m={m}, t_f={t_f}, t_i={t_i}, t_w={t_w}"
            )
        return Fraction(p - 1, 3 * m + p - 1)
    if kind == "zb-h1":
        if m < p or t_w > t_f or t_w > t_i:
            raise ValueError(
                f"ZB-H1's bubble is derived for m >= p and t_w <= min(t_f, t_i); got p={p}, m={m}, t_f={t_f}, t_i={t_i}, t_w={t_w}"
            )
        idle = (p - 1) * (t_f + t_i - t_w)
        return Fraction(idle) / Fraction(m * (t_f + t_i + t_w) + idle)
    return Fraction(p - 1, (v if kind == "interleaved" else 1) * m + p - 1)


def theory_steady_period(kind: str, num_ranks: int, num_microbatches: int) -> int:
    """The time one more step adds when steps run back to back with no synchronization between them
    (reference.pipeline_simulator.steady_period), at unit costs F = I = W = 1 and free messages;
    the busy time per rank and step is 3m. ZB-H1: 3m + p - 1 for m >= p (its bubble stays, one
    (p - 1) per step). ZB-H2: max(3m, 2m + 2p - 1), so no bubble at all once m >= 2p - 1 (Qi et al.
    2024, sec. 2.2: "zero bubble" under post-validation). Derived from the simulator and checked
    exactly by Hypothesis (tests/test_reference_pipeline_schedules.py) over p <= 6, m <= 20."""
    p, m = num_ranks, num_microbatches
    if kind == "zb-h1":
        if m < p:
            raise ValueError(f"ZB-H1's steady period is derived for m >= p; got p={p}, m={m}")
        return 3 * m + p - 1
    if kind == "zb-h2":
        return max(3 * m, 2 * m + 2 * p - 1)
    raise ValueError(f"no steady-state period derived for {kind!r} (known: zb-h1, zb-h2)")


def theory_peak_live(kind: str, num_ranks: int, num_microbatches: int, stages_per_rank: int, rank: int) -> int:
    """Most forwards (stage-chunk activations) rank ``rank`` holds before their backward (B, or W
    when split) ran: GPipe m; 1F1B min(m, p - r); interleaved (v > 1) min(v m, warm-up + 1); ZB-H1
    min(m, p), 1F1B's largest, on every rank (rank r's r deferred W passes add to its p - r); ZB-H2
    min(m, 2p - 1) on every rank (the paper's (2p - 1) M_B); ZB-V min(2m, 2p) stage activations, a
    stage being half a rank's layers (the paper's p M_B, 1F1B's); looped BFS all v m."""
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    if kind == "zb-v":
        return min(2 * m, 2 * p)
    if kind == "dualpipev":
        return 2 * p + 1
    if kind == "looped-bfs":
        return v * m
    if kind == "gpipe":
        return m
    if kind == "zb-h2":
        return min(m, 2 * p - 1)
    if kind == "zb-h1":
        return min(m, p)
    if kind == "1f1b" or v == 1:
        return min(m, p - rank)
    return min(v * m, interleaved_warmup(p, m, v, rank) + 1)
