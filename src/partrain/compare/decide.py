"""From measurements to advice: the what-if link, loss at equal samples, and the recommendation.

Plain functions over `Measurement` lists, so the rule is tested on hand-made figures.

**Simulated bandwidth** (``--bandwidth``): the bytes each strategy measurably sent per step
become seconds on the given link with `partrain.scaling`'s formulas (ring all-reduce for
allreduce and local SGD, the busiest server's fan-in for ps, point-to-point activations for
a pipeline); a step's communication is the larger of what was measured here and what the
link would take. The throughput scales by the ratio of step times.

**Loss at equal samples**: each window's test loss after every epoch (and before the first
step) is a curve over samples trained; every window's epoch holds the same number of samples.
Two strategies compare by their curves' means over the last half of the samples both reached
(`loss_ratio`), not at one evaluation: a test loss bounces 10-25% from one evaluation to the
next on a short window (``partrain bench compare``'s compute scenario, 2026-11-29: hogwild's
loss at the last evaluation both curves reached was 1.27x allreduce's, over the 25% limit
below, and it was left out; its mean over the last half was 0.87x allreduce's, and hogwild
was the fastest strategy of the 5-second runs; on the 164 saved scenarios the means change that
pick alone). The reference is ``allreduce`` (the exact synchronous gradient of the global
batch), else ``single``.

**Speed** is what the rule ranks by: the inverse of the training time a window took to
reach the target loss (`common_target`: the median of the lowest test losses of the windows
that learned, at least `MIN_PROGRESS` below the untrained loss; a strategy fast at not
learning never reaches it), stretched by the what-if link's slowdown; without loss curves,
or when no window learned that much (windows too short to learn: their times to a loss
barely under the untrained one are noise), the samples/s under the what-if link.

**The rule** (`recommend`; each numbered rule is a function of its own, run in order:
`PICK_RULES`, the first that fires picks, then `REVISIONS`):

1. The loss at equal samples is shown, and names the cause when an asynchronous or
   local-update strategy loses by more than ``loss_tolerance``. One that loses by more than
   `LOSS_LIMIT` (25%) is left out of the ranking, however fast it reached the windows'
   target: a window is short and its target shallow, and a strategy that learns that much
   worse per sample (hogwild's colliding updates on a dense model, stale gradients) levels
   off above where the others go on (``partrain bench compare``'s comm scenario: hogwild
   reached the windows' target first at 2.07x allreduce's loss at equal samples, then never
   reached the 5-second runs' target). When every parallel strategy is left out, none is.
2. ``single`` when no parallel strategy is faster than one process by more than
   `TIE_FLOOR` (5%): parallelism must pay for its processes. Not by more than the windows'
   noise: a lead inside the noise is still the likelier side of the tie, and the tie is said
   (see Ties). ``partrain bench compare``'s runs on 2026-11-28 gave 6 such ties to one
   process; the runs to the target put the parallel strategy ahead in 5 (regret 0.09-0.37).
   **At depth**: where one process and the best parallel strategy both went deeper than the
   target in every window, the same 5% is asked at the deepest loss both reached
   (`at_depth`), and one process is picked when the lead is gone there and has shrunk by
   more than the windows' noise (`speed_noise`, at least 5%): the times at depth come from
   the same windows as those at the target, and a lead inside the noise moves with a seed's
   luck at either loss. (``partrain bench compare``'s comm scenario, 2026-11-29: hogwild
   led one process 1.09x at the target on two run-off windows of 1.48 and 3.25 s, a noise
   of 37%, and trailed it 1.09x at a loss 8% deeper: a shrink of 1.18x, inside the noise.
   One process was picked; the runs took 1.43x hogwild's time with it. On the 100 saved
   scenarios the noise moves that pick and one other, a miss either way.) The windows are
   short and their target shallow; a parallel strategy steps on a larger global batch,
   makes fast early progress and learns less per sample later, so its lead shrinks with
   depth, and the loss a user trains to is deeper than any window's (``partrain bench
   compare``'s compute scenario: two DiLoCo workers reached the windows' target 0.375 in
   0.74x one process's time, 0.288 in the same time, and the 5-second runs' target 0.282 in
   1.16x it; the windows and the runs, timed to the same losses, agreed within 0.1 s).
3. ``allreduce``, when it beats one process and no other strategy is more than ``margin``
   (5%, the noise floor) faster to the target: it keeps the exact gradient and needs no
   tuning. (Until 2026-11-29 the margin was 10%, the regret ``partrain bench compare``
   allows: a preference that spends the whole allowance leaves none for the windows' noise.
   In that bench's compute scenario allreduce, kept inside 10% of hogwild (1.05x and 1.08x),
   took 1.64x and 1.37x the fastest strategy's time in the runs; allreduce was the fastest
   in none of the 25 runs of that scenario. On the 96 saved scenarios 5% moves those two
   picks and no other, both to hogwild, the runs' fastest.) The windows' noise is not added
   to the margin: a
   lead inside it goes to the tie below, where the curves over time decide. (Until
   2026-11-28 the bar was the margin plus the noise. Its case: local SGD reached the
   windows' target 1.19x sooner than allreduce, its two windows 17% apart, then took 1.06x
   allreduce's time to the runs' target, a regret of 0.06 had it been picked. Its cost: in
   ``partrain bench compare``'s compute scenario hogwild led allreduce 1.18x inside a 12%
   noise, allreduce was kept, and the runs took 1.74x hogwild's time with it; on the 60
   saved scenarios that was the only pick the change moves.) A small
   communication share of its step does not by itself keep it: the speed is the time to the
   loss, and a strategy can win it by learning more per second, not only by sending less
   (``partrain bench compare``'s compute scenario: local SGD and DiLoCo, whose workers each
   step on their own batch, 8 times between averages, reached the target 1.2-1.3x sooner
   than allreduce with 13% of its step in communication, in the windows and in the 5-second
   runs alike).
4. Otherwise the fastest remaining strategy.
5. **At depth**, the pick of rules 2-4 against each rival that reached the target: at the
   deepest loss both reached in every window, at least `MIN_DEPTH` below the target
   (`at_depth`), a rival faster by more than the windows' noise (at least 5%; plus the 5%
   margin when rule 3 kept allreduce) takes the pick, the one with the largest lead there
   (`_overtaker`). A lead the pick keeps at the target and loses into the noise at depth is
   said instead (`depth_warning`). (``partrain bench compare``'s split scenario: one process
   reached the windows' target 0.168 in 0.71x DiLoCo's time, and 0.143 in 1.34x it; the
   5-second runs' target was 0.143.)

**The run-off** (`contenders`, run by `partrain.compare.run`): one window is one sample
of a strategy's time to the target, and the samples spread: a shared host's speed drifts
between windows, and an asynchronous strategy's loss at equal samples differs from run to
run (``partrain bench compare``'s compute scenario: hogwild reached the windows' target
first, then missed a shallower one in all three of its 5-second runs, ending at 0.59 to
0.80 where the target was 0.58). So, when the comparison has room for it, the first
round's pick and the fastest others it could recommend (`RUNOFF_MOST` in all) repeat their
first windows, in alternating rounds, each round from the next seed (initial weights and data
order, the same for all of them: on the first window's seed a synchronous strategy would
repeat its loss curve sample for sample), and each one's time to the same target is the
median of its windows (a window that never reached it counts as endless; when exactly half
never did, as its whole length, a lower bound: `median_time`). Their spread is also the
noise the ties below are judged by. A strategy whose only window never reached the target
but came within `MIN_DEPTH` of it before the pick reached it is raced as well (`unranked`):
that close, it was cut short or missed by an evaluation's noise, not outrun.

**After a run-off the pick is one of the strategies it raced** (`raced`). The run-off chose
its leaders for their first windows, which the host's drift and the seed's draw made fast as
much as the strategies did; their medians over new seeds then come back toward their true
times, while a strategy left out keeps its one window, a single draw of the same noise. A
left-out strategy that comes level with the leaders after the run-off (within a rule's margin,
or ahead) does so on unequal footing, and no rule picks it: its line says so instead, and
the rules choose among the raced. (``partrain bench compare``'s compute
scenario, 2026-12-04: hogwild's first window took 2.82 s and allreduce's 3.59; hogwild's
second took 4.03, a median of 3.43, and rule 3 kept the unraced allreduce inside its 5%
margin. The runs took allreduce 4.58 s and hogwild 3.29: regret 0.39.)

**Ties**: a window's own noise is the spread of its epochs' seconds (equal samples each,
the first left out: 1.4826 x their median absolute deviation over their median, over the
square root of their number, see `window_noise`); a strategy repeated in the run-off takes
the larger of that and the spread of its windows' times (`speed_noise`). When the runner-up's
speed is within the larger of the two windows' noise (at least `TIE_FLOOR`) of the pick's,
the recommendation says the two are tied instead of naming one as faster. Between two
parallel strategies (but for allreduce kept by rule 3's margin) the tie goes to the one whose
test loss was lower over the training time both ran in every window (`ahead_over_time`): the
mean of a whole curve, not one crossing of it. A parallel pick ranked first by a lower bound
(half of its windows never reached the target, `median_time`) ties so with the fastest
parallel rival whose time was measured, however far below it the bound lies
(`_measured_rival`). Between one process and a parallel strategy the pick stays rule 2's.
When the pick strays further from the synchronous gradient than the other (`risk`:
synchronous, then local updates, then stale gradients, then hogwild's unsynchronised
writes), the other is named as the safer choice: since the run-off repeats on
new seeds, a risky strategy's misses are in its median and its noise already, and on the 40
saved scenarios of ``partrain bench compare`` (2026-11-28) moving such ties to the safer
strategy cost 0.16 and 0.45 of regret in two and gained nothing in any.

**Too little budget** (`too_short_to_tell`, the last revision): when the first windows lasted
under `MIN_WINDOW_S` (1 s, their median), their times are too coarse for a 5% margin, a
lead that shrinks with depth or a tie, and a strategy measured slower than another must not
be recommended for reasons the windows cannot resolve: the fastest measured is, and the
reason says the budget was too small to tell more (``partrain compare --budget 20s``: windows
of 0.6 s).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from ..scaling import Link, allreduce_seconds
from .measure import Measurement, sync_period

COMM_FLOOR = 0.20
#: rule 3: allreduce is kept unless another strategy is this much faster to the target
MARGIN = 0.05
LOSS_TOLERANCE = 0.10
#: an asynchronous or local-update strategy whose loss at equal samples is this far above the
#: reference's is not recommended (see `converges_worse`)
LOSS_LIMIT = 0.25
#: the target loss must lie this far below the untrained loss to rank by time to it
MIN_PROGRESS = 0.10
#: the smallest relative difference in speed that is not called a tie
TIE_FLOOR = 0.05
#: a loss this far below the target (relative) is deep enough to rank at again (`at_depth`): a little
#: deeper, the times to it differ from those to the target by an evaluation's noise, not by depth
MIN_DEPTH = 0.05
#: the strategies the run-off repeats
RUNOFF_MOST = 3
#: windows shorter than this (the median of the first windows) cannot rank strategies by the rules'
#: finer points (margins, depth, ties): `too_short_to_tell`
MIN_WINDOW_S = 1.0
#: what a median time over windows half of which never reached the target is (`median_time`)
LOWER_BOUND = "a lower bound (half of its windows ended above the target)"


@dataclass
class Recommendation:
    """The strategy to use, why, and one line for each of the others."""

    pick: str
    why: str
    others: dict[str, str] = field(default_factory=dict)
    #: strategies whose speed lies within the windows' noise of the pick's (empty: a clear pick)
    tied: list[str] = field(default_factory=list)
    #: the noise that decided the tie (relative)
    noise: float = math.nan


def simulate_link(m: Measurement, bandwidth: float | None, latency_s: float = 20e-6,
                  shards: int = 1) -> None:
    """Set ``m.simulated_comm_s`` and ``m.effective_samples_per_s`` for a link of ``bandwidth`` bytes/s
    (None: the machine's own, as measured)."""
    m.effective_samples_per_s = m.samples_per_s
    m.simulated_comm_s = 0.0
    if bandwidth is None or not m.ok or m.workers < 2 or not m.step_s > 0:
        return
    link = Link(bandwidth, latency_s)
    comm = link_seconds(m, link, shards)
    m.simulated_comm_s = comm
    step = m.step_s
    simulated = m.data_s + m.compute_s + max(m.comm_s, comm)
    m.effective_samples_per_s = m.samples_per_s * step / simulated


def link_seconds(m: Measurement, link: Link, shards: int = 1) -> float:
    """Seconds per step that ``m``'s measured bytes per step would take on ``link``."""
    n, sent = m.workers, m.bytes_per_step
    if m.strategy in ("allreduce", "localsgd"):
        # bytes_per_step is what each worker all-reduced (S per sync, S/H per step for local SGD)
        syncs = 1.0 if m.strategy == "allreduce" else 1.0 / sync_period(m.options)
        return allreduce_seconds(n, sent, Link(link.bandwidth, link.latency_s * syncs))
    if m.strategy == "ps":
        # the busiest shard's link carries every worker's push and pull of a step
        return n * sent / (shards * link.bandwidth) + 2 * link.latency_s
    if m.strategy == "pipeline":
        return sent / link.bandwidth + link.latency_s
    return 0.0


def mean_between(xs: list[float], ys: list[float], lo: float, hi: float) -> float:
    """The mean over ``[lo, hi]`` of the curve through the points ``(xs, ys)``, linear between them
    (NaN where the points do not cover the span)."""
    if len(xs) < 2 or not xs[0] <= lo < hi <= xs[-1]:
        return math.nan
    area = 0.0
    for x0, y0, x1, y1 in zip(xs, ys, xs[1:], ys[1:]):
        a, b = max(x0, lo), min(x1, hi)
        if b > a:  # the piece of this segment inside the span, a trapezoid
            slope = (y1 - y0) / (x1 - x0)
            area += (b - a) * (2 * y0 + slope * (a - x0 + b - x0)) / 2
    return area / (hi - lo)


def loss_ratio(m: Measurement, ref: Measurement) -> float:
    """``m``'s test loss over ``ref``'s, each averaged over the last half of the samples both
    curves reach (`mean_between`, linear between evaluations)."""
    if not m.curve or not ref.curve:
        return math.nan
    samples = min(m.curve[-1][0], ref.curve[-1][0])
    mine, theirs = (_late_mean(c, samples) for c in (m.curve, ref.curve))
    return mine / theirs if theirs and theirs == theirs and mine == mine else math.nan


def _late_mean(curve: list[tuple[float, float]], samples: float) -> float:
    """A loss curve's mean over its samples ``samples / 2`` to ``samples`` (NaN losses left out)."""
    points = [(s, v) for s, v in curve if v == v]
    return mean_between([s for s, _ in points], [v for _, v in points], samples / 2, samples)


def compare_losses(measurements: list[Measurement]) -> Measurement | None:
    """Set each measurement's ``loss_ratio`` against the reference's at equal samples (and
    ``loss_vs_single``); return the reference."""
    ok = {m.label: m for m in measurements if m.ok}
    ref = ok.get("allreduce") or ok.get("single")
    single = ok.get("single")
    for m in ok.values():
        if ref is not None:
            m.loss_ratio = loss_ratio(m, ref)
        if single is not None:
            m.loss_vs_single = loss_ratio(m, single)
    return ref


def waiting_share(m: Measurement) -> float:
    """Communication (and waiting on other workers) as a share of the step, under the what-if link."""
    step = m.data_s + m.compute_s + max(m.comm_s, m.simulated_comm_s)
    return max(m.comm_s, m.simulated_comm_s) / step if step > 0 else math.nan


@dataclass(frozen=True)
class Context:
    """What every rule of `recommend` reads, worked out once from the measurements.

    ``pickable`` are the strategies the rule may pick (`raced`); ``parallel`` the multi-worker ones
    among them that do not learn far worse per sample than the reference ``ref``
    (`converges_worse`; all of them when every one does), ``best`` the fastest of those;
    ``allreduce`` and ``single`` are looked up among ``pickable``. ``target`` is the loss the
    speeds time to (NaN: no loss curves, the speeds are samples/s)."""

    ref: Measurement | None
    target: float
    pickable: list[Measurement]
    parallel: list[Measurement]
    best: Measurement | None
    allreduce: Measurement | None
    single: Measurement | None
    straggler: bool
    comm_floor: float
    margin: float

    @classmethod
    def of(cls, ok: list[Measurement], *, straggler: bool, comm_floor: float, margin: float) -> Context:
        """The context of ``ok`` (the measurements that ran, with ``effective_samples_per_s`` set): sets
        their ``loss_ratio`` and speeds as a side effect (`compare_losses`, `set_speeds`)."""
        ref = compare_losses(ok)
        target = set_speeds(ok)
        pickable = raced(ok)
        by_label = {m.label: m for m in pickable}
        # a strategy that learns far worse per sample than the reference is not recommended on the
        # strength of a short window: the windows' target is shallow, and such a strategy (hogwild's
        # colliding updates on a dense model, stale gradients) levels off above where the others go on
        parallel = [m for m in pickable if m.workers > 1 and not converges_worse(m, ref)] or \
            [m for m in pickable if m.workers > 1]
        best = max(parallel, key=lambda m: m.speed) if parallel else None
        return cls(ref, target, pickable, parallel, best, by_label.get("allreduce"), by_label.get("single"),
                   straggler, comm_floor, margin)

    def rivals(self, pick: Measurement) -> list[Measurement]:
        """The strategies ``pick`` is held against, fastest first: the others the rule may pick (one
        process, or a parallel strategy that does not learn far worse), with a speed."""
        return sorted((m for m in self.pickable if m is not pick and m.speed == m.speed
                       and (m in self.parallel or m.workers == 1)), key=lambda m: m.speed, reverse=True)


@dataclass(frozen=True)
class Draft:
    """A recommendation as the rules build it: the pick, the reason so far, and the parts worded
    last: ``rival`` (its speed against the pick's is added in parentheses) and ``tail`` (closes the
    reason). ``by_depth``: the pick was decided at a loss deeper than the target (a tie at the
    target then does not reopen it)."""

    pick: Measurement
    why: str
    rival: Measurement | None = None
    tail: str = ""
    by_depth: bool = False
    tied: tuple[str, ...] = ()
    noise: float = math.nan

    def words(self) -> str:
        """The whole reason: ``why``, the rival's speed, the tail."""
        why = self.why
        if self.rival is not None:
            why += f" ({self.rival.label}: {self.rival.speed / self.pick.speed:.2f}x its speed)"
        return why + self.tail


def one_process_catches_up_at_depth(ctx: Context) -> Draft | None:
    """Rule 2 at depth. Fires when the best parallel strategy beat one process by more than
    `TIE_FLOOR` at the target, but at the deepest loss both reached in every window (`at_depth`) its
    lead is gone (under the floor) and has shrunk by more than the pair's noise (`pair_noise`): a
    parallel strategy's larger global batch makes fast early progress and learns less per sample
    later, and the loss a user trains to is deeper than any window's."""
    single, best = ctx.single, ctx.best
    if single is None or best is None or not single.speed * (1 + TIE_FLOOR) < best.speed:
        return None
    deep = at_depth(single, best, ctx.target)
    if deep is None:
        return None
    loss, mine, theirs = deep
    if not (theirs >= mine / (1 + TIE_FLOOR) and best.speed > single.speed * mine / theirs * (1 + pair_noise(single, best))):
        return None
    why = (f"one process catches up with depth: {_overtaken(best, single, ctx.target, loss, theirs, mine)}"
           + (" (one process learns more per sample)" if best.loss_vs_single > 1 else "")
           + ": parallelism does not pay at the loss you train to")
    return Draft(single, why, by_depth=True)


def one_process_is_enough(ctx: Context) -> Draft | None:
    """Rule 2. Fires when one process ran and no parallel strategy is faster than it by more than
    `TIE_FLOOR` (or none ran): parallelism must pay for its processes. The words say which case it
    is: the only strategy, no parallel one reached the target, one process faster outright, or a
    parallel lead under the floor."""
    single, best = ctx.single, ctx.best
    if single is None or not (best is None or single.speed * (1 + TIE_FLOOR) >= best.speed):
        return None
    if best is None:
        return Draft(single, "the only strategy that ran")
    if best.speed == 0 < single.speed:
        return Draft(single, "no parallel strategy reached the target loss (in most of its windows): parallelism "
                     "does not pay here")
    if single.speed >= best.speed:
        return Draft(single, "one process reaches the loss sooner than the best parallel strategy", best,
                     ": parallelism does not pay here")
    return Draft(single, f"one process does as well with fewer processes (no parallel strategy is {TIE_FLOOR:.0%} "
                 "faster): parallelism does not pay here")


def allreduce_within_margin(ctx: Context) -> Draft | None:
    """Rule 3. Fires when ``allreduce`` beats one process (or none ran) and no parallel strategy is
    more than ``margin`` faster to the target: it keeps the exact gradient and needs no tuning. A
    lead inside the windows' noise but over the margin is the tie rule's, not this one's."""
    allreduce, best, single = ctx.allreduce, ctx.best, ctx.single
    if allreduce is None or best is None or not (single is None or allreduce.speed > single.speed) or \
            not best.speed <= allreduce.speed * (1 + ctx.margin):
        return None
    rival = None if best is allreduce else best
    lead = f"{ctx.margin:.0%} faster"
    if waiting_share(allreduce) < ctx.comm_floor:
        return Draft(allreduce, f"communication and waiting are only {waiting_share(allreduce):.0%} of its step, and "
                     f"no other strategy is {lead}", rival, ": allreduce keeps the exact gradient of the global batch")
    return Draft(allreduce, f"no other strategy is {lead}", rival,
                 "; allreduce keeps the exact gradient of the global batch")


def fastest_parallel(ctx: Context) -> Draft | None:
    """Rule 4. Fires when a parallel strategy ran (and rules 2 and 3 did not): the fastest of them.
    The reason holds it against allreduce or the reference; without either (a run-off between
    others), or when that never reached the target (but for a straggler's, whose waiting is the
    reason), against the runner-up (`_why_faster`)."""
    best = ctx.best
    if best is None:
        return None
    base = ctx.allreduce or ctx.ref
    runner_up = max((m for m in ctx.pickable if m is not best and m.speed > 0), key=lambda m: m.speed, default=None)
    if runner_up is not None and (base is None or not (base.speed > 0 or ctx.straggler)):
        base = runner_up
    return Draft(best, _why_faster(best, base, ctx.straggler))


def only_strategy(ctx: Context) -> Draft:
    """The last resort: no rule above fired (no parallel strategy and no one process to pick among
    the rule's), so the first strategy the rule may pick is the one that ran."""
    return Draft(ctx.pickable[0], "the only strategy that ran")


def overtaken_at_depth(ctx: Context, draft: Draft) -> Draft | None:
    """Rule 5. Fires when the pick (not already decided at depth) reached the target and a rival is
    faster by more than the pair's noise (plus ``margin`` when rule 3 kept allreduce) at the
    deepest loss both reached in every window (`_overtaker`): the one with the largest lead there
    takes the pick. The windows' target is shallow; the loss a user trains to is deeper."""
    pick = draft.pick
    if draft.by_depth or not (pick.speed > 0 and math.isfinite(pick.speed)):
        return None
    kept = ctx.margin if pick is ctx.allreduce else 0.0
    overtaker = _overtaker(pick, ctx.rivals(pick), ctx.target, kept)
    if overtaker is None:
        return None
    new, loss, mine, theirs = overtaker
    return Draft(new, f"it catches up with depth: {_overtaken(pick, new, ctx.target, loss, mine, theirs)}",
                 by_depth=True)


def tie_within_noise(ctx: Context, draft: Draft) -> Draft | None:
    """Ties. Fires when the pick (not decided at depth) reached the target and the runner-up's speed
    lies within the pair's noise (`pair_noise`) of it, or the pick ranked first only by a lower bound
    against a parallel rival whose time was measured (`_measured_rival`): the two are named as
    tied, and between two parallel strategies (allreduce kept by rule 3's margin aside) the one whose
    test loss was lower over the time both trained takes the pick (`ahead_over_time`); a safer
    runner-up (`risk`) is named. When the pick is clear, the noise it was judged within is still
    recorded (``Recommendation.noise``)."""
    pick = draft.pick
    rivals = ctx.rivals(pick)
    if not rivals or draft.by_depth or not (pick.speed > 0 and math.isfinite(pick.speed)):
        return None
    # a pick whose time is a lower bound is not ranked above a parallel rival whose time was measured
    measured = _measured_rival(pick, rivals) if pick is not ctx.allreduce else None
    second = measured or rivals[0]
    noise = pair_noise(pick, second)
    if measured is None and not abs(second.speed / pick.speed - 1) <= noise:
        return dataclasses.replace(draft, noise=noise)
    return _tied(ctx, draft, second, measured, noise)


def _tied(ctx: Context, draft: Draft, second: Measurement, measured: Measurement | None, noise: float) -> Draft:
    """The words of `tie_within_noise` once it fired: the times to the target cannot tell ``draft``'s
    pick and ``second`` apart (``measured``: the rival whose measured time the pick's bound met)."""
    pick, why, rival, tail = draft.pick, draft.why, draft.rival, draft.tail
    # between two parallel strategies, the one whose test loss was lower over the time both trained
    # (allreduce is the pick here only by rule 3's margin, which a tie does not overrule)
    ahead = ahead_over_time(pick, second) if second.workers > 1 < pick.workers and pick is not ctx.allreduce \
        else None
    if measured is not None:  # what was said of the pick's speed rested on its bound (or ranked it below)
        why, rival, tail = "", None, ""
    if ahead is not None:
        span, mine, theirs = ahead
        if theirs < mine:
            pick, second, mine, theirs = second, pick, theirs, mine
            why, rival, tail = "", None, ""
        lead = 1 - mine / theirs
        why = (f"{why + '; ' if why else ''}over the {span:.3g} s both trained in every window, its test loss "
               + (f"averaged {lead:.0%} below {second.label}'s: ahead for most of the way, not only at the target"
                  if lead >= TIE_FLOOR else f"averaged within {TIE_FLOOR:.0%} of {second.label}'s: a tie the "
                  "whole way"))
    elif second.workers == 1 < pick.workers:  # rule 2's floor, not the noise, decided this one
        why, rival, tail = (f"the faster of the two in these windows, by more than the {TIE_FLOOR:.0%} "
                            "parallelism must pay for its processes"), None, ""
    if risk(second) < risk(pick) and second.workers > 1:
        why += f"; {second.label} is the safer choice: it {RISKS[risk(second)]}"
    if rival is second:
        rival = None  # the tie's own words give its speed
    if measured is None:
        why = (f"tied with {second.label} ({second.speed / pick.speed:.2f}x its speed, within the windows' "
               f"noise of {noise:.0%}); {why}")
    elif measured is pick:
        why = (f"tied with {second.label}, whose {second.time_to_loss:.3g} s to the target is {LOWER_BOUND}, "
               f"against this one's measured {pick.time_to_loss:.3g} s: the times cannot rank the two; {why}")
    else:
        why = (f"tied with {second.label}: its own {pick.time_to_loss:.3g} s to the target is {LOWER_BOUND}, "
               f"{second.label}'s {second.time_to_loss:.3g} s was measured: the times cannot rank the two; {why}")
    return Draft(pick, why, rival, tail, draft.by_depth, (second.label,), noise)


def too_short_to_tell(ctx: Context, draft: Draft) -> Draft | None:
    """Too little budget. Fires when the first windows lasted under `MIN_WINDOW_S` (their median) and
    the pick is not the fastest measured: a sub-second window's time is noise, too coarse for the
    rules above (a margin of 5%, a lead that shrinks with depth, a tie), so the fastest measured of
    those the rule may pick is recommended, and the reason says that the budget was too small to
    tell. (``partrain compare --budget 20s`` on the bundled digits job: windows of 0.6 s, and a
    pick that one process, measured twice as fast, was not.)"""
    windows = [w for w in (window_seconds(m)[0] for m in ctx.pickable) if w == w]
    if len(windows) < 2 or not statistics.median(windows) < MIN_WINDOW_S:
        return None
    ranked = [m for m in ctx.pickable if m.speed > 0]
    fastest = max(ranked, key=lambda m: m.speed, default=None)
    if fastest is None or fastest is draft.pick or not fastest.speed > draft.pick.speed:
        return None
    return Draft(fastest, f"the fastest measured ({fastest.speed / draft.pick.speed:.2f}x the speed of "
                 f"{draft.pick.label}, which the rules would have picked: {draft.words()}); the budget was too "
                 f"small to tell more: the windows lasted {statistics.median(windows):.2g} s, under "
                 f"{MIN_WINDOW_S:g} s, where a time is noise (a larger --budget gives longer windows)")


#: rules 2-4 and the last resort, in order: the first that fires picks (the module docstring)
PICK_RULES: tuple[Callable[[Context], Draft | None], ...] = (
    one_process_catches_up_at_depth, one_process_is_enough, allreduce_within_margin, fastest_parallel, only_strategy)
#: then each of these, in order, may revise the pick (rule 5 at depth, the ties, too little budget)
REVISIONS: tuple[Callable[[Context, Draft], Draft | None], ...] = (overtaken_at_depth, tie_within_noise,
                                                                    too_short_to_tell)


def recommend(measurements: list[Measurement], *, straggler: bool = False, comm_floor: float = COMM_FLOOR,
              margin: float = MARGIN, loss_tolerance: float = LOSS_TOLERANCE) -> Recommendation | None:
    """The rule of the module docstring over measurements with ``effective_samples_per_s`` set: the
    first of `PICK_RULES` that fires picks, each of `REVISIONS` may then revise the pick, and every
    other strategy gets its line (`_why_not`).

    ``straggler``: a worker was slowed on purpose, so a synchronous strategy's waiting is
    the straggler's doing (the reasons say so), not the network's.
    """
    ok = [m for m in measurements if m.ok and m.effective_samples_per_s == m.effective_samples_per_s]
    if not ok:
        return None
    ctx = Context.of(ok, straggler=straggler, comm_floor=comm_floor, margin=margin)
    draft = next(d for d in (rule(ctx) for rule in PICK_RULES) if d is not None)
    for revise in REVISIONS:
        draft = revise(ctx, draft) or draft
    pick = draft.pick
    others = {m.label: _why_not(m, pick, ctx.ref, loss_tolerance, ctx.target) for m in measurements
              if m.label != pick.label}
    return Recommendation(pick.label, draft.words(), others, list(draft.tied), draft.noise)


#: a tie decided within windows' noise at least this large is flagged as unsure (`unsure_warning`)
UNSURE_NOISE = 0.15


def unsure_warning(rec: Recommendation | None) -> str | None:
    """One line when the recommendation is a tie the windows' noise (`Recommendation.noise`) leaves
    wide open, at least `UNSURE_NOISE`, else None. The windows' times spread that much when the
    host's speed drifts between them, and with the draw of each run-off round's seed: in
    ``partrain bench compare``'s split scenario one process's two windows ran the same work at
    7,853 and 5,345 samples/s minutes apart, its noise came to 20%, and hogwild's 1.14x lead fell
    inside it; the 5-second runs put hogwild 1.36x ahead."""
    if rec is None or not rec.tied or not rec.noise >= UNSURE_NOISE:
        return None
    return (f"{rec.pick} and {', '.join(rec.tied)} are tied within the windows' noise of {rec.noise:.0%} (a strategy's "
            "repeated windows took that much longer or shorter: the seed's draw and the host's speed), so which is "
            "faster these windows cannot tell: a larger --budget gives longer windows and more run-off rounds")


def contenders(measurements: list[Measurement], most: int = RUNOFF_MOST) -> list[Measurement]:
    """The strategies a run-off repeats: the first round's pick, then the fastest of those the rule
    could recommend (one process, and the parallel strategies that reached the target and do not
    learn far worse per sample, `converges_worse`), ``most`` in all; none when fewer than two
    qualify, or when the windows set no target loss.

    No runner-up is let off for the pick's large lead: in ``partrain bench compare``'s split
    scenario hogwild reached the first round's target in 0.56x DiLoCo's time, then reached the
    5-second runs' target in 2 of 3 runs, later than DiLoCo in all 3.

    A strategy that never reached the target but came within `MIN_DEPTH` of it before the pick
    reached it (`unranked`) is raced too, ranked by when it came that close: the windows cannot
    rank it below the pick (in ``partrain bench compare``'s compute scenario hogwild's window
    ended at 3.76 s, 1% above the target, where the pick took 4.16 s; in another run its noisy
    curve came within 2% of the target at 3.61 s, then went back up and ended at 4.86 s, where
    the pick took 4.38 s. On the runs to the target hogwild was the fastest both times)."""
    first = recommend(measurements)
    ok = [m for m in measurements if m.ok and m.effective_samples_per_s == m.effective_samples_per_s]
    ref = compare_losses(ok)
    target = set_speeds(ok)
    if first is None or target != target:  # no target: the windows did not learn enough to time a loss
        return []
    pick = next(m for m in ok if m.label == first.pick)
    able = sorted((m for m in ok if (0 < m.speed < math.inf or unranked(m, pick, target))
                   and not converges_worse(m, ref)),
                  key=lambda m: m.time_to_loss if 0 < m.speed < math.inf else near_miss_s(m, target))
    close = ([pick] + [m for m in able if m is not pick])[:most]
    return close if len(close) >= 2 else []


def raced(ok: list[Measurement]) -> list[Measurement]:
    """The strategies the rule may pick among ``ok``: after a run-off (two or more of them repeated
    their windows), those it raced; else all of them (see the module docstring)."""
    leaders = [m for m in ok if m.runoff]
    return leaders if len(leaders) >= 2 else ok


def unranked(m: Measurement, pick: Measurement, target: float) -> bool:
    """``m`` never reached ``target`` in its (only) window but came within `MIN_DEPTH` of it (a near
    miss: that close, the difference is an evaluation's noise) before ``pick`` reached the target
    (`near_miss_s`): its window was cut short, or its curve's noise kept it above, and its time may
    still be shorter than the pick's. (A pipeline whose short window ended far above the target is
    not one.)"""
    return not m.runoff and m.speed == 0 and bool(m.curve) and 0 < pick.time_to_loss < math.inf and \
        near_miss_s(m, target) < pick.time_to_loss


def near_miss_s(m: Measurement, target: float) -> float:
    """The training seconds until ``m``'s first window came within `MIN_DEPTH` above ``target``
    (`times_to`: stretched by the what-if link like the pick's time it is held against; NaN: never)."""
    return times_to(m, (1 + MIN_DEPTH) * target)[0]


#: what a strategy does to the gradient, by `risk` (0: synchronous, the exact gradient)
RISKS = ("keeps the exact gradient of the global batch", "averages its workers' models every few steps",
         "applies gradients computed on stale weights", "lets its workers' updates overwrite each other")


def risk(m: Measurement) -> int:
    """How far a strategy's updates stray from the synchronous gradient: 0 synchronous (single,
    allreduce, pipeline, ps with bounded staleness), 1 local updates averaged (localsgd, DiLoCo),
    2 asynchronous stale gradients (ps without a staleness bound), 3 unsynchronised writes (hogwild).
    A tie whose pick has the higher risk names the other as the safer choice (in ``partrain bench
    compare``'s runs of 2026-11-26 hogwild reached the target in 2 of 3 runs where the strategies
    it tied with reached it in all 3; with the run-off on new seeds such misses show in its median)."""
    if synchronous(m):
        return 0
    return {"localsgd": 1, "ps": 2}.get(m.strategy, 3)


def converges_worse(m: Measurement, ref: Measurement | None, limit: float = LOSS_LIMIT) -> bool:
    """``m`` updates asynchronously or locally and its test loss at equal samples is more than
    ``limit`` above the synchronous reference's."""
    return ref is not None and m is not ref and not synchronous(m) and m.loss_ratio > 1 + limit


def window_noise(m: Measurement) -> float:
    """The relative noise of a window's time: the spread of its epoch times (1.4826 x their median
    absolute deviation over their median, robust to one slow epoch), over the square root of their
    number (a time to target sums that many epochs); the first epoch is left out (warm-up), and
    fewer than 2 epochs give 0."""
    epochs = [b - a for a, b in zip(m.curve_s, m.curve_s[1:])][1:]
    if len(epochs) < 2:
        return 0.0
    mid = statistics.median(epochs)
    mad = statistics.median(abs(e - mid) for e in epochs)
    return 1.4826 * mad / mid / math.sqrt(len(epochs)) if mid > 0 else 0.0


def set_speeds(ok: list[Measurement]) -> float:
    """Set each measurement's ``times_to_loss`` (its window's, then its run-off windows'),
    ``time_to_loss`` (their median) and ``speed`` (see the module docstring); return the
    target loss (NaN when the windows have no loss curves). The target is set by the first
    windows alone: the run-off re-times its strategies to the same loss."""
    lows = [min(v for _, v in m.curve) for m in ok if m.curve and m.curve_s]
    start = max((m.curve[0][1] for m in ok if m.curve), default=math.nan)
    target = common_target(lows, start) if len(lows) == len(ok) else math.nan
    for m in ok:
        m.times_to_loss = times_to(m, target)
        m.time_to_loss = median_time(m.times_to_loss, window_seconds(m))
        if target != target:
            m.speed = m.effective_samples_per_s
        else:
            m.speed = 1 / m.time_to_loss if m.time_to_loss > 0 else (0.0 if m.time_to_loss != m.time_to_loss
                                                                     else math.inf)
    return target


def times_to(m: Measurement, target: float) -> list[float]:
    """The training seconds each of ``m``'s windows (its first, then the run-off's) took to reach
    ``target``, stretched by the what-if link's slowdown (NaN: never reached)."""
    return [time_to_reach(w.curve_s, [v for _, v in w.curve], target) * _slowdown(m) for w in (m, *m.runoff)]


def window_seconds(m: Measurement) -> list[float]:
    """The training seconds of each of ``m``'s windows (its first, then the run-off's), stretched as
    `times_to` stretches its times."""
    return [(w.curve_s[-1] if w.curve_s else math.nan) * _slowdown(m) for w in (m, *m.runoff)]


def _slowdown(m: Measurement) -> float:
    """How much longer a step takes on the what-if link than as measured (NaN without a rate)."""
    return m.samples_per_s / m.effective_samples_per_s if m.effective_samples_per_s > 0 else math.nan


def mean_loss(m: Measurement, seconds: float) -> float:
    """The median over ``m``'s windows of its test loss averaged over the first ``seconds`` of training
    (as `times_to` stretches them), linear between evaluations; NaN when a window has no curve or is
    shorter."""
    values = []
    for w in (m, *m.runoff):
        times = [t * _slowdown(m) for t in w.curve_s]
        losses = [v for _, v in w.curve][:len(times)]
        if len(losses) < 2 or not times[-1] >= seconds > 0:
            return math.nan
        values.append(mean_between(times[:len(losses)], losses, times[0], seconds))
    return statistics.median(values) if values else math.nan


def ahead_over_time(a: Measurement, b: Measurement) -> tuple[float, float, float] | None:
    """``(seconds, a's mean test loss, b's)`` over the training time every window of both ran
    (`mean_loss`), or None without curves to average.

    Two strategies tied on the time to the target are told apart by the whole of their curves:
    a time to a loss is one crossing of a bouncing curve, and the mean over ten or so evaluations
    is far steadier. Replayed on the 48 saved scenarios of ``partrain bench compare``
    (2026-11-28), 12 ended in a tie between two parallel strategies; this picked the one faster
    to the runs' target in 10, and the two it missed were ties the whole way (mean losses within
    1%). The rule it replaced (the safer of the two within 5%, else the faster) cost 0.23, 0.38
    and 0.28 of regret in three of them: hogwild tied with DiLoCo or local SGD at 0.96-1.00x
    their speed, its test loss 10-17% lower over the windows, then 1.2-1.4x faster to the runs'
    target."""
    span = min(window_seconds(a) + window_seconds(b))
    if not span > 0:
        return None
    mine, theirs = mean_loss(a, span), mean_loss(b, span)
    return (span, mine, theirs) if mine > 0 and theirs > 0 else None


def _measured_rival(pick: Measurement, rivals: list[Measurement]) -> Measurement | None:
    """When ``pick``, a parallel strategy, is ranked first by a lower bound (half of its windows never
    reached the target, `median_time`): the fastest parallel rival (``rivals`` by speed, fastest
    first) whose time to the target was measured and is no shorter than that bound; else None.

    The bound is the middle of the pick's one time and the shortest length of a window that never
    got there, and the time it stands for may be anything above it: in ``partrain bench
    compare``'s compute scenario DiLoCo's two windows took 2.63 s and more than 3.5 s (a bound of
    3.07 s), hogwild's took 3.43 and 3.37, and the 5-second runs took DiLoCo 4.07 s and hogwild
    3.16. On the 68 saved scenarios of 2026-11-28 three picks were bounded; handing them to the
    tie rule moved that one alone."""
    if pick.workers < 2 or not half_never(pick.times_to_loss):
        return None
    return next((m for m in rivals if m.workers > 1 and 0 < m.speed <= pick.speed
                 and not half_never(m.times_to_loss)), None)


def deepest_common(a: Measurement, b: Measurement) -> float:
    """The deepest test loss every window of ``a`` and of ``b`` reached (NaN without curves)."""
    lows = [min(v for _, v in w.curve) for m in (a, b) for w in (m, *m.runoff) if w.curve]
    return max(lows) if lows else math.nan


def _at_depth_each(pick: Measurement, rivals: list[Measurement], target: float):
    """For each rival that reached the target (and is not ``pick``) with a deeper loss to rank at
    (`at_depth`): ``(rival, loss, pick's time, rival's time, noise)``, the noise `pair_noise`."""
    for m in rivals:
        if m is pick or not 0 < m.time_to_loss < math.inf:
            continue
        deep = at_depth(pick, m, target)
        if deep is not None:
            yield (m, *deep, pair_noise(pick, m))


def _overtaker(pick: Measurement, rivals: list[Measurement], target: float,
               kept: float = 0.0) -> tuple[Measurement, float, float, float] | None:
    """The rival that reaches the deepest loss it and ``pick`` both reached (`at_depth`) the most
    sooner than ``pick``, by more than their windows' noise (at least `TIE_FLOOR`) plus ``kept``:
    ``(rival, loss, pick's time, rival's time)``; None when no rival does."""
    faster = [(m, loss, mine, theirs) for m, loss, mine, theirs, noise in _at_depth_each(pick, rivals, target)
              if mine / theirs > 1 + noise + kept]
    return max(faster, key=lambda f: f[2] / f[3], default=None)


def _overtaken(old: Measurement, new: Measurement, target: float, loss: float, old_s: float, new_s: float) -> str:
    """Words for ``old`` reaching the target sooner than ``new`` and ``loss`` (deeper) later: their
    times there are ``old_s`` and ``new_s``."""
    return (f"{old.label} reached the target {target:.4g} in {old.time_to_loss / new.time_to_loss:.2f}x its time, "
            f"but {loss:.4g} (the deepest loss both reached in every window) in {old_s / new_s:.2f}x it")


def at_depth(a: Measurement, b: Measurement, target: float) -> tuple[float, float, float] | None:
    """``(loss, a's time, b's time)``: the deepest loss every window of ``a`` and ``b`` reached
    (`deepest_common`) and each one's median training seconds to it, when that loss lies at least
    `MIN_DEPTH` below ``target``; else None."""
    loss = deepest_common(a, b)
    if not loss <= (1 - MIN_DEPTH) * target:
        return None
    mine, theirs = (median_time(times_to(m, loss), window_seconds(m)) for m in (a, b))
    return (loss, mine, theirs) if mine > 0 and theirs > 0 else None


def depth_warning(measurements: list[Measurement], rec: Recommendation | None, target: float) -> str | None:
    """One line when the pick's lead at the target does not hold at a deeper loss, else None.

    The windows are short, so their target is shallow, and a lead there can shrink with depth:
    a strategy that steps on a larger global batch (or on stale or local updates) makes fast
    early progress and learns less per sample later. For every rival that reached the target
    (and does not learn far worse per sample, `converges_worse`), the pick and the rival are
    timed again to the deepest loss both reached in every window (`deepest_common`); when the
    pick led beyond the windows' noise at the target and no longer does there, the rival whose
    standing rose most is named. A lead that turns beyond the noise moves the pick instead
    (rules 2 and 5 at depth, in the module docstring)."""
    if rec is None or target != target:
        return None
    ok = [m for m in measurements if m.ok and m.effective_samples_per_s == m.effective_samples_per_s]
    pick = next((m for m in ok if m.label == rec.pick), None)
    if pick is None or not 0 < pick.time_to_loss < math.inf:
        return None
    ref = compare_losses(ok)
    rivals = [m for m in ok if not converges_worse(m, ref)]
    shrunk = [(rival, deeper, rival.time_to_loss / pick.time_to_loss, theirs / mine)
              for rival, deeper, mine, theirs, noise in _at_depth_each(pick, rivals, target)
              if rival.time_to_loss / pick.time_to_loss > 1 + noise and theirs / mine <= 1 + noise]
    if not shrunk:
        return None
    rival, deeper, lead, lead_deeper = min(shrunk, key=lambda s: s[3])
    return (f"{pick.label}'s lead over {rival.label} shrinks with depth: {lead:.2f}x its speed to the target "
            f"{target:.4g}, {lead_deeper:.2f}x to {deeper:.4g} (the deepest loss both reached in every window), so "
            f"at the loss you train to {rival.label} may be the faster: a larger --budget gives longer windows and "
            "a deeper target")


def median_time(times: list[float], lengths: list[float] | None = None) -> float:
    """The median of times to a target where NaN (never reached) counts as endless; NaN when more
    than half never reached it.

    With ``lengths`` (each time's window length, in the same seconds), exactly half that never
    reached it (an even count) give a lower bound instead of NaN: the median then falls between
    the slowest window that reached the target and the shortest that did not, which took at
    least its whole length (two run-off windows, 4.16 s and one that ended at 4.65 s above the
    target: 4.41 s). Without that, a strategy the run-off raced on a new seed lost to one it
    never raced as soon as one of its two windows ended short of the target."""
    if not times:
        return math.nan
    reached = sorted(t for t in times if t == t)
    never = len(times) - len(reached)
    if half_never(times) and lengths is not None:
        bound = min((length for t, length in zip(times, lengths) if t != t), default=math.nan)
        return (reached[-1] + max(reached[-1], bound)) / 2 if bound == bound else math.nan
    mid = statistics.median(reached + [math.inf] * never)
    return mid if math.isfinite(mid) else math.nan


def half_never(times: list[float]) -> bool:
    """Exactly half of ``times`` are NaN (never reached): `median_time` then gives a lower bound."""
    return bool(times) and 2 * sum(t != t for t in times) == len(times)


def speed_noise(m: Measurement) -> float:
    """The relative noise of a strategy's time to the target: its window's (`window_noise`), or, when
    the run-off repeated it, the larger of that and the spread of its windows' times (their
    sample standard deviation over the square root of their number, over their median); a
    repeat that never reached the target leaves the spread to the others."""
    return max(window_noise(m), relative_error(m.times_to_loss))


def pair_noise(a: Measurement, b: Measurement) -> float:
    """The noise two strategies' times are compared within: the larger of their `speed_noise`, at
    least `TIE_FLOOR`."""
    return max(speed_noise(a), speed_noise(b), TIE_FLOOR)


def relative_error(times: list[float]) -> float:
    """The standard error of the median of repeated times, relative to it: their sample standard
    deviation over the square root of their number, over their median (NaN, never reached, left
    out); 0 with fewer than two."""
    kept = [t for t in times if t == t]
    mid = statistics.median(kept) if len(kept) >= 2 else 0.0
    return statistics.stdev(kept) / math.sqrt(len(kept)) / mid if mid > 0 else 0.0


def common_target(lows: list[float], start: float) -> float:
    """The target loss of a comparison: the upper median of the lowest losses of the strategies
    that learned, those whose lowest lies at least `MIN_PROGRESS` below the untrained loss
    ``start``; NaN when none did (the windows barely trained: their times say nothing).

    Strategies that barely moved are left out of the median: they never reach the target
    anyway, and counting them drags it up to a few percent under the untrained loss, where the
    time to it is noise (``partrain bench compare``'s straggler scenario: five of eight
    strategies waited on the slowed worker and ended within 7% of the untrained 2.30, the
    median of all eight was 2.13, and one process and hogwild, which went on to 1.36 and
    1.53, reached it 1.35 and 1.09 s into their 5-second runs)."""
    learned = sorted(v for v in lows if v < (1 - MIN_PROGRESS) * start)
    return learned[len(learned) // 2] if learned else math.nan


def time_to_reach(seconds: list[float], losses: list[float], target: float) -> float:
    """Seconds until ``losses`` first reaches ``target`` (linear within an epoch); NaN if never."""
    for i in range(1, min(len(seconds), len(losses))):
        if losses[i] <= target:
            before = losses[i - 1]
            if before <= target or before == losses[i]:
                return seconds[i]
            return seconds[i - 1] + (seconds[i] - seconds[i - 1]) * (before - target) / (before - losses[i])
    return math.nan


def _why_faster(best: Measurement, base: Measurement | None, straggler: bool = False) -> str:
    if base is None or base is best:
        return "the fastest strategy measured"
    speedup = (f"{best.speed / base.speed:.2f}x the speed to the target loss" if base.speed > 0
               else f"and {base.label} never reached the target loss in its window")
    share = waiting_share(base)
    if straggler and not synchronous(best) and synchronous(base):
        return (f"{base.label} waits for the slowest worker at every step ({share:.0%} of its step): "
                f"{best.label} does not, {speedup}")
    if best.bytes_per_sample < base.bytes_per_sample * 0.5 and share >= COMM_FLOOR:
        cut = (f"cuts the bytes per sample {base.bytes_per_sample / best.bytes_per_sample:.0f}x"
               if best.bytes_per_sample > 0 else "sends no bytes")
        return f"comm is {share:.0%} of {base.label}'s step: {best.label} {cut}, {speedup}"
    if base.speed > 0:
        return f"{best.speed / base.speed:.2f}x the speed of {base.label} to the target loss"
    return f"{base.label} never reached the target loss in its window"


def synchronous(m: Measurement) -> bool:
    """Every step applies the exact gradient of its global batch, and waits for every worker."""
    if m.strategy == "ps":
        return not math.isinf(float(m.options.get("staleness", 0)))
    return m.strategy in ("allreduce", "pipeline", "single")


def _why_not(m: Measurement, pick: Measurement, ref: Measurement | None, loss_tolerance: float,
             target: float = math.nan) -> str:
    """One line: why ``m`` loses to ``pick``."""
    if not m.ok:
        return f"{m.status}: {m.reason}"
    if m.speed == 0:
        if unranked(m, pick, target):
            above = max(min(v for _, v in m.curve) / target - 1, 0.01)  # under 1%: "within 1%", not "0%"
            return (f"never reached the target loss in its window, but came within {above:.0%} of it after "
                    f"{near_miss_s(m, target):.3g} s, before the pick reached it ({pick.time_to_loss:.3g} s): these "
                    "windows cannot rank it")
        return "never reached the target loss in most of its windows" if m.runoff else \
            "never reached the target loss in its window"
    ratio = m.speed / pick.speed if pick.speed else math.nan
    deep = at_depth(pick, m, target) if ratio >= 1 + TIE_FLOOR else None
    shares = m.shares()
    wait = waiting_share(m)
    if ratio >= 1 and converges_worse(m, ref):
        reason = (f"its loss at equal samples is {m.loss_ratio - 1:.0%} above {ref.label}'s: it reached the "
                  "windows' target first, but is likely to level off above where the others go on")
    elif ratio * (1 + TIE_FLOOR) >= 1 and pick.runoff and not m.runoff:
        reason = (f"its one window reached the target in {m.time_to_loss:.3g} s, but the run-off did not race it "
                  "(its first window was behind the leaders'): the leaders' times are medians over new seeds, "
                  "this one is a single draw")
    elif deep is not None and deep[1] / deep[2] <= 1 + TIE_FLOOR:
        loss, mine, theirs = deep
        reason = (f"faster to the windows' target, but {mine / theirs:.2f}x the pick's speed to {loss:.4g}, the "
                  "deepest loss both reached in every window: the pick catches up with depth")
    elif ratio >= 1 + TIE_FLOOR and pick.workers == 1:  # rule 2 at depth picked one process
        reason = ("faster to the windows' target, as deep as its windows went: the parallel strategies that "
                  "went deeper lost their lead to one process there")
    elif ratio >= 1 and half_never(m.times_to_loss) and not half_never(pick.times_to_loss):
        reason = (f"its {m.time_to_loss:.3g} s to the target is {LOWER_BOUND}, the pick's {pick.time_to_loss:.3g} s "
                  "was measured")
    elif ratio >= 1 and synchronous(pick):
        reason = "as fast, but the pick keeps the exact gradient and needs no tuning"
    elif ratio >= 1:
        ahead = ahead_over_time(m, pick) if m.workers > 1 < pick.workers else None
        reason = "as fast within the windows' noise" + (
            "" if ahead is None else f"; over the {ahead[0]:.3g} s both trained in every window, its test loss "
            f"averaged {abs(ahead[1] / ahead[2] - 1):.0%} {'above' if ahead[1] > ahead[2] else 'below'} the pick's")
    elif m.loss_ratio > 1 + loss_tolerance and ref is not None and not synchronous(m):
        reason = (f"its loss at equal samples is {m.loss_ratio - 1:.0%} above {ref.label}'s "
                  "(stale or local updates cost convergence)")
    elif m.strategy == "pipeline" and shares["bubble"] == shares["bubble"] and shares["bubble"] >= 0.2:
        reason = f"the pipeline bubble is {shares['bubble']:.0%} of its step"
    elif wait >= 0.25:
        reason = f"comm and waiting are {wait:.0%} of its step ({m.bytes_per_sample:,.0f} bytes/sample)"
    elif m.workers == 1:
        reason = "one process uses one share of the cores"
    else:
        reason = f"compute is {shares['compute']:.0%} of its step"
    return f"{ratio:.2f}x the pick's speed: {reason}"
