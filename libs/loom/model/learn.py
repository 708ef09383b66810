"""Learned speeds: what each job family really delivers on each GPU model, over what its profile says.

The SCU model predicts a GPU's speed for a *task type* from its datasheet profile. Real jobs
miss it, and by how much depends on the job: a GRU speech model may run at a third of the speed
the profile promises on one GPU while a ResNet matches it. :class:`SpeedLearner` keeps, per
(job family, GPU model) (the family comes from :func:`loom.model.family.job_family`), an
estimate of the **log speed factor**::

    y = ln(observed_speed / prior_speed)

where both speeds are relative to the reference accelerator: ``prior_speed`` is the profile's
SCU for the job's task type, ``observed_speed = work.step_time_s / observed compute seconds per
step``. Scheduling multiplies the SCU speed by ``exp(y)`` (``Snapshot.set_learned``). The model:

**Each cell's own posterior.** Observations of one cell are normal around its true log factor
with a known noise sd (:attr:`LearnSettings.noise_sd`, 0.1: run-to-run noise and measurement
together). The cell's prior is normal with mean and sd from the shared model below (the plain
prior is mean 0, i.e. factor 1, sd :attr:`LearnSettings.prior_sd` = 0.5: a profile wrong by
1.65x is one sd off). The posterior is the conjugate normal one, so a cell with its own runs
trusts them (one run carries 25x the prior's precision at the default settings) and the
uncertainty shrinks as ``noise_sd / sqrt(runs)``. There is **no bound** on the factor: a GPU
that delivers a third of its profile is learned as 0.33.

**Sharing strength.** Cells with data are fitted, by weighted ridge regression with
alternating least squares, to ``y(f, g) ≈ a_g + b_f + u_f · v_g``: a GPU effect (the GPU is off
for every family), a family effect (the family is off everywhere, e.g. its declared reference
step time is) and a low-rank (rank :attr:`LearnSettings.rank`) interaction, as Gavel and Sia
complete the throughput matrix. The main effects' ridge priors are narrower than a cell's plain
prior: sd :attr:`LearnSettings.gpu_effect_sd` (0.25) for a GPU effect and
:attr:`LearnSettings.family_effect_sd` (0.25) for a family effect. On the measured Gavel + Lambda
cells, against the fitted profiles, GPU effects vary with sd 0.14, family effects with 0.24 and the
rest (the interaction) with 0.18: one family's deviation on a GPU is mostly its own, so one family's
runs move another family's estimate on that GPU by a part of their deviation (a family 3.3x its
profile on a K80 lends another about 1.4x, not 2.7x as with 0.5), while several families that
agree move it further. Each cell's prior mean is the fit's prediction, with sd
``sqrt(interaction_sd² + prior_sd² / (1 + k))`` (capped at ``prior_sd``), where ``k`` counts the
*other* cells with data in its row and column: a cell never run borrows from its family's runs on
other GPUs and its GPU's runs of other families; with no such support it keeps the plain prior.
The fit uses the cell's own data too (a small double count, outweighed by the cell's own data
after one run).

**Robustness.** One observation's residual from the cell's running estimate (the cell's own
data under the plain prior, so that the rule depends only on the cell's sequence of
observations) is clipped at :attr:`LearnSettings.clip_sds` predictive sds (Huber-like): a single
wild run moves an established estimate by at most a few percent. A first run is clipped only
beyond 3 x 0.51 in log space (a factor of 4.6), so a profile that is 3x wrong is learned from
its first run; and a true change persists in every run, so it always gets through (the clip is
relative to the moving estimate), and :attr:`LearnSettings.memory_runs` lets old runs fade so a
changed truth is tracked. A clip bounds how far one run moves the estimate, so alone it would
take many runs to learn a cell far beyond it (a profile 14x off, as Sia's measurements show for
NCF between a Quadro RTX 6000 and an Azure V100, took ~38 runs; 1/14 never converged in 40). So
**two runs in a row** that are both clipped, on the same side, and within ``clip_sds`` noise sds
of each other (or nearer each other than either is to the estimate: runs noisier than
``noise_sd`` says, :func:`_agree`) count unclipped, both of them, while the cell is young (less than
:attr:`LearnSettings.confirm_within_runs` runs before them): a profile far off is then the
truth after two runs. An established cell keeps the clip (two runs of one sick node must not move a
GPU model's estimate far; a true change still gets through, a clip at a time, and old runs fade). A
single wild run followed by an ordinary one changes nothing more than before; two wild runs that
disagree with each other stay clipped.

**Exploration** (:meth:`SpeedLearner.factors` with ``explore=True``) is deliberate and bounded:
a cell qualifies while its sd is above :attr:`LearnSettings.explore_sd` and it has fewer than
:attr:`LearnSettings.explore_max_runs` runs; then it is offered at its optimistic factor
``exp(mean + explore_z · sd)`` (an upper confidence bound) so that a job may be sent to learn it.
Only a share :attr:`LearnSettings.explore_share` of the calls (each a scheduling decision or
cycle) gets optimistic factors: call ``n`` explores only while the explored calls stay within
``floor(explore_share · n)``. Without ``explore``, factors are the posterior medians
``exp(mean)``.

Pure and deterministic: no clock, no randomness, no I/O; the same observations in the same order
give the same state. :meth:`SpeedLearner.to_bytes` / :meth:`SpeedLearner.from_bytes` round-trip
the whole state with msgspec.
"""

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Final, Generic, Literal, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt
from msgspec import Meta

from loom.errors import InvalidInputError
from loom.model.family import job_family
from loom.model.scu import Precision, precision_of_family
from loom_proto.jobs import JobSpec

__all__ = [
    "LESSON_MAX_SLOWDOWN",
    "STEADY_SPREAD",
    "CellState",
    "Estimate",
    "LearnSettings",
    "LearnerState",
    "RunSpeed",
    "Source",
    "SpeedLearner",
    "run_speed",
    "teaches_while_running",
]

Source = Literal["own", "shared", "prior"]
"""Where an estimate comes from: the cell's own runs, other cells' runs (its family on other GPUs,
other families on its GPU), or nothing but the profile."""

_STATE_VERSION: Final = 1

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


NOISIEST_SD = 0.3
"""The noisiest runs (sd of one run's log factor: a run-to-run cv of about 30 %) for which two
clipped runs further apart than :attr:`LearnSettings.noise_sd` allows may still confirm each other
(:func:`_agree`): two whole runs up to ``exp(clip_sds * 0.3 * sqrt(2))``, about 3.6x, apart may;
4x apart (10x and 50x slower than the profile, say) may not. Partial runs (weight below 1) widen
it as their noise does."""

STEADY_SPREAD = 0.2
"""Largest :meth:`SpeedLearner.spread` (sd of a family's log factors on one model) at which the
family's measured ratios count as its jobs' (:meth:`SpeedLearner.steady_cells`)."""


class LearnSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The learner's constants (all in natural-log space unless said otherwise)."""

    prior_sd: Annotated[float, Meta(gt=0, le=5)] = 0.5
    """Sd of a cell's log factor before any run: the profile is trusted to within ~1.65x."""
    noise_sd: Annotated[float, Meta(gt=0, le=5)] = 0.1
    """Sd of one run's log factor around the cell's true one (run-to-run noise, measurement)."""
    interaction_sd: Annotated[float, Meta(gt=0, le=5)] = 0.2
    """How far a cell may sit from what its GPU and family effects (and the low-rank term) say."""
    gpu_effect_sd: Annotated[float, Meta(gt=0, le=5)] = 0.25
    """Prior sd of a GPU model's effect (off for every family) in the shared fit (0.5 until 2026-12-07).
    Measured GPU effects vary with sd 0.14 (Gavel + Lambda against the profiles); 0.25 leaves room
    for a GPU model that several families find off together (an unprofiled one, say)."""
    family_effect_sd: Annotated[float, Meta(gt=0, le=5)] = 0.25
    """Prior sd of a family's effect (off on every GPU) in the shared fit (measured: sd 0.24; 0.5
    until 2026-12-07)."""
    rank: Annotated[int, Meta(ge=0, le=8)] = 1
    """Rank of the family x GPU interaction in the shared fit (0: main effects only)."""
    iterations: Annotated[int, Meta(ge=1, le=1000)] = 30
    """Alternating least squares sweeps of the shared fit."""
    clip_sds: Annotated[float, Meta(gt=0, le=100)] = 3.0
    """An observation's residual is clipped at this many predictive sds (its influence is capped)."""
    confirm_within_runs: Annotated[float, Meta(ge=0, le=1e9)] = 3.0
    """Two clipped runs in a row that agree count unclipped only while the cell had fewer runs than
    this before them (runs, never faded): a profile far off is learned in two runs, while an established cell
    (say, of a GPU model one sick node now runs 20x slower) is moved by the clip alone."""
    memory_runs: Annotated[float, Meta(ge=1, le=1e9)] = 50.0
    """A cell remembers at most this much observation weight; older runs fade proportionally."""
    explore_share: Annotated[float, Meta(ge=0, le=1)] = 0.1
    """The largest share of ``factors(explore=True)`` calls that get optimistic factors."""
    explore_sd: Annotated[float, Meta(ge=0, le=5)] = 0.15
    """A cell is explored only while its sd is above this."""
    explore_z: Annotated[float, Meta(ge=0, le=10)] = 1.0
    """Optimism: an explored cell is offered at ``exp(mean + explore_z * sd)``."""
    explore_max_runs: Annotated[int, Meta(ge=0)] = 3
    """A cell with this many runs of its own is never explored."""
    risk_gpu_hours: Annotated[float, Meta(ge=0, le=1e9)] = 16.0
    """A job of at least this many GPU-hours at the reference speed (steps x reference step time x
    GPUs) weighs each GPU model its family has no steady cell on (``steady_cells``) at
    :attr:`risk_factor` of its estimate, once the family has one somewhere (``Snapshot.set_risk``):
    a big job does not bet its hours on a GPU its family never ran on unless that GPU looks faster
    by more than the handicap, while smaller jobs still go there and find out. It weighs the choice
    only (``Snapshot.job_speeds``): predicted steps, running jobs and speed probes read the
    estimate as it is (``Snapshot.believed_speeds``). 0: off. (A handicap
    for every job, ``exp(mean - sd² / 2)``, was tried on 2026-12-07 and did not hold: it also gave
    up the small runs that find a GPU faster than believed.)"""
    risk_factor: Annotated[float, Meta(gt=0, le=1)] = 0.8
    """What a big job counts of an estimate its family's runs do not back (:attr:`risk_gpu_hours`)."""


class CellState(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One (family, GPU model)'s sufficient statistics: clipped observations' weight and weighted sum."""

    family: str
    gpu_model: str
    weight: float
    """Sum of the (faded) observation weights."""
    weighted_sum: float
    """Sum of weight x clipped log factor."""
    runs: int
    """Observations ever made (not faded)."""
    clipped: int = 0
    """Observations whose residual was clipped."""
    pending: float | None = None
    """The last run's log factor when it was clipped (a persistent shift is confirmed by the next)."""
    pending_used: float = 0.0
    """What that run counted as (clipped)."""
    pending_weight: float = 0.0
    """That run's weight."""
    logged: float = 0.0
    """Runs counted in ``log_sum`` and ``log_sq``, faded as ``weight`` is (every run since these
    were kept)."""
    log_sum: float = 0.0
    """Sum of the runs' log factors as measured (unclipped; faded with ``weight``)."""
    log_sq: float = 0.0
    """Sum of their squares: how far the family's runs on one model disagree (:meth:`SpeedLearner.spread`)."""


class LearnerState(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Everything a :class:`SpeedLearner` knows: settings, per-cell statistics and exploration counts."""

    version: int = _STATE_VERSION
    settings: LearnSettings = LearnSettings()
    cells: list[CellState] = []
    decisions: int = 0
    """``factors(explore=True)`` calls so far."""
    explored: int = 0
    """Of those, how many got optimistic factors."""
    probed: list[tuple[str, str]] = []
    """(family, GPU model) cells a speed probe was asked for (:mod:`loom.sched.probe`), sorted."""


class Estimate(msgspec.Struct, frozen=True, kw_only=True):
    """What is known of one (family, GPU model)'s speed factor."""

    family: str
    gpu_model: str
    factor: float
    """exp(posterior mean of the log factor): multiply the profile's speed by it."""
    log_sd: float
    """Posterior sd of the log factor (roughly the relative uncertainty of ``factor``)."""
    runs: int
    """Runs of this cell observed."""
    source: Source


class _Cell:
    __slots__ = (
        "clipped",
        "log_sq",
        "log_sum",
        "logged",
        "pending",
        "pending_used",
        "pending_weight",
        "runs",
        "weight",
        "weighted_sum",
    )

    def __init__(
        self,
        weight: float = 0.0,
        weighted_sum: float = 0.0,
        runs: int = 0,
        clipped: int = 0,
        *,
        pending: float | None = None,
        pending_used: float = 0.0,
        pending_weight: float = 0.0,
        logged: float = 0.0,
        log_sum: float = 0.0,
        log_sq: float = 0.0,
    ) -> None:
        self.weight = weight
        self.weighted_sum = weighted_sum
        self.runs = runs
        self.clipped = clipped
        self.pending = pending
        self.pending_used = pending_used
        self.pending_weight = pending_weight
        self.logged = logged
        self.log_sum = log_sum
        self.log_sq = log_sq


_SOURCES: Final[tuple[Source, ...]] = ("own", "shared", "prior")


class _Fit:
    """The completed matrix (families with runs x GPU models with runs): each cell's posterior."""

    __slots__ = ("families", "family_index", "gpu_index", "gpus", "keys", "mean", "runs", "sd", "source")

    def __init__(
        self,
        *,
        families: list[str],
        gpus: list[str],
        mean: FloatArray,
        sd: FloatArray,
        runs: IntArray,
        source: IntArray,
    ) -> None:
        self.families = families
        self.gpus = gpus
        self.family_index = {f: i for i, f in enumerate(families)}
        self.gpu_index = {g: j for j, g in enumerate(gpus)}
        self.keys = [(f, g) for f in families for g in gpus]
        self.mean = mean
        self.sd = sd
        self.runs = runs
        self.source = source
        """Per cell, an index into :data:`_SOURCES`."""

    def estimate(self, i: int, j: int) -> Estimate:
        """Cell (i, j) as an :class:`Estimate`."""
        return Estimate(
            family=self.families[i],
            gpu_model=self.gpus[j],
            factor=math.exp(float(self.mean[i, j])),
            log_sd=float(self.sd[i, j]),
            runs=int(self.runs[i, j]),
            source=_SOURCES[int(self.source[i, j])],
        )


class SpeedLearner:
    """Per-(family, GPU model) speed factors over the SCU prior, learned from observed step times."""

    def __init__(self, settings: LearnSettings | None = None) -> None:
        self.settings = settings or LearnSettings()
        self._cells: dict[tuple[str, str], _Cell] = {}
        self.decisions = 0
        self.explored = 0
        self.probed: set[tuple[str, str]] = set()
        """Cells a speed probe was asked for (:meth:`probe_asked`)."""
        self._fit: _Fit | None = None
        """The completed matrix with its posteriors; None until refitted after an observation."""

    # ---- observations --------------------------------------------------------------------------

    def observe(
        self,
        family: str,
        gpu_model: str,
        *,
        prior_speed: float,
        observed_speed: float,
        weight: float = 1.0,
    ) -> float:
        """Learn from one run of ``family`` on ``gpu_model``; returns the log factor counted for it
        (clipped, or unclipped when it confirms the run before it; see the module's docstring).

        ``prior_speed``: the profile's speed for the job's task type (SCU, relative to the
        reference GPU, without any learned factor); ``observed_speed``: what the run delivered on
        the same scale (``work.step_time_s`` / observed compute seconds per step). ``weight``: how
        much the run counts (1 for a whole run; less for a short or partial one).
        """
        for name, value in (("prior_speed", prior_speed), ("observed_speed", observed_speed)):
            if not (math.isfinite(value) and value > 0):
                raise InvalidInputError(f"{name} must be positive and finite, got {value!r}")
        if not (math.isfinite(weight) and weight > 0):
            raise InvalidInputError(f"weight must be positive and finite, got {weight!r}")
        if not family or not gpu_model:
            raise InvalidInputError("family and gpu_model must not be empty")
        s = self.settings
        y = math.log(observed_speed / prior_speed)
        cell = self._cells.setdefault((family, gpu_model), _Cell())
        mean, sd = _posterior(0.0, s.prior_sd, cell.weight, cell.weighted_sum, s.noise_sd)
        spread = s.clip_sds * math.sqrt(sd * sd + s.noise_sd * s.noise_sd / weight)
        used = min(max(y, mean - spread), mean + spread)
        if used != y:
            cell.clipped += 1
            young = cell.runs - 1 < s.confirm_within_runs  # runs before the pending one (never faded)
            if (
                cell.pending is not None
                and young
                and _agree(cell.pending, cell.pending_weight, y, weight, s, mean=mean)
            ):
                # Two runs in a row beyond the clip, on the same side and within noise of each
                # other: not an outlier but a profile far off (or a truth that changed). Both
                # count unclipped: the earlier one's clipped-away part is given back.
                cell.weighted_sum += cell.pending_weight * (cell.pending - cell.pending_used)
                cell.pending, cell.pending_used, cell.pending_weight = None, 0.0, 0.0
                used = y
            else:
                cell.pending, cell.pending_used, cell.pending_weight = y, used, weight
        else:
            cell.pending, cell.pending_used, cell.pending_weight = None, 0.0, 0.0
        if cell.weight + weight > s.memory_runs:
            fade = max(s.memory_runs - weight, 0.0) / cell.weight
            cell.weight *= fade
            cell.weighted_sum *= fade
            # The spread forgets as the factor does: a truth that changed, or one wild run, does
            # not keep the family's runs "disagreeing" for ever.
            cell.logged *= fade
            cell.log_sum *= fade
            cell.log_sq *= fade
        cell.weight += weight
        cell.weighted_sum += weight * used
        cell.runs += 1
        cell.logged += 1
        cell.log_sum += y
        cell.log_sq += y * y
        self._fit = None
        return used

    # ---- estimates -----------------------------------------------------------------------------

    def estimate(self, family: str, gpu_model: str) -> Estimate:
        """The factor for ``family`` on ``gpu_model``, its sd, runs and where it comes from."""
        fit = self._shared()
        i, j = fit.family_index.get(family), fit.gpu_index.get(gpu_model)
        if i is None or j is None:
            # Outside the completed matrix: no run of the family, or none on the model.
            return Estimate(
                family=family,
                gpu_model=gpu_model,
                factor=1.0,
                log_sd=self.settings.prior_sd,
                runs=0,
                source="prior",
            )
        return fit.estimate(i, j)

    def estimates(self) -> list[Estimate]:
        """Every cell of the completed matrix (families with runs x GPU models with runs), sorted."""
        fit = self._shared()
        return [fit.estimate(i, j) for i in range(len(fit.families)) for j in range(len(fit.gpus))]

    def factors(self, *, explore: bool = False) -> dict[tuple[str, str], float]:
        """(family, gpu_model) -> factor for scheduling, for every cell of the completed matrix.

        Without ``explore``: posterior medians. With it, this call counts as one decision and, if
        the exploration budget allows (see the module's docstring), cells still uncertain are
        offered at their optimistic factor; the call is then counted as explored.
        """
        s = self.settings
        fit = self._shared()
        plain = dict(zip(fit.keys, np.exp(fit.mean).ravel().tolist(), strict=True))
        if not explore:
            return plain
        self.decisions += 1
        if self.explored + 1 > math.floor(s.explore_share * self.decisions):
            return plain
        uncertain = ((fit.sd > s.explore_sd) & (fit.runs < s.explore_max_runs)).ravel()
        if not uncertain.any():
            return plain
        upper = np.exp(fit.mean + s.explore_z * fit.sd).ravel()
        self.explored += 1
        return plain | {fit.keys[k]: float(upper[k]) for k in np.flatnonzero(uncertain)}

    # ---- speed probes --------------------------------------------------------------------------

    def probe_asked(self, family: str, gpu_model: str) -> None:
        """Remember that a speed probe of ``family`` on ``gpu_model`` was asked for: the cell is
        never probed again (:mod:`loom.sched.probe`), whether the probe teaches or fails."""
        if not family or not gpu_model:
            raise InvalidInputError("family and gpu_model must not be empty")
        self.probed.add((family, gpu_model))

    def measured_cells(self) -> set[tuple[str, str]]:
        """Cells with a run of their own (a speed probe that taught included)."""
        return {k for k, c in self._cells.items() if c.runs > 0}

    def spreads(self) -> dict[str, float]:
        """Family -> how far its runs on one GPU model disagree: the sd of their log factors within
        each model, pooled over its models with two runs or more (a family with no such model yet
        is absent). Runs of one model of network agree within noise; a "family" whose jobs differ
        (a label too coarse, jobs of several models under one name) shows a large spread, and a
        ratio of its factors between two models says little of any one job."""
        sums: dict[str, list[float]] = {}
        for key in sorted(self._cells):  # one order, whatever the order the cells were learned in
            c = self._cells[key]
            if c.logged < 2 - 1e-9:
                continue
            acc = sums.setdefault(key[0], [0.0, 0.0])
            acc[0] += max(c.log_sq - c.log_sum * c.log_sum / c.logged, 0.0)
            acc[1] += c.logged - 1
        return {f: math.sqrt(sq / free) for f, (sq, free) in sums.items() if free > 0}

    def spread(self, family: str) -> float | None:
        """One family's :meth:`spreads` entry (None: no model with two runs yet)."""
        return self.spreads().get(family)

    def steady_cells(self, max_spread: float = STEADY_SPREAD) -> set[tuple[str, str]]:
        """The :meth:`measured_cells` of the families whose :meth:`spread` is not known to exceed
        ``max_spread`` (a family with one run per model counts: nothing says its runs disagree):
        the cells whose ratios comparative advantage acts on (:mod:`loom.sched.plugins.advantage`)."""
        spreads = self.spreads()
        return {(f, g) for f, g in self.measured_cells() if spreads.get(f, 0.0) <= max_spread}

    def known_cells(self) -> set[tuple[str, str]]:
        """Cells that need no probe: those with a run of their own and those probed."""
        return self.measured_cells() | self.probed

    # ---- the shared fit ------------------------------------------------------------------------

    def _shared(self) -> "_Fit":
        """The completed matrix with every cell's posterior (refitted when stale)."""
        if self._fit is None:
            self._fit = self._refit()
        return self._fit

    def _refit(self) -> "_Fit":
        s = self.settings
        seen = sorted(k for k, c in self._cells.items() if c.weight > 0)
        families = sorted({f for f, _ in seen})
        gpus = sorted({g for _, g in seen})
        n_f, n_g = len(families), len(gpus)
        fi = {f: i for i, f in enumerate(families)}
        gi = {g: i for i, g in enumerate(gpus)}
        rows = np.array([fi[f] for f, _ in seen], dtype=np.int64)
        cols = np.array([gi[g] for _, g in seen], dtype=np.int64)
        cells = [self._cells[k] for k in seen]
        weight = np.array([c.weight for c in cells], dtype=np.float64)
        total = np.array([c.weighted_sum for c in cells], dtype=np.float64)
        y = total / np.maximum(weight, 1e-300)
        # Inverse variance of a cell's mean around the model: its own noise plus the interaction.
        w = 1.0 / (s.noise_sd**2 / np.maximum(weight, 1e-300) + s.interaction_sd**2)
        a, b, u, v = _als(rows, cols, y, w, n_families=n_f, n_gpus=n_g, s=s)
        has = np.zeros((n_f, n_g), dtype=np.bool_)
        has[rows, cols] = True
        per_family = has.sum(axis=1)
        per_gpu = has.sum(axis=0)
        # Cells with data in the same row or column, the cell itself left out.
        support = per_family[:, None] + per_gpu[None, :] - 2 * has
        prior_mean = np.where(support > 0, a[None, :] + b[:, None] + u @ v.T, 0.0)
        prior_sd = np.where(
            support > 0,
            np.minimum(
                np.sqrt(s.interaction_sd**2 + s.prior_sd**2 / (1 + np.maximum(support, 0))), s.prior_sd
            ),
            s.prior_sd,
        )
        cell_weight = np.zeros((n_f, n_g))
        cell_weight[rows, cols] = weight
        cell_total = np.zeros((n_f, n_g))
        cell_total[rows, cols] = total
        runs = np.zeros((n_f, n_g), dtype=np.int64)
        runs[rows, cols] = [c.runs for c in cells]
        precision = 1.0 / prior_sd**2 + cell_weight / s.noise_sd**2
        mean = (prior_mean / prior_sd**2 + cell_total / s.noise_sd**2) / precision
        sd = 1.0 / np.sqrt(precision)
        source = np.where(has, 0, np.where(support > 0, 1, 2))
        return _Fit(families=families, gpus=gpus, mean=mean, sd=sd, runs=runs, source=source)

    # ---- state ---------------------------------------------------------------------------------

    def state(self) -> LearnerState:
        """Everything this learner knows, as a msgspec struct (cells sorted)."""
        return LearnerState(
            settings=self.settings,
            cells=[
                CellState(
                    family=f,
                    gpu_model=g,
                    weight=c.weight,
                    weighted_sum=c.weighted_sum,
                    runs=c.runs,
                    clipped=c.clipped,
                    pending=c.pending,
                    pending_used=c.pending_used,
                    pending_weight=c.pending_weight,
                    logged=c.logged,
                    log_sum=c.log_sum,
                    log_sq=c.log_sq,
                )
                for (f, g), c in sorted(self._cells.items())
            ],
            decisions=self.decisions,
            explored=self.explored,
            probed=sorted(self.probed),
        )

    @classmethod
    def from_state(cls, state: LearnerState) -> "SpeedLearner":
        """A learner that knows exactly what ``state`` says."""
        if state.version != _STATE_VERSION:
            raise InvalidInputError(f"learner state version {state.version} is not {_STATE_VERSION}")
        learner = cls(state.settings)
        for c in state.cells:
            if c.pending is not None and not (math.isfinite(c.pending) and c.pending_weight > 0):
                raise InvalidInputError(
                    f"learner state: cell {c.family}/{c.gpu_model} has a pending run without a weight"
                )
            learner._cells[(c.family, c.gpu_model)] = _Cell(
                c.weight,
                c.weighted_sum,
                c.runs,
                c.clipped,
                pending=c.pending,
                pending_used=c.pending_used,
                pending_weight=c.pending_weight,
                logged=c.logged,
                log_sum=c.log_sum,
                log_sq=c.log_sq,
            )
        learner.decisions = state.decisions
        learner.explored = state.explored
        for family, gpu_model in state.probed:
            learner.probe_asked(family, gpu_model)
        return learner

    def to_bytes(self) -> bytes:
        """The state as JSON bytes."""
        return msgspec.json.encode(self.state())

    @classmethod
    def from_bytes(cls, data: bytes) -> "SpeedLearner":
        """A learner from :meth:`to_bytes`' output."""
        try:
            state = msgspec.json.decode(data, type=LearnerState)
        except msgspec.DecodeError as exc:
            raise InvalidInputError(f"learner state: {exc}") from exc
        return cls.from_state(state)

    def runs(self) -> Mapping[tuple[str, str], int]:
        """Runs observed per cell (cells without runs are absent)."""
        return {k: c.runs for k, c in sorted(self._cells.items())}


def _agree(
    first: float, first_weight: float, second: float, second_weight: float, s: LearnSettings, *, mean: float
) -> bool:
    """Whether two clipped runs' log factors agree: within :attr:`LearnSettings.clip_sds` noise sds
    of each other, or on the same side of the cell's estimate ``mean`` and nearer each other than
    either is to it.

    The second reading is for runs noisier than :attr:`LearnSettings.noise_sd` says: with a
    run-to-run cv of 20-30 %, two runs of a GPU model 10x slower than its profile were often more
    than the noise sds apart, so they stayed clipped and the cell, established after its third
    run, then moved a clip at a time (`loom bench learn --truth 0.1 --noise-cv 0.3`: 68 % of seeds
    within 15 % after ten runs; 86 % is what the mean of ten such runs gives). Two runs far beyond
    the estimate and close to each other disagree with the estimate, not with each other; two wild
    runs on opposite sides, or one far and one near, still stay clipped."""
    gap = abs(first - second)
    root = math.sqrt(1.0 / first_weight + 1.0 / second_weight)
    if gap <= s.clip_sds * s.noise_sd * root:
        return True
    return (
        (first - mean) * (second - mean) > 0
        and gap < min(abs(first - mean), abs(second - mean))
        and gap <= s.clip_sds * NOISIEST_SD * root  # no such noise puts two whole runs 4x apart
    )


def _posterior(
    prior_mean: float, prior_sd: float, weight: float, weighted_sum: float, noise_sd: float
) -> tuple[float, float]:
    """Normal posterior (mean, sd) of a log factor from its prior and a cell's statistics."""
    prior_precision = 1.0 / (prior_sd * prior_sd)
    data_precision = weight / (noise_sd * noise_sd)
    precision = prior_precision + data_precision
    mean = (prior_mean * prior_precision + weighted_sum / (noise_sd * noise_sd)) / precision
    return mean, 1.0 / math.sqrt(precision)


def _als(
    rows: IntArray,
    cols: IntArray,
    y: FloatArray,
    w: FloatArray,
    *,
    n_families: int,
    n_gpus: int,
    s: LearnSettings,
) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray]:
    """Weighted ridge fit of ``y ≈ a[col] + b[row] + u[row]·v[col]`` by alternating least squares.

    Ridge penalties are the priors' precisions: ``1/gpu_effect_sd²`` and ``1/family_effect_sd²``
    on the main effects, and
    ``1/interaction_sd`` on each factor of the product (so that the product's scale is about
    ``interaction_sd``). ``v`` starts at a fixed small pattern (never random): deterministic.
    """
    lam_gpu = 1.0 / s.gpu_effect_sd**2
    lam_family = 1.0 / s.family_effect_sd**2
    lam_factor = 1.0 / s.interaction_sd
    a = np.zeros(n_gpus)
    b = np.zeros(n_families)
    r = s.rank
    u = np.zeros((n_families, r))
    v = 0.1 * np.cos(np.outer(np.arange(1, n_gpus + 1), np.arange(1, r + 1)))
    wsum_g = np.bincount(cols, weights=w, minlength=n_gpus)
    wsum_f = np.bincount(rows, weights=w, minlength=n_families)
    for _ in range(s.iterations):
        inter = np.einsum("ij,ij->i", u[rows], v[cols]) if r else np.zeros_like(y)
        a = np.bincount(cols, weights=w * (y - b[rows] - inter), minlength=n_gpus) / (wsum_g + lam_gpu)
        b = np.bincount(rows, weights=w * (y - a[cols] - inter), minlength=n_families) / (wsum_f + lam_family)
        if not r:
            continue
        resid = y - a[cols] - b[rows]
        u = _ridge_rows(rows, v[cols], w, resid, n_groups=n_families, lam=lam_factor)
        v = _ridge_rows(cols, u[rows], w, resid, n_groups=n_gpus, lam=lam_factor)
    return a, b, u, v


def _ridge_rows(
    groups: IntArray, features: FloatArray, w: FloatArray, target: FloatArray, *, n_groups: int, lam: float
) -> FloatArray:
    """Per group, the ridge solution of ``target ≈ features · x`` over its cells (all groups at once)."""
    r = features.shape[1]
    if r == 1:  # the default rank: a closed form per group, much faster than batched solves
        f = features[:, 0]
        num = np.bincount(groups, weights=w * f * target, minlength=n_groups)
        den = np.bincount(groups, weights=w * f * f, minlength=n_groups) + lam
        return (num / den)[:, None]
    gram = np.zeros((n_groups, r, r))
    np.add.at(gram, groups, w[:, None, None] * features[:, :, None] * features[:, None, :])
    gram += lam * np.eye(r)
    rhs = np.zeros((n_groups, r))
    np.add.at(rhs, groups, (w * target)[:, None] * features)
    solved = np.linalg.solve(gram, rhs[:, :, None])[:, :, 0]
    return np.asarray(solved, dtype=np.float64)


# ---- what a completed run teaches ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunSpeed:
    """What one completed run says of its family's speed on its GPU model (relative to the
    reference GPU): the profile's (``prior_speed``) and the run's (``observed_speed``)."""

    family: str
    gpu_model: str
    prior_speed: float
    observed_speed: float


def run_speed(
    job: JobSpec,
    gpu_models: Sequence[str],
    observed_step_s: float | None,
    *,
    pipeline: bool,
    prior_speed: Callable[[str, str, Precision], float],
) -> RunSpeed | None:
    """What a completed run teaches :meth:`SpeedLearner.observe`, or None when it teaches nothing.

    One rule for placement and the simulator: only a run on one part (one GPU model), not cut into
    pipeline stages, that measured its compute seconds per step teaches. A gang across clusters
    computes at its slowest part's pace and a pipeline stage runs a slice of the model, so neither
    says what one GPU model delivers for the whole job. The observed speed is ``step_time_s /
    observed_step_s``; the prior is ``prior_speed(model, task_type, precision)`` at the job's own
    precision (its learned factor multiplies that speed, see ``Snapshot.job_speeds``).
    """
    if pipeline or len(gpu_models) != 1 or not gpu_models[0]:
        return None
    if observed_step_s is None or not observed_step_s > 0:
        return None
    family = job_family(job)
    model = gpu_models[0]
    return RunSpeed(
        family=family,
        gpu_model=model,
        prior_speed=prior_speed(model, job.task_type, precision_of_family(family)),
        observed_speed=job.work.step_time_s / observed_step_s,
    )


LESSON_MAX_SLOWDOWN: Final = 2.0
"""A running job teaches its speed at its first progress report only when its measured compute step
is at most this many times the step placement predicted for the run (the slow-node rule's half)."""


def teaches_while_running(observed_step_s: float, predicted_step_s: float | None) -> bool:
    """Whether a run's first progress report may teach the speed learner (else its completion does).

    One rule for placement and the simulator. A run delivering under half its predicted rate is what
    the slow-node rule flags (:class:`loom.migrate.nodes.Pace`): mid-run a slow node and a mis-profiled
    GPU look alike, and a lesson taught then would make every GPU of that model look as slow, so the
    migration review would see nothing to gain by leaving the node. Such a run teaches at completion,
    as every run did before; the others teach while they run. ``predicted_step_s`` None (unknown):
    it teaches."""
    if predicted_step_s is None or not predicted_step_s > 0:
        return True
    return observed_step_s <= LESSON_MAX_SLOWDOWN * predicted_step_s


SLOW_NODES_AGREE: Final = 2
"""Distinct nodes whose live runs of one (family, GPU model) must all be as slow as the slow-node
rule flags, mid-run, before it is the model rather than a node (:class:`HeldLessons`)."""

HELD_MAX: Final = 10_000
"""Held lessons past which every cell is pruned of runs no longer live (:meth:`HeldLessons.hold`)."""

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class HeldLessons(Generic[K, T]):
    """Mid-run lessons :func:`teaches_while_running` holds back (a run under half its predicted
    rate: a slow node and a mis-profiled GPU look alike in one run), one per run, by (family, GPU
    model) and node. Once live runs on :data:`SLOW_NODES_AGREE` distinct nodes of that model hold
    lessons, it is the model: :meth:`hold` returns them all to teach at once instead of at each
    run's completion. Before, a GPU model 14x slower than its profile took new jobs until its first
    run completed. One rule for placement and the simulator; soft state (a restart only delays the
    lessons to the runs' completions, as before). Holding again is harmless (a retried
    transaction): the caller teaches only runs not taught yet."""

    def __init__(self, agree: int = SLOW_NODES_AGREE) -> None:
        self.agree = agree
        self._cells: dict[tuple[str, str], dict[K, tuple[str, T]]] = {}

    def hold(
        self, cell: tuple[str, str], node: str, run: K, lesson: T, *, live: Callable[[K], bool]
    ) -> list[tuple[K, T]]:
        """Hold ``run``'s ``lesson`` (its node ``node``), forgetting the cell's runs no longer
        ``live``; every held ``(run, lesson)`` of ``cell`` when its live runs span enough nodes,
        else none."""
        if sum(len(v) for v in self._cells.values()) >= HELD_MAX:
            for key in list(self._cells):
                self._prune(key, live)
        held = self._cells.setdefault(cell, {})
        held[run] = (node, lesson)
        self._prune(cell, live)
        held = self._cells.get(cell, {})
        if len({n for n, _ in held.values()}) < self.agree:
            return []
        return [(k, lesson_) for k, (_, lesson_) in held.items()]

    def _prune(self, cell: tuple[str, str], live: Callable[[K], bool]) -> None:
        held = self._cells.get(cell, {})
        for key in [k for k in held if not live(k)]:
            del held[key]
        if not held:
            self._cells.pop(cell, None)

    def held(self, cell: tuple[str, str]) -> int:
        """How many lessons of ``cell`` are held."""
        return len(self._cells.get(cell, {}))
