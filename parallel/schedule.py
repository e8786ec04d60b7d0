"""Pipeline schedules as plain lists of actions (SPEC §2), and a checker for them.

A model of ``n_layers`` is cut into ``V = pp * vp`` virtual stages; virtual stage
``v`` lives on pipeline rank ``v % pp`` as its chunk ``v // pp``. An action is
``("F" | "B", chunk, microbatch)``.

1F1B (vp = 1): rank r runs ``pp - r - 1`` warm-up forwards, then alternates one
forward and one backward, then drains the remaining backwards -- so a stage never
holds more than ``pp - r`` micro-batches of activations.

Interleaved 1F1B (vp > 1, Megatron's schedule): forwards walk the chunks in
groups of ``pp`` micro-batches (chunk 0 for micro-batches 0..pp-1, chunk 1 for the
same, ...); backwards walk the chunks in reverse; warm-up is
``2 (pp - r - 1) + (vp - 1) pp`` forwards. Needs micro-batches divisible by pp.

Messages: the forward of virtual stage v sends its output to v + 1 (activation
"A"), the backward of v sends its input gradient to v - 1 ("G"). ``link_orders``
lists, for every directed rank pair, the messages in the order the sender
produces them; receivers post their receives in exactly that order, which keeps
NCCL (ordered, untagged) and gloo (tagged) both correct. ``simulate`` proves a
schedule cannot deadlock when sends never block.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, NamedTuple, Tuple


class Action(NamedTuple):
    kind: str  # "F" | "B"
    chunk: int
    mb: int


class Message(NamedTuple):
    kind: str  # "A" (activation, forward) | "G" (gradient, backward)
    dst_stage: int  # virtual stage that consumes it
    mb: int


def _forward_id(k: int, pp: int, vp: int) -> Tuple[int, int]:
    group, within = divmod(k, pp * vp)
    return within // pp, group * pp + within % pp


def _backward_id(k: int, pp: int, vp: int) -> Tuple[int, int]:
    chunk, mb = _forward_id(k, pp, vp)
    return vp - 1 - chunk, mb


def train_schedule(pp: int, vp: int, num_mb: int, rank: int) -> List[Action]:
    """The 1F1B (vp == 1) or interleaved 1F1B (vp > 1) action list of one pipeline rank."""
    if vp > 1 and num_mb % pp:
        raise ValueError(f"interleaved schedule needs micro-batches ({num_mb}) divisible by pp ({pp})")
    total = num_mb * vp
    warmup = min(pp - rank - 1, num_mb) if vp == 1 else min(2 * (pp - rank - 1) + (vp - 1) * pp, total)
    fwd = [Action("F", *_forward_id(k, pp, vp)) for k in range(total)]
    bwd = [Action("B", *_backward_id(k, pp, vp)) for k in range(total)]
    actions = fwd[:warmup]
    for i in range(total - warmup):
        actions += [fwd[warmup + i], bwd[i]]
    return actions + bwd[total - warmup:]


def forward_schedule(pp: int, vp: int, num_mb: int, rank: int) -> List[Action]:
    """Forward-only (validation): the forwards of the training schedule, in the same order."""
    if vp > 1 and num_mb % pp:
        raise ValueError(f"interleaved schedule needs micro-batches ({num_mb}) divisible by pp ({pp})")
    return [Action("F", *_forward_id(k, pp, vp)) for k in range(num_mb * vp)]


def sends(action: Action, pp: int, vp: int, rank: int) -> List[Tuple[int, Message]]:
    """(destination rank, message) produced by an action."""
    v = action.chunk * pp + rank
    if action.kind == "F" and v < pp * vp - 1:
        return [((rank + 1) % pp, Message("A", v + 1, action.mb))]
    if action.kind == "B" and v > 0:
        return [((rank - 1) % pp, Message("G", v - 1, action.mb))]
    return []


def needs(action: Action, pp: int, vp: int, rank: int) -> List[Tuple[int, Message]]:
    """(source rank, message) an action must have received before it runs."""
    v = action.chunk * pp + rank
    if action.kind == "F" and v > 0:
        return [((rank - 1) % pp, Message("A", v, action.mb))]
    if action.kind == "B" and v < pp * vp - 1:
        return [((rank + 1) % pp, Message("G", v, action.mb))]
    return []


def link_orders(schedules: List[List[Action]], pp: int, vp: int) -> Dict[Tuple[int, int], List[Message]]:
    """For each directed pair (src, dst): the messages in the order src sends them."""
    orders: Dict[Tuple[int, int], List[Message]] = defaultdict(list)
    for rank, actions in enumerate(schedules):
        for action in actions:
            for dst, msg in sends(action, pp, vp, rank):
                orders[(rank, dst)].append(msg)
    return dict(orders)


def simulate(schedules: List[List[Action]], pp: int, vp: int) -> Dict[str, object]:
    """Run all ranks' action lists against each other with non-blocking sends.

    An action runs once its input message has arrived (and, for a backward, once its own forward
    has run on that rank). Raises if the ranks deadlock; returns, per rank, the most micro-batches whose
    forward ran and backward did not yet (``max_in_flight``) and the step count.
    """
    pos = [0] * pp
    delivered, done = set(), set()
    in_flight = [0] * pp
    peak = [0] * pp
    steps = 0
    while any(pos[r] < len(schedules[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if pos[r] == len(schedules[r]):
                continue
            action = schedules[r][pos[r]]
            own_forward = action.kind == "F" or ("F", r, action.chunk, action.mb) in done
            if own_forward and all((src, r, msg) in delivered for src, msg in needs(action, pp, vp, r)):
                done.add((action.kind, r, action.chunk, action.mb))
                for dst, msg in sends(action, pp, vp, r):
                    delivered.add((r, dst, msg))
                in_flight[r] += 1 if action.kind == "F" else -1
                peak[r] = max(peak[r], in_flight[r])
                pos[r] += 1
                progressed = True
        steps += 1
        if not progressed:
            stuck = {r: schedules[r][pos[r]] for r in range(pp) if pos[r] < len(schedules[r])}
            raise RuntimeError(f"pipeline schedule deadlocks (pp={pp}, vp={vp}): ranks waiting at {stuck}")
    return {"max_in_flight": peak, "steps": steps}
