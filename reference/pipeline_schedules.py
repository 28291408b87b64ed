"""Pipeline schedules as data: the format, the generators, a validator, a grid.

A pipeline of S = p * v stages runs on p ranks; stage s lives on rank s % p (the "loop" placement;
v = 1: stage s on rank s; v > 1: Megatron's interleaving, rank r holds stages r, r + p, r + 2p, ...)
or, for ZB-V, on the "v" placement (v = 2: rank r holds stages r and 2p - 1 - r). A batch is cut
into m microbatches. A schedule is, for each rank, the ordered list of what it does:

* ``F``: forward of microbatch i on stage s;  ``B``: backward of microbatch i on stage s;
* ``I`` and ``W``: the two halves of a backward, as torch.distributed.pipelining names them and as
  zero-bubble pipelines split it (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): ``I``
  computes the gradient of the stage's input (on the critical path: the previous stage waits for
  it), ``W`` the gradients of the stage's weights (needed by nobody until the optimizer step, so it
  can be deferred to fill bubbles). A stage's backward of a microbatch is either one ``B`` or an
  ``I`` followed later by its ``W``;
* ``SEND_F`` (stage s sends the activations of microbatch i to stage s + 1), ``RECV_F`` (stage s
  receives them from stage s - 1), ``SEND_B`` (stage s sends the gradient of its input for
  microbatch i to stage s - 1), ``RECV_B`` (stage s receives the gradient of its output from stage
  s + 1). The peer stage is implied by the kind (``Action.peer_stage``); a transfer between two
  stages on the same rank (only when p = 1) is local and has no send or receive.

Compact form (torch.distributed.pipelining's convention): ``<stage><kind><microbatch>``, e.g.
``0F3`` = stage 0 forward of microbatch 3, ``2SEND_B1`` = stage 2 sends the gradient of
microbatch 1 to stage 1, ``3RECV_F0`` = stage 3 receives the activations of microbatch 0 from
stage 2. A schedule travels as plain data: one list of compact strings per rank.

Generators (communication inserted by ``add_communication``: each receive right before the compute
that needs it, each send right after the compute that produced it):

* GPipe (Huang et al. 2019): every rank runs all m forwards, then all m backwards (in the same
  microbatch order). Bubble fraction (p - 1) / (m + p - 1); m activations live at once.
* 1F1B, PipeDream-Flush (Narayanan et al. 2021): rank r runs min(p - 1 - r, m) warm-up forwards,
  then alternates one forward and one backward, then drains the remaining backwards. Same bubble
  as GPipe, but rank r holds at most min(m, p - r) live activations.
* ZB-H1 (Qi et al. 2024, section 3.1): 1F1B's warm-up and steady state with every backward split
  into I and W, rank r deferring its W passes by r microbatches (its steady state runs F, I, then
  the W of r microbatches earlier; the deferred W passes fill the cool-down). Rank r then holds at
  most min(m, p) activations (freed at W), 1F1B's peak, and with T_W <= T_F and T_W <= T_I the
  bubble is (p - 1)(T_F + T_I - T_W) per rank for m >= p: a third of 1F1B's when T_F = T_I = T_W.
* Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021, section 2.2.2), v stages per rank, m a
  multiple of p: rank r runs virtual microbatches k = 0 .. v*m - 1; forward k is stage
  ((k mod pv) div p) * p + r on microbatch (k div pv) * p + k mod p; backward k walks the chunks in
  reverse. Warm-up: min((v - 1) p + 2 (p - 1 - r), v m) forwards, then 1F1B, then cool-down. With
  per-chunk times t_f, t_b (a chunk is 1/v of a rank's layers) the bubble is (p - 1)(t_f + t_b)
  against an ideal v m (t_f + t_b): fraction (p - 1) / (v m + p - 1), v times smaller than 1F1B's.
  With v = 1 it is plain 1F1B (as in Megatron, which dispatches v = 1 to the non-interleaved
  schedule).
* ZB-H2 (Qi et al. 2024, sec. 2.2), ZB-V (sec. 6, the V placement), DualPipeV (DeepSeek-V3, on the
  V) and looped BFS (Lamy-Poirier 2023): see their generators; ZB-H2 and ZB-V are built by list scheduling at unit costs
  (``list_scheduled``), as the paper builds its heuristic schedules.

The validator raises ScheduleError naming the rank, the step, the action and the rule broken, with
the step grid (ranks as rows, steps as columns) and the bad action in brackets. Timing, bubbles,
memory and deadlocks are in reference/pipeline_simulator.py. Pure Python; no torch at all.
"""

from __future__ import annotations

from parallelism_conformance.reference.schedule_format import (
    ALL_KINDS,
    BACKWARD_INPUT,
    COMMUNICATION,
    COMPUTE,
    KINDS,
    LOOP,
    ON_THE_V,
    PLACEMENTS,
    RECV_B,
    RECV_F,
    REFERENCE_ONLY_KINDS,
    RELEASES,
    SEND_B,
    SEND_F,
    V_SHAPE,
    V_SHAPE_KINDS,
    ZERO_BUBBLE_KINDS,
    Action,
    B,
    F,
    I,
    Schedule,
    ScheduleError,
    W,
    rank_stages,
    render_grid,
    stage_rank,
)
from parallelism_conformance.reference.schedule_generators import (
    add_communication,
    check_arguments,
    dualpipe_v_compute,
    generate,
    gpipe_compute,
    interleaved_compute,
    interleaved_warmup,
    list_scheduled,
    looped_bfs_compute,
    one_f_one_b_compute,
    placement_of,
    random_schedule,
    zb_h1_compute,
    zb_h2_compute,
    zb_v_compute,
)
from parallelism_conformance.reference.schedule_theory import theory_bubble_fraction, theory_peak_live, theory_steady_period
from parallelism_conformance.reference.schedule_validator import RULES, Problem, problems, validate

__all__ = [
    "F",
    "B",
    "I",
    "W",
    "SEND_F",
    "RECV_F",
    "SEND_B",
    "RECV_B",
    "COMPUTE",
    "BACKWARD_INPUT",
    "RELEASES",
    "COMMUNICATION",
    "LOOP",
    "V_SHAPE",
    "PLACEMENTS",
    "KINDS",
    "ZERO_BUBBLE_KINDS",
    "V_SHAPE_KINDS",
    "ALL_KINDS",
    "REFERENCE_ONLY_KINDS",
    "ON_THE_V",
    "Action",
    "stage_rank",
    "rank_stages",
    "Schedule",
    "ScheduleError",
    "render_grid",
    "check_arguments",
    "gpipe_compute",
    "one_f_one_b_compute",
    "zb_h1_compute",
    "zb_h2_compute",
    "zb_v_compute",
    "list_scheduled",
    "dualpipe_v_compute",
    "looped_bfs_compute",
    "interleaved_warmup",
    "interleaved_compute",
    "add_communication",
    "generate",
    "placement_of",
    "random_schedule",
    "theory_bubble_fraction",
    "theory_steady_period",
    "theory_peak_live",
    "RULES",
    "Problem",
    "problems",
    "validate",
]
