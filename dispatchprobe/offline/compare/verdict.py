"""What compare concludes: a :class:`Divergence` per stage, the :class:`Verdict` (its ``str()`` is
the terminal summary) and the errors a caller catches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import pandas as pd

from ...records.reader import RecordError
from ...standards.verdicts import NOT_JUDGED
from .pairing import PairingShare


# causes whose line gives no precision verdict on an op: values drawn from random numbers, what is
# computed from them or from inputs that differ already, rounding noise, the programs' constants, a
# discrete choice the runs made differently and what is computed from it
NO_PRECISION_VERDICT = frozenset({"random", "after_random", "after_inputs", "noise", "constant", "choice",
                                  "after_choice", "rounding", "skipped"})
# the first causes of those whose later values compare cannot judge (exit code 1), and the causes of
# the stage after them
UNDECIDED = {"random": ("after_random",), "choice": ("after_choice", "inherited")}


@dataclass
class Divergence:
    """Where one stage's error rows come from (``cause``); with ``departure``, where the first
    difference within tolerance of a stage without error rows enters:

    - ``op``: the first op (or smallest module) that adds a difference of its own: its outputs differ
      while its inputs agree, or by more than its inputs' differences carried through it (measured
      in float64 on both runs' inputs; ``approximate`` when estimated from the recorded errors);
    - ``unmatched``: an op present in one run only (``side``) between agreeing and differing records;
    - ``region``: a value the runs compute with other ops (``region``: each run's), from values that
      agree, differs: the difference enters in one of those ops, and the records cannot tell which;
    - ``inputs``: a value no recorded op produced (parameter, data) already differs (``arg``);
    - ``unrecorded``: an input differs although the op that produced it agreed;
    - ``received``: a collective whose result differs while what this rank gave it agrees: the
      difference came from another rank of its group (whose own line names the op that made it),
      not from this rank's kernels;
    - ``inherited``: no op of the stage diverges by itself, its errors come from values the other stage
      made (:meth:`inherited_from`): a backward's from forward values, a forward's (an optimizer stepping
      inside the probe) from gradients the backward made;
    - ``rounding``: no op adds a difference larger than a few roundings, and where the stage's error
      rows start (in the stage, or followed through the other stage and back: the forward's
      optimizer reads gradients the backward made from forward values) the runs compute in other
      precisions: the errors grew from the lower precision's rounding (``follows``: where it first
      enters; ``came_from``: the step the runs part at, where earlier) over the stages and the
      steps' updates.  No op is named: one off by less than a few roundings is not told apart;
    - ``skipped``: a later step's error rows come from the parameters entering it, which differ because
      one run's loss scaler skipped an earlier step's update (its scale overflowed: ``follows``) that
      the other run applied; no op is named;
    - ``noise``: no op diverges by itself; the differences come from a value zero up to rounding (``arg``
      of the record: a sum whose terms cancel, passed by the cancellation rule, as an attention key
      bias's gradient), which what is computed from it carries at any relative size (an optimizer
      normalising its updates amplifies it): no op after it is named;
    - ``constant``: no op diverges by itself; the differences come from a value made from the program's
      numbers, reading no tensor's values (``zeros``, ``full``, ``scalar_tensor``, ``arange``: a
      ``torch.finfo(dtype).min`` mask value in each run's dtype), in both runs or in one only
      (``side``), or by an op given each run's dtype extreme beside agreeing tensors
      (``masked_fill(mask, torch.finfo(dtype).min)``): the programs differ there, not a kernel's
      precision; no op after it is named;
    - ``random``: the first op where values differ draws random numbers (dropout, ``rand``...): its values
      depend on each run's generator, so a difference there and in what is computed from it is no
      precision verdict (``op``, ``unmatched`` or ``unrecorded`` at a random op);
    - ``choice``: the first values that differ are a discrete answer (``topk``'s indices, a mask, an
      ``argmax``; ``arg``) an op gave from float values that agree within tolerance: a near-tie the
      runs' rounding resolved apart (a router sending a token to another expert), no kernel wrong;
      what is computed from that answer differs by far more than rounding and is not judged
      (:mod:`.choice`);
    - ``after_choice``: a stage whose error rows follow a ``choice`` made in the other stage
      (``follows``): not judged;
    - ``after_random``: backward only: its error rows come after a forward ``random`` divergence
      (``follows``), computed from values that depend on the draws: not judged;
    - ``after_inputs``: backward only: the forward's inputs differ already (``follows``: where first
      seen) and the backward op that would be named was decided on statistics alone: not judged.
    """

    stage: str
    step: int
    rank: int
    seq: int
    scope: str
    op: str
    name: str
    call: int
    kind: str
    failed: str                  # why: the reasons of its failing tensors
    metrics: dict = field(default_factory=dict)
    stack: list = field(default_factory=list)
    module: str | None = None    # smallest module whose output differs and whose inputs agree
    cause: str = "op"
    side: str = "a"              # the run holding the record (``unmatched`` ops of run B: "b")
    arg: str = ""                # the tensor where ``inputs``/``inherited``/``unrecorded`` is seen
    errors: int = 0              # error rows of this stage in this step/rank part
    departure: bool = False      # no error rows: the first difference within tolerance
    approximate: bool = False    # decided on statistics/recorded errors, not on a float64 re-run
    came_from: str = ""          # inputs differing at a later step: where the earlier step's difference entered
    other_op: str = ""           # the paired record's op in the other run, where it is another op
    follows: str = ""            # after_random/after_inputs: where the forward difference it follows is
    rounding_at: str = ""        # a departure of rounding size where the runs compute in other precisions: where
    recomputed: bool = False     # a forward op activation checkpointing re-ran in backward (both runs re-ran it)
    unjudged: str = ""           # an earlier op that looked like it amplified on statistics alone, below the error line
    amplifier: str = ""          # the first op that so looked, wherever the named source is (.drift reads it)
    region: dict = field(default_factory=dict)   # cause region: run ("a"/"b") -> the ops it computes the value with
    stretch: str = ""            # cause region, a stretch both runs compute with ops of their own: where it sits
    entered: str = ""            # such a stretch given a difference far smaller than its own: how far what enters differs
    call_b: int | None = None    # a run A record's: the call index and place of its paired record in run B
    seq_b: int | None = None

    @property
    def quiet(self) -> bool:
        """Whether the line gives no precision verdict on an op (:data:`NO_PRECISION_VERDICT`), or is a
        departure within tolerance: the report's pages draw such a mark quietly."""
        return bool(self.departure) or self.cause in NO_PRECISION_VERDICT

    def inherited_from(self) -> str:
        """The stage an ``inherited`` divergence's values were made in: the forward for a backward; the
        backward for a forward op reading a value made in another stage (an optimizer stepping inside
        ``with probe:`` reads the gradients)."""
        return "forward" if self.stage == "backward" else "backward"

    def headline(self) -> str:
        if self.cause == "random":
            return f"first {self.stage} difference, at a random op" + (" (within tolerance)" if self.departure else "")
        if self.cause == "choice":
            return f"first {self.stage} difference, at a discrete choice"
        if self.cause == "after_choice":
            return f"{self.stage} not judged: follows a discrete choice"
        return f"first {self.stage} departure (within tolerance)" if self.departure else f"first {self.stage} divergence"

    def where(self) -> str:
        paired = f" (paired with {self.other_op} in run {'B' if self.side == 'a' else 'A'})" if self.other_op else ""
        rerun = ", a forward op recomputed by activation checkpointing" if self.recomputed else ""
        return (f"{self.op}{paired} [{self.scope or '<top>'}] {call_words(self.call, self.call_b)} "
                f"({self.at()}{rerun}, step {self.step} rank {self.rank})")

    def at(self) -> str:
        """The record's place in its stage (:func:`place_words`), its paired record's in run B beside
        it where that is another."""
        return place_words(self.seq, f"{self.stage}{self.run_of()}", self.seq_b)

    def run_of(self) -> str:
        """`` of run B`` where the record named is run B's (a one-run-only op's), else nothing."""
        return "" if self.side == "a" else " of run B"

    def region_words(self) -> str:
        """What a ``region`` line says of the ops each run computes the value with: which of them makes
        the difference is not known, and the line says so rather than blame one run's share."""
        def ops(names: list) -> str:
            counts = {n: names.count(n) for n in dict.fromkeys(names)}
            return ", ".join(f"{k} x{n}" if n > 1 else k for k, n in counts.items())
        mine, theirs = self.region.get("a", []), self.region.get("b", [])
        # the same ops in each run whose records could not pair (one records an output the other leaves out)
        # listed in an order of their own, not A's first: the same words whichever run is A
        listed = sorted([(ops(mine), "A"), (ops(theirs), "B")])
        named = f"ops whose records do not pair (each run: {ops(mine)})" if mine == theirs else \
            "other ops (" + "; ".join(f"run {run}: {names}" for names, run in listed) + ")"
        read = f"values that differ far less ({self.entered})" if self.entered else "values that agree up to rounding"
        return (f"the runs compute this value with {named} from {read}, so the "
                f"difference enters in one of them, and the records cannot tell which")

    def _follows(self, source: str) -> str:
        """The line of a stage whose differences all come from ``source``, something no op computed
        wrongly (rounding noise, the programs' constants)."""
        differing = f"its {self.errors} error rows" if self.errors else "its values that differ"
        return f"{self.stage}: no {self.stage} op diverges by itself; {differing} follow from {source}"

    def describe(self, lead: str | None = None) -> str:
        """The terminal lines; ``lead`` replaces the opening words of an op's line."""
        if self.cause == "inputs":
            lines = [f"the runs differ already at their inputs/parameters: first seen at {self.op} "
                     f"[{self.scope or '<top>'}] {self.arg} ({self.at()}, step {self.step} "
                     f"rank {self.rank}): {self.failed}"]
        elif self.cause == "inherited":
            lines = [f"{self.stage}: no {self.stage} op diverges by itself; its {self.errors} error rows follow from "
                     f"differing {self.inherited_from()} values (first at {self.op} [{self.scope or '<top>'}] {self.arg}, "
                     f"{self.at()}, step {self.step} rank {self.rank})"]
        elif self.cause == "rounding":
            lines = [f"{self.stage}: no op diverges by more than rounding; its {self.errors} error rows (step "
                     f"{self.step} rank {self.rank}) grew from differences of rounding size where the runs compute "
                     f"in other precisions, first at {self.follows}; judged at the lower precision's rounding, no op "
                     f"is named (one off by less than a few of its roundings is not told apart from them: compare "
                     f"runs of one precision to judge kernels)"]
        elif self.cause == "skipped":
            lines = [f"{self.stage}: no {self.stage} op diverges by itself; its {self.errors} error rows (step "
                     f"{self.step} rank {self.rank}) are computed from parameters that differ because {self.follows}, "
                     f"which the other run applied; not a precision verdict"]
        elif self.cause == "random":
            lines = [f"{lead or self.headline()}: {self.where()}: its values depend on the random numbers "
                     f"each run drew, so the runs cannot be compared value for value there or in what is computed "
                     f"from it; not a precision verdict ({self.failed}). {RANDOM_ADVICE}"]
        elif self.cause == "choice":
            computed = f"the {self.errors} error rows computed from it" if self.errors else "what is computed from it"
            lines = [f"{lead or self.headline()}: {self.where()}: {self.failed}. A near-tie the runs' rounding "
                     f"resolved apart gives another discrete answer (a router picking another expert), no kernel "
                     f"wrong; {computed} differ by that choice, not by precision: not judged (not a precision "
                     f"verdict). {CHOICE_ADVICE}"]
        elif self.cause == "after_choice":
            lines = [f"{self.stage}: not judged: its {self.errors} error rows are computed from values that follow "
                     f"the discrete choice {self.follows}, which the runs made differently"]
        elif self.cause == "noise":
            lines = [self._follows(f"values that are zero up to rounding (first at {self.op} [{self.scope or '<top>'}] "
                                   f"{self.arg}, {self.at()}, step {self.step} rank {self.rank}: "
                                   f"{self.failed}); what is computed from rounding noise differs by any amount "
                                   f"relative to its size (an optimizer normalising its updates, as Adam's, "
                                   f"amplifies it), so no op after it is named")]
        elif self.cause == "constant":
            lines = [self._follows(f"constants the runs' programs make differently (first at {self.where()}: "
                                   f"{self.failed}): an op makes them from the program's numbers (reading no tensor's "
                                   f"values, or given a dtype-dependent number such as torch.finfo(dtype).min beside "
                                   f"agreeing tensors; another code path), so they are no precision divergence and "
                                   f"no op after it is named")]
        elif self.cause in ("after_random", "after_inputs"):
            source = (f"forward values that depend on the random op {self.follows}" if self.cause == "after_random"
                      else f"inputs/parameters that differ already (first seen at {self.follows}); on statistics "
                           f"alone no {self.stage} op can be named (a gradient's statistics need not change with its "
                           f"values): record tensors (task tensor) to judge it")
            lines = [f"{self.stage}: not judged: its {self.errors} error rows (first at {self.where()}) are computed "
                     f"from {source}"]
        elif self.cause == "received":
            differing = f"its {self.errors} error rows" if self.errors else "its values that differ (within tolerance)"
            lines = [f"{self.stage}: no {self.stage} op of rank {self.rank} diverges by itself; {differing} follow "
                     f"from values other ranks gave it through the collective {self.where()}, while what rank "
                     f"{self.rank} gave it agrees: {self.failed}"]
        elif self.cause == "unmatched":
            lines = [f"{lead or self.headline()}: {self.where()}, present only in run {self.side.upper()}"
                     f"{'' if self.departure else ' (prime suspect)'}: {self.failed}"]
        elif self.cause == "region":
            lines = [f"{lead or self.headline()}: {self.stretch or self.where()}: {self.failed}; {self.region_words()}"
                     + (" (origin approximate: estimated from the recorded errors, no float64 re-run)"
                        if self.approximate else "")]
        else:
            lines = [f"{lead or self.headline()}: {self.where()}: {self.failed}"
                     + (" (origin approximate: estimated from the recorded errors, no float64 re-run)"
                        if self.approximate else "")]
        if self.came_from:
            lines.append(f"  {self.came_from}")
        if self.unjudged:
            lines.append(f"  not named: {self.unjudged}")
        if self.module and self.module != self.scope:
            lines.append(f"  smallest module whose output differs: {self.module}")
        lines += [f"  at {frame}" for frame in self.stack[-4:]]
        return "\n".join(lines)


def call_words(call: int, call_b: int | None = None) -> str:
    """``call 6``, or ``call A 6, B 5`` where a run A record's paired record in run B is another call of
    its op (an eager and a compiled run number their calls apart): both runs' calls named, so the line
    names the pair alike whichever run is A."""
    return f"call {call}" if call_b is None or call_b == call else f"call A {call}, B {call_b}"


def place_words(seq: int, stage: str, seq_b: int | None = None) -> str:
    """``#15 in backward``, or ``A #15, B #20 in backward`` where the paired record of run B sits
    elsewhere in its stage: a place in run A alone changes with the runs' order."""
    return f"#{seq} in {stage}" if seq_b is None or seq_b == seq else f"A #{seq}, B #{seq_b} in {stage}"


RANDOM_ADVICE = ("To compare past it, record both runs seeded alike with dropout off "
                 "(dispatchprobe.seed_all(seed, rm_dropout=True)); compiled code draws from inductor's own "
                 "generator unless torch._inductor.config.fallback_random = True, and each device type has "
                 "generators of its own.")


CHOICE_ADVICE = ("To judge past it, compare runs that choose alike: the same precision up to that op, or one "
                 "run's choice forced on the other in the model's code (a router's indices saved and reused).")


@dataclass
class Verdict:
    """What compare concluded; ``str()`` gives the terminal summary."""

    a: str
    b: str
    forward: Divergence | None
    backward: Divergence | None
    counts: dict
    unmatched: pd.DataFrame
    problems: list
    parts: list
    report: str | None = None
    aligned: float = 1.0         # share of the smaller run's compute records (ops, modules) paired
    same_run: bool = False       # A and B are the same folder: agreement says nothing
    departures: list = field(default_factory=list)   # per stage without error rows: its first departure
    pairing: PairingShare = field(default_factory=PairingShare)   # how each run's op records were paired
    explained: list = field(default_factory=list)   # error rows passed as optimizer-amplified gradient noise,
                                                     # or not judged as computed from parameters moved apart
    below_floor: tuple = (0, 0.0)   # (statistics-only rows that differ below the floor, the floor)
    partial_sums: int = 0        # of the rows not judged, those comparing two partial sums (.regroup)
    rewired: int = 0             # of the rows not judged, inputs the programs build otherwise (.rewired)
    loss_scaled: int = 0         # of the rows not judged, those the runs' loss scales leave undecided (.loss_scale)
    after_choice: int = 0        # of the rows not judged, those a discrete choice the runs made differently leaves (.choice)
    after_random: int = 0        # of the rows not judged, those a random op whose draws differ leaves (.choice)
    drifted: int = 0             # of the rows not judged, those computed from parameters moved apart (.drift)

    @property
    def departure(self) -> Divergence | None:
        """The first difference within tolerance (forward first), if any."""
        return self.departures[0] if self.departures else None

    def stages_in_order(self) -> list:
        """(stage, its divergence or None) in the order the verdict names them: the stages with a
        divergence first (forward before backward), then the others, whose lines say no divergence or a
        departure within tolerance; so the first line names what is wrong even where a departure within
        tolerance came earlier in the run (a step-0 forward departure before a step-1 backward kernel)."""
        stages = [("forward", self.forward), ("backward", self.backward)]
        return [s for s in stages if s[1] is not None] + [s for s in stages if s[1] is None]

    @property
    def passed(self) -> bool:
        """No error row and no divergence: the rows past a discrete choice are not judged, not passed."""
        return self.counts.get("error", 0) == 0 and self.forward is None and self.backward is None

    @property
    def damaged(self) -> list:
        """What leaves an agreement partial (:func:`incomplete`)."""
        return incomplete(self.problems)

    @property
    def inputs_differ(self) -> bool:
        return any(d is not None and d.cause == "inputs" for d in (self.forward, self.backward))

    @property
    def random_only(self) -> bool:
        """Whether every error row comes at or after a random op where the runs' values first differ:
        no precision verdict, what compare cannot judge (exit code 1)."""
        divs = [d for d in (self.forward, self.backward) if d is not None]
        return not self.passed and bool(divs) and all(d.cause in ("random", "after_random") for d in divs)

    @property
    def undecided(self) -> bool:
        """Whether every error row comes at or after a point compare cannot judge past (exit code 1): a
        random op where the runs' values first differ, or a discrete choice the runs made differently
        (:data:`UNDECIDED`): the first stage's divergence is such a point and the backward's, if any,
        follows it; or no row fails and some were not judged as computed from parameters an
        optimizer step moved apart from differences within tolerance (:mod:`.drift`)."""
        divs = [d for d in (self.forward, self.backward) if d is not None]
        if self.passed:
            return self.drifted > 0     # rows computed from parameters the optimizer moved apart (.drift)
        if not divs or divs[0].cause not in UNDECIDED:
            return self.random_only
        return all(d.cause in (divs[0].cause, *UNDECIDED[divs[0].cause]) for d in divs[1:])

    @property
    def compared(self) -> int:
        return int(sum(self.counts.values()))

    def __str__(self) -> str:
        counts = ", ".join(f"{k} {self.counts.get(k, 0)}" for k in ("pass", "warning", "error"))
        if self.counts.get(NOT_JUDGED):
            kinds = {"partial sums the runs group differently": self.partial_sums,
                     "inputs the programs build otherwise, read by ops whose outputs agree": self.rewired,
                     "values the runs' loss scales leave undecided": self.loss_scaled,
                     "values a discrete choice the runs made differently decides": self.after_choice,
                     "values a random op's draws decide": self.after_random,
                     "values computed from parameters the optimizer moved apart": self.drifted}
            kinds = {k: n for k, n in {"undefined values": self.counts[NOT_JUDGED] - sum(kinds.values()),
                                       **kinds}.items() if n}
            why = ", ".join(f"{n} {k}" for k, n in kinds.items()) if len(kinds) > 1 else next(iter(kinds), "")
            counts += f", not judged {self.counts[NOT_JUDGED]} ({why})"
        steps, ranks = sorted({p[0] for p in self.parts}), sorted({p[1] for p in self.parts})
        where = f" (steps {_span(steps)} x ranks {_span(ranks)})" if len(self.parts) > 1 else ""
        lines = [f"compared {self.compared} tensors in {len(self.parts)} step/rank part(s){where}: {counts}"]
        early = {d.stage: d for d in self.departures}
        for stage, div in self.stages_in_order():
            if div is None and stage in early and not self.passed:
                lines.append(f"no {stage} divergence; " + early[stage].describe())
            else:
                lines.append(div.describe() if div else f"no {stage} divergence")
        lines += self.explained
        if self.passed and self.damaged:
            lines.append(partial_agreement(self.damaged))
        elif self.passed and self.same_run:
            lines.append(f"the runs agree: A and B are the same records ({self.a}); compare it with another run")
        elif self.passed and self.departure is not None:
            d = self.departure
            agree = "the runs agree within tolerance" + (" where judged" if self.drifted else "")
            lines.append(d.describe(f"{agree}; first departure") if d.cause in ("op", "unmatched", "region")
                         else f"{agree}; first departure: " + d.describe())
        elif self.passed and self.below_floor[0]:
            lines.append(f"the runs agree within the floor: {self.below_floor[0]} statistics rows differ below "
                         f"{self.below_floor[1]:g} (relative)")
        elif self.passed:
            lines.append("the runs agree")
        compute = self.unmatched[~self.unmatched["is_cast"]] if len(self.unmatched) else self.unmatched
        if len(self.unmatched):
            lines.append(f"unmatched records: {len(self.unmatched)} ({len(compute)} compute ops or modules, "
                         f"{len(self.unmatched) - len(compute)} casts)")
        lines += self.pairing.lines()
        lines += [f"warning: {p}" for p in self.problems[:5]]
        if len(self.problems) > 5:
            lines.append(f"warning: ... {len(self.problems) - 5} more problems "
                         + ("(listed in the report)" if self.report else "(add -o DIR to list them in DIR/compare.html)"))
        if self.report:
            lines.append(f"report: {self.report}")
        return "\n".join(lines)


def partial_agreement(incomplete_problems: list) -> str:
    """The verdict line of runs that agree on what was compared, where :func:`incomplete` says not all was."""
    said = []
    if any(p.startswith(UNFINISHED) for p in incomplete_problems):
        said.append("on what was recorded (a run holds steps it never closed: what would have followed was never "
                    "recorded)")
    if any(p.startswith("damaged record") for p in incomplete_problems):
        said.append("on what could be read (damaged records were not compared)")
    return f"the runs agree {' and '.join(said)}; see the warnings"


def _span(values: list) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}" \
        if values == list(range(values[0], values[-1] + 1)) else ",".join(map(str, values))


UNFINISHED = "unfinished:"    # a warning about steps a run's probe never closed (:func:`incomplete`)


def incomplete(problems: list) -> list:
    """The problems that leave an agreement partial: saved tensors that could not be read (cut short
    or corrupt shards: their rows fell back to statistics) and steps a run never closed (the
    program ended inside them: what would have followed was never recorded)."""
    return [p for p in problems if p.startswith(("damaged record", UNFINISHED))]


class RunsDoNotAlign(RecordError):
    """The runs' records mostly do not pair (different models or options); ``result`` holds what did."""

    def __init__(self, message: str, result=None):
        super().__init__(message)
        self.result = result


class Result(NamedTuple):
    """``(table, verdict)``; unpack it or use ``.table`` / ``.verdict``."""

    table: pd.DataFrame
    verdict: Verdict

