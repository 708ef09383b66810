"""Pipeline split: cut a model declared as layers into contiguous stages, one cluster each.

A job that declares :class:`~loom_proto.jobs.Pipeline` layers may be cut into stages when no single
cluster can hold it, or when it runs faster split. Every stage runs concurrently on its own site (a
cluster's GPUs of one model), so in steady state the pipeline advances one step per
*bottleneck*: the slowest stage's compute, or the slowest activation transfer between consecutive
stages over the measured link. :func:`plan` finds the cut points and the sites that make the
bottleneck as small as possible and returns every stage's node allocations, so the caller reserves
all stages in one call (:attr:`PipelinePlan.allocations`) or none.

The model, stated once:

* A stage of layers ``[i..j]`` on a site needs ``g = max(1, ceil(memory(i..j) / (gpu_memory_gib *
  usable_fraction)))`` GPUs: GPUs are sized by memory, never added for speed. It is feasible when the
  site's nodes have ``g`` free GPUs together (and ``g <= max_gpus_per_stage``); they are taken most
  free node first (:func:`loom.sched.firstfit.pack_workers`).
* Its compute is ``sum(compute_s[i..j]) / (g * speed_per_gpu)`` per step: model parallelism inside the
  stage with ideal scaling (an optimistic assumption for ``g > 1``).
* The transfer to the next stage sends ``activation_mb`` of the stage's last layer:
  ``activation_mb * 8 / (1000 * bandwidth_gbps) + rtt_ms / 1000`` seconds, with the link measured
  between the two sites' regions (``net(region, region)`` for two sites in one region).
* Each site hosts at most one stage. The objective is the bottleneck
  ``max over stages of max(compute_k, transfer_k->k+1)`` (bottlenecks within a relative 1e-9 count as
  equal). Ties go to fewer stages, then to the smaller sum of all stage times (compute and transfers:
  the time one step takes through an empty pipeline), then to the plan whose sequence of (site, last
  layer) comes first, sites in (cluster, GPU model) order, so the same input always gives the same plan.

The search is exact over the sites and cut points it considers. It runs over the candidate
bottlenecks (every stage compute and transfer time that can occur), checking each with a feasibility
programme over (sites used, current site) rows that hold the layers the current stage may start at as
bit sets; rows that cannot finish (even reusing sites) or that a subset of their sites already reached
are dropped. A min-sum programme at the optimal bottleneck then applies the tie-breaks. The cost
grows as ``2**sites``: beyond ``max_sites`` (default 8) only the sites with the most
:func:`useful_capacity` (speed per GPU x the free GPUs the model could use there) are considered,
so a better plan on the others may be missed; and a model deeper than ``max_layers`` (default
128) is searched as that many blocks of layers, each ending at the layer of its window that sends
the least, so cuts fall only there. Typical cost on one core: about 10-15 ms for 32 layers on 8
sites; 0.1-1 s for 128 layers (or more, in blocks) on 12 sites.

:func:`plan` remembers its last :data:`PLAN_MEMO_SIZE` searches by everything a search reads: the
layers, and per considered site (in key order) its region, speed, GPU memory and free GPUs up to
what the whole model needs there, the links between their regions, and the limits. Two
decisions with equal keys get the same stages by site position, each on its own sites' nodes; on
replicated clusters most decisions share a key with an earlier one (at 100,000 nodes about four
in five), so the search runs once for them. A remembered search gives exactly what a fresh one
would: GPUs beyond the whole model's need change neither which stages fit nor the search's bound.
"""

import hashlib
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from loom.errors import InvalidInputError
from loom.sched.firstfit import pack_workers
from loom_proto.jobs import Layer, NodeAllocation, PlacedPart

__all__ = [
    "DEFAULT_MAX_LAYERS",
    "DEFAULT_MAX_SITES",
    "DEFAULT_USABLE_FRACTION",
    "MAX_SITES_LIMIT",
    "Network",
    "PipelineError",
    "PipelinePlan",
    "Site",
    "StagePlan",
    "best_single",
    "infeasible_reason",
    "plan",
    "stage_gpus",
    "transfer_s",
    "useful_capacity",
    "whole_model",
]

DEFAULT_USABLE_FRACTION = 0.9
"""Share of each GPU's memory a stage may fill (the rest goes to the runtime and fragmentation)."""
DEFAULT_MAX_SITES = 8
"""Sites the exact search considers; its cost roughly doubles with each one more. Eight is the
default ``max_stages`` (each site hosts at most one stage): at 100,000 nodes (about 660 sites) a
decision took about 350 ms with 12 sites considered and about 45 ms with 8."""
MAX_SITES_LIMIT = 16
"""The most ``max_sites`` may be: the search keeps tables over every subset of the sites."""
DEFAULT_MAX_LAYERS = 128
"""Layers the search tells apart; deeper models are searched as this many blocks of layers."""

_TIE_RTOL = 1e-9
"""Bottlenecks within this relative distance count as equal (they differ only by rounding)."""
_CEIL_SLACK = 1e-9
"""Memory within this share of a GPU boundary does not take one more GPU (float rounding)."""
_SEARCH_WIDTH = 8
"""Candidate bottlenecks checked at once in small searches, where numpy's per-call cost dominates."""
_SMALL_SEARCH = 1 << 16
"""A search is small while sites * 2**sites * units (layers or blocks) stays within this."""

Network = Callable[[str, str], tuple[float, float]] | Mapping[tuple[str, str], tuple[float, float]]
"""The measured links: ``(src_region, dst_region) -> (rtt_ms, bandwidth_gbps)``, as a function or a
mapping. A pair missing from a mapping, or a bandwidth of 0, is a link stages cannot be cut across."""

_F64 = npt.NDArray[np.float64]
_I64 = npt.NDArray[np.int64]
_Bool = npt.NDArray[np.bool_]
_U64 = npt.NDArray[np.uint64]


class PipelineError(InvalidInputError):
    """Pipeline input the planner cannot use (no layers, a bad fraction, duplicate sites, bad links)."""


@dataclass(frozen=True, slots=True)
class Site:
    """Where one stage may run: the free GPUs of one model on one cluster.

    ``speed_per_gpu`` is the GPU's SCU for the job's task type already multiplied by the cluster's
    trust (0: the site is not used). ``free_gpus`` is ``(node, free GPUs)`` for each node of that model.
    """

    cluster: str
    region: str
    gpu_model: str
    speed_per_gpu: float
    gpu_memory_gib: float
    free_gpus: tuple[tuple[str, int], ...]
    max_gpus_per_stage: int | None = None
    """At most this many GPUs in the stage placed here (None: no limit beyond the free GPUs)."""
    _free_total: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        if not (self.speed_per_gpu >= 0 and math.isfinite(self.speed_per_gpu)):
            raise PipelineError(f"site {self.key}: speed_per_gpu must be >= 0, got {self.speed_per_gpu}")
        if not (self.gpu_memory_gib > 0 and math.isfinite(self.gpu_memory_gib)):
            raise PipelineError(f"site {self.key}: gpu_memory_gib must be > 0, got {self.gpu_memory_gib}")
        if any(free < 0 for _, free in self.free_gpus):
            raise PipelineError(f"site {self.key}: a node has a negative free GPU count")
        if len({node for node, _ in self.free_gpus}) != len(self.free_gpus):
            raise PipelineError(f"site {self.key}: a node is listed twice in free_gpus")
        if self.max_gpus_per_stage is not None and self.max_gpus_per_stage < 1:
            raise PipelineError(f"site {self.key}: max_gpus_per_stage must be >= 1")
        # Summed once: the planner asks for it several times per site and decision.
        object.__setattr__(self, "_free_total", sum(free for _, free in self.free_gpus))

    @property
    def key(self) -> tuple[str, str]:
        """(cluster, GPU model): what makes a site distinct, and the order of deterministic ties."""
        return (self.cluster, self.gpu_model)

    @property
    def gpus_free_total(self) -> int:
        """Free GPUs over all the site's nodes."""
        return self._free_total

    @property
    def stage_gpu_cap(self) -> int:
        """The most GPUs one stage here may take."""
        total = self.gpus_free_total
        return total if self.max_gpus_per_stage is None else min(total, self.max_gpus_per_stage)


@dataclass(frozen=True, slots=True)
class StagePlan:
    """One stage: layers ``first_layer..last_layer`` (inclusive, 0-based) on ``gpus`` GPUs of ``site``.

    ``compute_s`` is its compute per step; ``transfer_s`` the activation transfer to the next stage
    (0 for the last stage).
    """

    site: Site
    first_layer: int
    last_layer: int
    gpus: int
    allocations: tuple[tuple[str, int], ...]
    compute_s: float
    transfer_s: float


@dataclass(frozen=True, slots=True)
class PipelinePlan:
    """Stages in layer order and the time per step they give.

    ``step_s`` is the steady-state time per step of the pipelined job: equal to ``bottleneck_s``, the
    slowest stage compute or transfer, because every stage works on a different step at once (pipeline
    fill and drain are not counted; ``latency_s`` is the time one step takes through an empty pipeline).
    """

    stages: tuple[StagePlan, ...]
    bottleneck_s: float
    step_s: float

    @property
    def latency_s(self) -> float:
        """Sum of every stage's compute and transfer: one step through an empty pipeline."""
        return math.fsum(s.compute_s + s.transfer_s for s in self.stages)

    @property
    def gpus(self) -> int:
        """GPUs over all stages."""
        return sum(s.gpus for s in self.stages)

    @property
    def allocations(self) -> tuple[tuple[str, int], ...]:
        """Every stage's (node, GPUs): reserve them in one call so all stages are placed or none."""
        return tuple(a for s in self.stages for a in s.allocations)

    def parts(self) -> list[PlacedPart]:
        """The stages as :class:`~loom_proto.jobs.PlacedPart` for ``JobPlaced.parts``, in layer order."""
        return [
            PlacedPart(
                cluster=s.site.cluster,
                region=s.site.region,
                gpu_model=s.site.gpu_model,
                allocations=[NodeAllocation(node=node, gpus=gpus) for node, gpus in s.allocations],
                layers=(s.first_layer, s.last_layer),
            )
            for s in self.stages
        ]


# -- the model's formulas ---------------------------------------------------------------------------


def stage_gpus(
    memory_gib: float, gpu_memory_gib: float, usable_fraction: float = DEFAULT_USABLE_FRACTION
) -> int:
    """GPUs a stage holding ``memory_gib`` needs: at least one, enough to hold its memory."""
    return max(1, math.ceil(memory_gib / (gpu_memory_gib * usable_fraction) - _CEIL_SLACK))


def useful_capacity(site: Site, memory_gib: float, usable_fraction: float = DEFAULT_USABLE_FRACTION) -> float:
    """The compute a site can give a model of ``memory_gib``: its speed per GPU x the GPUs it could use.

    A site hosts one stage, and a stage gets the GPUs its memory needs, never more for speed; so the
    site can use at most the GPUs the whole model would need there (:func:`stage_gpus`), and free
    GPUs beyond that are of no use to this job. Ranking sites by this, not by speed x free GPUs,
    keeps a pool of many slow GPUs from hiding a faster pool that has enough for the job.
    """
    usable = min(site.stage_gpu_cap, stage_gpus(memory_gib, site.gpu_memory_gib, usable_fraction))
    return site.speed_per_gpu * usable


def transfer_s(activation_mb: float, rtt_ms: float, bandwidth_gbps: float) -> float:
    """Seconds to send ``activation_mb`` over a link; infinite when the link carries nothing."""
    if bandwidth_gbps <= 0:
        return math.inf
    return activation_mb * 8 / (1000 * bandwidth_gbps) + rtt_ms / 1000


def _link(net: Network, src: str, dst: str) -> tuple[float, float]:
    if isinstance(net, Mapping):
        found = net.get((src, dst))
        if found is None:
            return (0.0, 0.0)
        rtt_ms, bandwidth_gbps = found
    else:
        rtt_ms, bandwidth_gbps = net(src, dst)
    if not (rtt_ms >= 0 and bandwidth_gbps >= 0 and math.isfinite(rtt_ms)):
        raise PipelineError(f"link {src} -> {dst}: rtt_ms and bandwidth_gbps must be >= 0 and finite")
    return (float(rtt_ms), float(bandwidth_gbps))


# -- the problem as arrays --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Problem:
    """Everything the search reads, computed once: stage times for every (site, first, last) unit.

    The search works on units: the layers themselves, or blocks of consecutive layers when there are
    more than ``max_layers`` (see :func:`_units`).
    """

    sites: tuple[Site, ...]
    n: int
    """Units (layers or blocks)."""
    bounds: _I64
    """The first layer of each unit, then the number of layers."""
    compute: _F64
    """(site, first unit, last unit) -> compute seconds; inf where the stage does not fit or first > last."""
    memory_prefix: _F64
    """Memory of the layers before each unit boundary: what sizes a stage's GPUs."""
    usable_fraction: float
    transfer: _F64
    """(from site, to site, last unit of the stage) -> transfer seconds; inf on the diagonal."""
    compute_total: float
    """Compute seconds of all layers on one reference GPU."""


def _check_inputs(layers: Sequence[Layer], sites: Sequence[Site], usable_fraction: float) -> None:
    if not layers:
        raise PipelineError("a pipeline needs at least one layer")
    if not (0 < usable_fraction <= 1):
        raise PipelineError(f"usable_fraction must be in (0, 1], got {usable_fraction}")
    seen: set[tuple[str, str]] = set()
    for site in sites:
        if site.key in seen:
            raise PipelineError(f"site {site.key} is listed twice; merge its nodes into one Site")
        seen.add(site.key)


def _considered(
    sites: Sequence[Site], max_sites: int, memory_gib: float, usable_fraction: float
) -> tuple[Site, ...]:
    """Usable sites in key order; beyond ``max_sites`` only those of most :func:`useful_capacity`."""
    usable = [s for s in sites if s.speed_per_gpu > 0 and s.stage_gpu_cap > 0]
    if len(usable) > max_sites:
        usable = sorted(usable, key=lambda s: (-useful_capacity(s, memory_gib, usable_fraction), s.key))
        usable = usable[:max_sites]
    return tuple(sorted(usable, key=lambda s: s.key))


def whole_model(layers: Sequence[Layer]) -> tuple[float, float]:
    """The model's compute per step (reference GPU) and memory, summed as the search sums its
    stages (running sums), the one sum every part of the planner uses: it sizes a one-stage plan
    in :func:`best_single`, ranks sites by :func:`useful_capacity`, and bounds the GPUs any stage
    of :func:`plan` can need."""
    compute_s = float(_prefix([layer.compute_s for layer in layers])[-1])
    memory_gib = float(_prefix([layer.memory_gib for layer in layers])[-1])
    return compute_s, memory_gib


def _prefix(values: Sequence[float]) -> _F64:
    """Running sums with a leading 0: a stage's total is a difference of two entries."""
    return np.concatenate(([0.0], np.cumsum(np.asarray(values, dtype=np.float64))))


def _units(activation_mb: _F64, max_layers: int) -> _I64:
    """Unit boundaries: every layer, or ``max_layers`` blocks when there are more layers.

    Blocks keep the search affordable for deep models: the layers are split into ``max_layers``
    equal windows and each block ends at the layer of its window that sends the least (so cuts can
    only fall there). Returns the first layer of each unit, then the number of layers.
    """
    n = activation_mb.size
    if n <= max_layers:
        return np.arange(n + 1, dtype=np.int64)
    edges = np.linspace(0, n, max_layers + 1).astype(np.int64)
    cuts = [int(lo + np.argmin(activation_mb[lo:hi])) + 1 for lo, hi in itertools.pairwise(edges[:-1])]
    return np.array([0, *cuts, n], dtype=np.int64)


def _links(net: Network, sites: Sequence[Site]) -> dict[tuple[str, str], tuple[float, float]]:
    """The measured link of every ordered pair of distinct sites' regions (each asked once)."""
    links: dict[tuple[str, str], tuple[float, float]] = {}
    for src in sites:
        for dst in sites:
            pair = (src.region, dst.region)
            if src is not dst and pair not in links:
                links[pair] = _link(net, *pair)
    return links


def _problem(
    layers: Sequence[Layer],
    sites: tuple[Site, ...],
    links: Mapping[tuple[str, str], tuple[float, float]],
    usable_fraction: float,
    max_layers: int,
) -> _Problem:
    activation = np.array([layer.activation_mb for layer in layers], dtype=np.float64)
    bounds = _units(activation, max_layers)
    n = bounds.size - 1
    compute_prefix = _prefix([layer.compute_s for layer in layers])[bounds]
    memory_prefix = _prefix([layer.memory_gib for layer in layers])[bounds]
    ordered = np.arange(n)[:, None] <= np.arange(n)[None, :]
    stage_compute = compute_prefix[1:][None, :] - compute_prefix[:-1][:, None]
    stage_memory = memory_prefix[1:][None, :] - memory_prefix[:-1][:, None]
    compute = np.full((len(sites), n, n), np.inf)
    for k, site in enumerate(sites):
        # the same arithmetic as stage_gpus, so the plan's GPUs are those the search sized
        need = np.maximum(
            1, np.ceil(stage_memory / (site.gpu_memory_gib * usable_fraction) - _CEIL_SLACK)
        ).astype(np.int64)
        fits = ordered & (need <= site.stage_gpu_cap)
        compute[k] = np.where(fits, stage_compute / (need * site.speed_per_gpu), np.inf)
    sent_mb = activation[bounds[1:-1] - 1]  # what each unit but the last sends to the next
    transfer = np.full((len(sites), len(sites), n - 1), np.inf)
    for a, src in enumerate(sites):
        for b, dst in enumerate(sites):
            if a == b:
                continue
            rtt_ms, bandwidth_gbps = links[(src.region, dst.region)]
            if bandwidth_gbps > 0:
                transfer[a, b] = sent_mb * 8 / (1000 * bandwidth_gbps) + rtt_ms / 1000
    return _Problem(
        sites=sites,
        n=n,
        bounds=bounds,
        compute=compute,
        memory_prefix=memory_prefix,
        usable_fraction=usable_fraction,
        transfer=transfer,
        compute_total=float(compute_prefix[-1]),
    )


# -- the search -------------------------------------------------------------------------------------


def _finishable(prob: _Problem, bounds: _F64, stages: int) -> _Bool:
    """``ok[b, r, t, p]``: under ``bounds[b]``, a stage on site ``t`` starting at layer ``p`` can end
    the model within ``r`` stages.

    A relaxation (a site may appear again, just not twice in a row) used only to prune states of the
    exact search that cannot finish.
    """
    n, count = prob.n, len(prob.sites)
    limit = bounds[:, None, None, None]
    fits = (prob.compute[None] <= limit).astype(np.float32)
    links = prob.transfer[None] <= limit
    ok = np.zeros((bounds.size, stages + 1, count, n), dtype=bool)
    ok[:, 1] = fits[..., n - 1] > 0
    for r in range(2, stages + 1):
        # a stage may end at q when it is the last one, or another site can go on from q+1
        ends = np.ones((bounds.size, count, n), dtype=np.float32)
        ends[..., : n - 1] = (links & ok[:, r - 1][:, None, :, 1:]).any(axis=2)
        ok[:, r] = ok[:, r - 1] | ((fits @ ends[..., None])[..., 0] > 0)
    return ok


def _pack(flags: _Bool) -> _U64:
    """Bool flags over the last axis as 64-bit words: bit ``i`` of the set is flag ``i``.

    The words are read as native integers, which assumes a little-endian host (x86, ARM).
    """
    words = -(-flags.shape[-1] // 64)
    padded = np.zeros((*flags.shape[:-1], words * 64), dtype=bool)
    padded[..., : flags.shape[-1]] = flags
    return np.packbits(padded, axis=-1, bitorder="little").view(np.uint64)


def _unpack(words: _U64) -> _Bool:
    """The inverse of :func:`_pack` (padded to whole words)."""
    return np.unpackbits(np.ascontiguousarray(words).view(np.uint8), axis=-1, bitorder="little").view(bool)


def _heads(ordered: _I64) -> _I64:
    """Where each run of equal values starts in a sorted array."""
    head = np.ones(ordered.size, dtype=bool)
    head[1:] = ordered[1:] != ordered[:-1]
    return np.flatnonzero(head)


# PLR0915: one vectorised search over arrays built here.
def _stages_needed(prob: _Problem, bounds: _F64, max_stages: int) -> _I64:  # noqa: PLR0915
    """For each bound, the fewest stages of a plan whose every compute and transfer is within it (0: none).

    The exact feasibility check, for several bounds at once. One row per (bound, sites used, site of
    the current stage) holds the set of positions that stage may start at (position ``p``: ``p``
    layers done), packed into 64-bit words so a row costs a few words whatever the number of layers.
    """
    n, count, batch = prob.n, len(prob.sites), bounds.size
    limit = bounds[:, None, None, None]
    # reach[b, t, p]: positions q+1 at which a stage on t starting at p may end
    reach = np.zeros((batch, count, n, n + 1), dtype=bool)
    reach[..., 1:] = prob.compute[None] <= limit
    reach_words = _pack(reach)
    # hop[b, t, u]: positions p at which a stage on u may start after a stage on t (cut after p-1)
    hop = np.zeros((batch, count, count, n + 1), dtype=bool)
    hop[..., 1:n] = prob.transfer[None] <= limit
    hop_words = _pack(hop)
    ok = np.zeros((batch, max_stages + 1, count, n + 1), dtype=bool)
    ok[..., :n] = _finishable(prob, bounds, max_stages)
    ok_words = _pack(ok)
    end_word, end_bit = divmod(n, 64)
    bits = np.int64(1) << np.arange(count, dtype=np.int64)
    needed = np.zeros(batch, dtype=np.int64)
    which = np.repeat(np.arange(batch, dtype=np.int64), count)
    current = np.tile(np.arange(count, dtype=np.int64), batch)
    masks = bits[current]
    starts = np.zeros((which.size, reach_words.shape[-1]), dtype=np.uint64)
    starts[:, 0] = 1
    # seen[(b, mask, t)]: positions a stage on t was found to start at with the sites of mask or of
    # a subset of it (as far as the rows found so far tell)
    seen = np.zeros(((batch << count) * count, starts.shape[1]), dtype=np.uint64)
    for level in range(1, max_stages + 1):
        starts &= ok_words[which, max_stages - level + 1, current]
        # A start already reached with fewer sites (a strict subset, so in fewer stages) dominates:
        # whatever finishes from here finishes from there too, with fewer stages. Masks one site
        # smaller hold the closure; the others looked up here (one site more, or without the
        # current site) are empty.
        row_of = (which << count) * count + current
        earlier = np.bitwise_or.reduce(
            seen[row_of[:, None] + (masks[:, None] ^ bits[None, :]) * count], axis=1
        )
        starts &= ~earlier
        seen[row_of + masks * count] = starts | earlier
        live = starts.any(axis=1)
        which, current, masks, starts = which[live], current[live], masks[live], starts[live]
        row, first = np.nonzero(_unpack(starts)[:, :n])
        if row.size == 0:
            break
        at = _heads(row)
        ends = np.zeros_like(starts)
        ends[row[at]] = np.bitwise_or.reduceat(reach_words[which[row], current[row], first], at, axis=0)
        done = ((ends[:, end_word] >> np.uint64(end_bit)) & np.uint64(1)).astype(bool)
        needed[which[done]] = level
        if level == max_stages:
            break
        alive = needed[which] == 0  # a bound that is settled needs no more rows
        which, current, masks, ends = which[alive], current[alive], masks[alive], ends[alive]
        onward = ends[:, None, :] & hop_words[which, current]  # (row, next site, start positions)
        free = (masks[:, None] & bits[None, :]) == 0
        row, nxt = np.nonzero(free & onward.any(axis=2))
        if row.size == 0:
            break
        keys = (((which[row] << count) | masks[row] | bits[nxt]) * count) + nxt
        order = np.argsort(keys, kind="stable")
        at = _heads(keys[order])
        unique = keys[order][at]
        current, rest = unique % count, unique // count
        which, masks = rest >> count, rest & ((1 << count) - 1)
        starts = np.bitwise_or.reduceat(onward[row[order], nxt[order]], at, axis=0)
    return needed


def _min_bottleneck(prob: _Problem, max_stages: int) -> tuple[float, int] | None:
    """The smallest bound under which a plan of at most ``max_stages`` stages exists, and the fewest
    stages of a plan within it (bottlenecks within a relative ``_TIE_RTOL`` count as equal); None when
    no plan exists.

    The optimum is one of the stage compute or transfer times, so the search runs over those; small
    searches check several at once (a k-ary search: one batched check splits what is left into k+1).
    """
    compute = prob.compute[np.isfinite(prob.compute)]
    transfer = prob.transfer[np.isfinite(prob.transfer)]
    candidates = np.unique(np.concatenate((compute, transfer)))
    # every stage's compute is at least its work over the most capacity its site offers, so the
    # slowest is at least all the work over the capacity of the fastest max_stages sites
    capacity = sorted((s.speed_per_gpu * s.stage_gpu_cap for s in prob.sites), reverse=True)
    lower = prob.compute_total / math.fsum(capacity[:max_stages])
    candidates = candidates[candidates >= lower * (1 - _TIE_RTOL)]
    if candidates.size == 0:
        return None
    count = len(prob.sites)
    width = _SEARCH_WIDTH if (count << count) * prob.n <= _SMALL_SEARCH else 1
    # invariant: nothing below lo is feasible; hi is, once stages (its fewest stages) is known
    lo, hi, stages = 0, candidates.size - 1, 0
    while stages == 0 or lo < hi:
        steps = np.arange(1, width + 1)
        # until hi is known feasible, the probes run up to and including it
        probe = np.unique(lo + (hi - lo) * steps // (width if stages == 0 else width + 1))
        needed = _stages_needed(prob, candidates[probe], max_stages)
        if not needed.any():
            if stages == 0:
                return None
            lo = int(probe[-1]) + 1
            continue
        first = int(np.argmax(needed > 0))
        hi, stages = int(probe[first]), int(needed[first])
        lo = int(probe[first - 1]) + 1 if first > 0 else lo
    best = float(candidates[hi])
    bound = best * (1 + _TIE_RTOL)
    if hi + 1 < candidates.size and candidates[hi + 1] <= bound:  # a near-tie may need fewer stages
        stages = int(_stages_needed(prob, np.array([bound]), max_stages)[0])
    return best, stages


def _best_per_key(keys: _I64, values: _I64, tiebreak: _I64) -> _I64:
    """Index of the least (value, tiebreak) for each distinct key, in key order."""
    order = np.lexsort((tiebreak, values, keys))
    return order[_heads(keys[order])]


def _dense_rank(values: _I64) -> _I64:
    """Each value's rank among the distinct values (0 for the least)."""
    return np.unique(values, return_inverse=True)[1].astype(np.int64)


def _remember(seen: _U64, masks: _I64, current: _I64, first: _I64, bits: _I64) -> None:
    """Record states (sites used, current site, first layer) in ``seen``, closed over smaller masks.

    Row ``mask * count + site`` of ``seen`` holds the bits of the first layers reached with those
    sites or a subset of them.
    """
    count = bits.size
    rows = np.unique(masks * count + current)
    row_masks, row_sites = rows // count, rows % count
    for site_bit in bits:  # masks one site smaller (the others looked up are empty)
        seen[rows] |= seen[(row_masks ^ site_bit) * count + row_sites]
    np.bitwise_or.at(
        seen, (masks * count + current, first >> 6), np.uint64(1) << (first & 63).astype(np.uint64)
    )


def _dominated(seen: _U64, masks: _I64, current: _I64, first: _I64, bits: _I64) -> _Bool:
    """Which states were reached before with a strict subset of their sites (so in fewer stages)."""
    count = bits.size
    word, bit = first >> 6, np.uint64(1) << (first & 63).astype(np.uint64)
    hit = np.zeros(masks.size, dtype=bool)
    for site_bit in bits:
        hit |= (seen[(masks ^ site_bit) * count + current, word] & bit) != 0
    return hit


# PLR0915: one dynamic program over arrays built here.
def _cheapest(prob: _Problem, bound: float, stages: int) -> list[tuple[int, int, int]]:  # noqa: PLR0915
    """The plan of exactly ``stages`` stages within ``bound`` whose stage times sum least.

    Returns (site index, first layer, last layer) per stage; the caller knows such a plan exists.
    Sums are compared in steps of ``1e-10 * bound`` so that rounding does not decide ties; among
    equal sums the plan whose (site, last layer) sequence, stage by stage, comes first wins: each
    state carries the rank of its prefix in that order.
    """
    n, count = prob.n, len(prob.sites)
    quantum = bound * 1e-10
    ok = _finishable(prob, np.array([bound]), stages)[0]
    fits = prob.compute <= bound
    # the last layers a stage on t starting at p may end at, flattened (t, p, last) in order
    fit_last = np.nonzero(fits)[2]
    fit_count = fits.sum(axis=2)
    fit_offset = (np.cumsum(fit_count.ravel()) - fit_count.ravel()).reshape(fit_count.shape)
    links = prob.transfer <= bound
    bits = np.int64(1) << np.arange(count, dtype=np.int64)
    # states of a level: (sites used, site of the current stage, its first layer) with the least sum
    current = np.flatnonzero(ok[stages][:, 0]).astype(np.int64)
    masks, first = bits[current], np.zeros(current.size, dtype=np.int64)
    value, rank = np.zeros(current.size), current.copy()
    seen = np.zeros((count << count, -(-(n + 1) // 64)), dtype=np.uint64)
    _remember(seen, masks, current, first, bits)
    parents: list[_I64] = []  # per level after the first: the end each state continues
    ends_of: list[tuple[_I64, _I64]] = []  # per level but the last: (state, last layer) of each end
    firsts: list[tuple[_I64, _I64]] = [(current, first)]
    for level in range(1, stages):
        # every end of every state's stage from which another site can carry on
        spans = fit_count[current, first]
        state = np.repeat(np.arange(current.size), spans)
        within = np.arange(state.size) - np.repeat(np.cumsum(spans) - spans, spans)
        last = fit_last[fit_offset[current, first][state] + within]
        onward = np.zeros((count, n), dtype=bool)
        onward[:, : n - 1] = (links & ok[stages - level][None, :, 1:]).any(axis=1)
        keep = onward[current[state], last]
        state, last = state[keep], last[keep]
        total = value[state] + prob.compute[current[state], first[state], last]
        order = rank[state] * n + last
        pick = _best_per_key(
            (masks[state] * count + current[state]) * n + last,
            np.floor(total / quantum).astype(np.int64),
            order,
        )
        state, last, total, end_rank = state[pick], last[pick], total[pick], _dense_rank(order[pick])
        ends_of.append((state, last))
        emask, ecur = masks[state], current[state]
        hop = prob.transfer[ecur, :, last]  # (end, next site)
        ok_next = ok[stages - level][:, last + 1].T
        end, nxt = np.nonzero((hop <= bound) & ((emask[:, None] & bits[None, :]) == 0) & ok_next)
        total = total[end] + hop[end, nxt]
        new_masks = emask[end] | bits[nxt]
        new_first = last[end] + 1
        order = end_rank[end] * count + nxt
        pick = _best_per_key(
            (new_masks * count + nxt) * n + new_first, np.floor(total / quantum).astype(np.int64), order
        )
        pick = pick[~_dominated(seen, new_masks[pick], nxt[pick], new_first[pick], bits)]
        masks, current, first, value = new_masks[pick], nxt[pick], new_first[pick], total[pick]
        _remember(seen, masks, current, first, bits)
        rank = _dense_rank(order[pick])
        parents.append(end[pick])
        firsts.append((current, first))
    done = np.floor((value + prob.compute[current, first, n - 1]) / quantum).astype(np.int64)
    best = int(np.lexsort((rank, done))[0])
    # walk back from the chosen final state
    plan_rev: list[tuple[int, int, int]] = []
    index, last_layer = best, n - 1
    for level in range(stages, 0, -1):
        sites_at, firsts_at = firsts[level - 1]
        plan_rev.append((int(sites_at[index]), int(firsts_at[index]), last_layer))
        if level > 1:
            continued = int(parents[level - 2][index])
            end_states, end_lasts = ends_of[level - 2]
            index, last_layer = int(end_states[continued]), int(end_lasts[continued])
    return plan_rev[::-1]


def _stage(site: Site, first: int, last: int, *, gpus: int, compute_s: float, transfer_s: float) -> StagePlan:
    """A stage with its GPUs taken from the site's nodes, most free first."""
    allocations = pack_workers(site.free_gpus, 1, gpus)
    if allocations is None:  # the search only uses stages that fit the site's free GPUs
        raise AssertionError(f"a stage of {gpus} GPU(s) does not fit {site.key}")
    return StagePlan(
        site=site,
        first_layer=first,
        last_layer=last,
        gpus=gpus,
        allocations=tuple(allocations),
        compute_s=compute_s,
        transfer_s=transfer_s,
    )


# -- the public entry points ------------------------------------------------------------------------


def plan(
    layers: Sequence[Layer],
    sites: Sequence[Site],
    net: Network,
    *,
    max_stages: int = 8,
    usable_fraction: float = DEFAULT_USABLE_FRACTION,
    max_sites: int = DEFAULT_MAX_SITES,
    max_layers: int = DEFAULT_MAX_LAYERS,
) -> PipelinePlan | None:
    """The plan of 1..``max_stages`` stages with the smallest bottleneck; None when nothing fits now.

    One stage wins whenever splitting is not strictly faster (fewer stages win ties), so a result with
    several stages means the model does not fit one site or runs faster split; compare with
    :func:`best_single` to tell which. Exact over the sites considered when the model has at most
    ``max_layers`` layers (see the module docstring for ``max_sites`` and ``max_layers``). Sites with
    no free GPUs or no speed are ignored.

    Raises :class:`PipelineError` on unusable input (no layers, a bad fraction or limit, a site listed
    twice, a negative link figure).
    """
    _check_inputs(layers, sites, usable_fraction)
    if max_stages < 1 or not (1 <= max_sites <= MAX_SITES_LIMIT) or max_layers < 2:
        raise PipelineError(
            f"need max_stages >= 1, 1 <= max_sites <= {MAX_SITES_LIMIT} and max_layers >= 2;"
            f" got {max_stages}, {max_sites} and {max_layers}"
        )
    _, memory_gib = whole_model(layers)
    considered = _considered(sites, max_sites, memory_gib, usable_fraction)
    if not considered:
        return None
    links = _links(net, considered)
    limits = _Limits(max_stages, usable_fraction, max_layers)
    key = _memo_key(layers, considered, links, limits, memory_gib)
    stages = _PLANS.get(key, _UNKNOWN)
    if stages is not _UNKNOWN:
        _PLANS.move_to_end(key)
    else:
        stages = _search(layers, considered, links, limits)
        _PLANS[key] = stages
        while len(_PLANS) > PLAN_MEMO_SIZE:
            _PLANS.popitem(last=False)
    if stages is None or isinstance(stages, _Unknown):
        return None
    built = [
        _stage(considered[k], first, last, gpus=gpus, compute_s=compute_s, transfer_s=hop)
        for k, first, last, gpus, compute_s, hop in stages
    ]
    bottleneck_s = max(max(s.compute_s, s.transfer_s) for s in built)
    return PipelinePlan(stages=tuple(built), bottleneck_s=bottleneck_s, step_s=bottleneck_s)


_Stages = tuple[tuple[int, int, int, int, float, float], ...]
"""A plan by site position: (site, first layer, last layer, GPUs, compute_s, transfer_s) per stage."""

PLAN_MEMO_SIZE = 1024
"""Searches remembered by :func:`plan` (the least recently used goes first)."""


class _Unknown:
    """Marks a search not remembered (a remembered one may be None: no plan)."""


_UNKNOWN = _Unknown()

_PLANS: "OrderedDict[Hashable, _Stages | None]" = OrderedDict()
"""Search results by everything the search reads (:func:`_memo_key`)."""


class _Limits(NamedTuple):
    """The search's settings."""

    max_stages: int
    usable_fraction: float
    max_layers: int


def _memo_key(
    layers: Sequence[Layer],
    considered: tuple[Site, ...],
    links: Mapping[tuple[str, str], tuple[float, float]],
    limits: _Limits,
    memory_gib: float,
) -> Hashable:
    """Everything the search reads, so equal keys give the same plan by site position.

    A site enters as its region, speed and GPU memory, and its free GPUs only up to what the whole
    model (``memory_gib``, from :func:`whole_model`, so no stage needs more) needs there: GPUs
    beyond that change neither which stages fit nor the search's answer (its lower bound only
    skips bounds that cannot be met). The sites' names do not enter: their order (by key) is the
    order of ties in both searches alike. The layers enter as a 128-bit digest of their figures,
    so a key stays small however deep the model. On a platform of replicated clusters many
    decisions share a key: the search runs once for them.
    """
    figures = np.array([(la.compute_s, la.memory_gib, la.activation_mb) for la in layers], dtype=np.float64)
    return (
        len(layers),
        hashlib.blake2b(figures.tobytes(), digest_size=16).digest(),
        tuple(
            (
                s.region,
                s.speed_per_gpu,
                s.gpu_memory_gib,
                min(s.stage_gpu_cap, stage_gpus(memory_gib, s.gpu_memory_gib, limits.usable_fraction)),
            )
            for s in considered
        ),
        tuple(sorted(links.items())),
        limits,
    )


def _search(
    layers: Sequence[Layer],
    considered: tuple[Site, ...],
    links: Mapping[tuple[str, str], tuple[float, float]],
    limits: _Limits,
) -> _Stages | None:
    """The exact search over the considered sites: the best plan's stages by site position."""
    prob = _problem(layers, considered, links, limits.usable_fraction, limits.max_layers)
    limit = min(limits.max_stages, len(considered), prob.n)
    found = _min_bottleneck(prob, limit)
    if found is None:
        return None
    best, stages = found
    cuts = _cheapest(prob, best * (1 + _TIE_RTOL), stages)
    out = []
    for k, (t, first, last) in enumerate(cuts):
        site = prob.sites[t]
        memory = float(prob.memory_prefix[last + 1] - prob.memory_prefix[first])
        out.append(
            (
                t,
                int(prob.bounds[first]),
                int(prob.bounds[last + 1]) - 1,
                stage_gpus(memory, site.gpu_memory_gib, prob.usable_fraction),
                float(prob.compute[t, first, last]),
                float(prob.transfer[t, cuts[k + 1][0], last]) if k + 1 < len(cuts) else 0.0,
            )
        )
    return tuple(out)


def best_single(
    layers: Sequence[Layer], sites: Sequence[Site], *, usable_fraction: float = DEFAULT_USABLE_FRACTION
) -> PipelinePlan | None:
    """The fastest plan that keeps the whole model on one site (every site considered); None: none fits.

    Its figures are those :func:`plan` computes for the same one-stage plan, so comparing the two
    bottlenecks tells whether splitting is faster.
    """
    _check_inputs(layers, sites, usable_fraction)
    compute_s, memory_gib = whole_model(layers)
    best: StagePlan | None = None
    for site in _considered(sites, len(sites), memory_gib, usable_fraction):
        gpus = stage_gpus(memory_gib, site.gpu_memory_gib, usable_fraction)
        if gpus > site.stage_gpu_cap:
            continue
        seconds = compute_s / (gpus * site.speed_per_gpu)
        if best is None or seconds < best.compute_s:
            best = _stage(site, 0, len(layers) - 1, gpus=gpus, compute_s=seconds, transfer_s=0.0)
    if best is None:
        return None
    return PipelinePlan(stages=(best,), bottleneck_s=best.compute_s, step_s=best.compute_s)


def _label(site: Site) -> str:
    return f"{site.cluster}/{site.gpu_model}"


def infeasible_reason(
    layers: Sequence[Layer],
    sites: Sequence[Site],
    net: Network,
    *,
    max_stages: int = 8,
    usable_fraction: float = DEFAULT_USABLE_FRACTION,
    max_sites: int = DEFAULT_MAX_SITES,
    max_layers: int = DEFAULT_MAX_LAYERS,
    capacity: bool = False,
) -> str | None:
    """Why :func:`plan` finds nothing, in words the submitter can act on; None when a plan exists.
    ``capacity``: the sites list every GPU, busy or not (the reason then speaks of the platform's
    GPUs, not of those free now).

    It speaks of the GPUs free now: waiting for capacity may help where the total GPUs would suffice.
    """
    found = plan(
        layers,
        sites,
        net,
        max_stages=max_stages,
        usable_fraction=usable_fraction,
        max_sites=max_sites,
        max_layers=max_layers,
    )
    if found is not None:
        return None
    _, memory_gib = whole_model(layers)
    considered = _considered(sites, max_sites, memory_gib, usable_fraction)
    if not considered:
        held = "GPUs" if capacity else "free GPUs"
        return f"none of the {len(sites)} site(s) offered has {held} with a positive speed for this job"

    def holds_gib(site: Site) -> float:
        return site.stage_gpu_cap * site.gpu_memory_gib * usable_fraction

    biggest = max(considered, key=lambda s: (holds_gib(s), s.key))
    for index, layer in enumerate(layers):
        if layer.memory_gib > holds_gib(biggest) * (1 + _CEIL_SLACK):
            name = f"'{layer.name}' (#{index})" if layer.name else f"#{index}"
            return (
                f"layer {name} needs {layer.memory_gib:.0f} GiB; the most one site can hold is"
                f" {holds_gib(biggest):.0f} GiB ({_label(biggest)}), and a layer is never split across sites"
            )
    stages = min(max_stages, len(considered), len(layers))
    largest = sorted(considered, key=lambda s: (-holds_gib(s), s.key))[:stages]
    need_gib = memory_gib
    free_gib = math.fsum(holds_gib(s) for s in largest)
    if need_gib > free_gib * (1 + _CEIL_SLACK):
        return (
            f"the model needs {need_gib:.0f} GiB; the largest {'' if capacity else 'free '}total is"
            f" {free_gib:.0f} GiB across"
            f" {len(largest)} site(s) ({', '.join(_label(s) for s in largest)}) with at most {max_stages}"
            f" stage(s) and {usable_fraction:.0%} of each GPU's memory usable"
        )
    if len(considered) > 1 and not any(
        _link(net, a.region, b.region)[1] > 0 for a in considered for b in considered if a is not b
    ):
        return (
            "the model does not fit one site, and no measured link joins the sites that could hold its"
            " stages; the stages cannot be connected"
        )
    blocks = (
        f" (cut only between {max_layers} blocks of layers, at the layer of each that sends least)"
        if len(layers) > max_layers
        else ""
    )
    return (
        f"no cut of the {len(layers)} layer(s) into at most {max_stages} contiguous stage(s){blocks} fits"
        f" the free GPUs of {len(considered)} site(s): each site hosts one stage, a layer is never split,"
        " and stages are joined only over measured links"
    )
