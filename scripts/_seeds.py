"""The seeds a convergence script (``convergence_zeropp.py``, ``convergence_fp8.py``) repeats its comparison over,
and how it states a gap over them.

One seed cannot carry a claim of the kind "within 1%": on the tiny model the gap between two runs moves by more
than a point with the seed alone (the 4-bit ZeRO-3 at 150 steps: -0.08%, +1.50%, +0.82% with seeds 98, 99,
100), and a reordered sum can send a quantized run down another path. So every comparison runs once per seed
(``--seeds``, :data:`DEFAULT` unless given; fixed beforehand, not picked after looking), each run against its
baseline *of the same seed*, and the gap is stated as each seed's, their mean, the range min..max and the sample
standard deviation (n - 1 in the denominator).
"""
from __future__ import annotations

import statistics
from typing import Dict, List, Sequence

import _cli

DEFAULT = (1, 2, 3)
"""``train.seed`` of the default repetitions."""


def add_argument(ap) -> None:
    """``--seeds`` on an ``argparse`` parser, :data:`DEFAULT` by default (said in ``--help``)."""
    ap.add_argument("--seeds", nargs="+", type=int, default=list(DEFAULT), metavar="SEED",
                    help="train.seed of each repetition; every run and the run it is compared with train once per seed "
                         f"(default: {' '.join(map(str, DEFAULT))})")


def check(seeds: Sequence[int], overrides: Sequence[str]) -> None:
    """Refuse a repeated seed (the same run twice would shrink the spread) and a ``train.seed`` override (every
    repetition would train with it): one line, exit code 2."""
    repeated = sorted({s for s in seeds if list(seeds).count(s) > 1})
    if repeated:
        raise _cli.InputError(f"--seeds: {', '.join(map(str, repeated))} given more than once")
    for o in overrides:
        if o.split("=", 1)[0].lstrip("+~") == "train.seed":
            raise _cli.InputError(f"override {o}: give the seeds with --seeds, not train.seed")


def spread(gaps: Sequence[float]) -> Dict[str, float]:
    """Mean, min, max and sample standard deviation (NaN for one seed) of relative gaps."""
    return {"mean": statistics.fmean(gaps), "min": min(gaps), "max": max(gaps),
            "sd": statistics.stdev(gaps) if len(gaps) > 1 else float("nan")}


def describe(gaps: Sequence[float]) -> str:
    """``+0.75% mean over 3 seeds (min..max -0.08%..+1.50%, sample sd 0.79%; each: -0.08%, +1.50%, +0.82%)``."""
    s = spread(gaps)
    sd = f"sample sd {100 * s['sd']:.2f}%" if len(gaps) > 1 else "no sd from one seed"
    each = ", ".join(f"{100 * g:+.2f}%" for g in gaps)
    return (f"{100 * s['mean']:+.2f}% mean over {len(gaps)} seed{'s' if len(gaps) > 1 else ''} "
            f"(min..max {100 * s['min']:+.2f}%..{100 * s['max']:+.2f}%, {sd}; each: {each})")


def within(gaps: List[float], bar: float) -> str:
    """The verdict against a bar on |gap|: the mean's, and how many single seeds held it."""
    mean = statistics.fmean(gaps)
    held = sum(abs(g) <= bar for g in gaps)
    return (f"|mean| within {100 * bar:g}%: {'yes' if abs(mean) <= bar else 'NO'}, "
            f"single seeds within it: {held} of {len(gaps)}")
