"""Permit: a pipeline waits for a much better plan, never longer than the worse plan would lose.

A pipeline job (:mod:`loom.sched.pipeline`) takes whatever stages the free GPUs allow when it is
decided. On a busy platform that can be a plan several times slower per step than the one it would
get a little later, for a run of hours: its stages land on whichever slow or memory-poor GPUs are
free. This permit compares the plan free now with the best plan on an idle platform (the clusters
policy allows, every GPU free; :data:`~loom.sched.framework.IDLE_PIPELINE_PLAN`) and refuses the
plan when

* its step is more than ``max_slowdown`` times the idle plan's step, and
* the idle plan's stages are expected to have room soon enough
  (:func:`loom.sched.availability.expected_wait_s` per stage pool, from the running jobs'
  predicted ends; the plan waits for its slowest stage to have room) that the wait plus the run
  at the idle plan's step beats the run now by :data:`~loom.sched.plugins.network.WAIT_MARGIN`
  (otherwise waiting buys nothing: the plan is taken now; an unknown end counts as never), and
* the job has waited less than the time the worse plan would lose over the job's steps,
  ``steps x (step_now - step_idle)``.

The second rule is the ski-rental bound: waiting never costs more than taking the worse plan at
once would have, so the job finishes within about twice the better of the two choices, and a
pipeline is never starved by its own patience. A refusal is UNSCHEDULABLE: the job stays queued
and is decided again when capacity frees, or when the bound runs out (``wait_s``). Without the
submission time (``CycleState.submitted_at`` None) the job counts as submitted now. The idle
platform is the clusters policy allows with their schedulable nodes all free.

Planning the idle platform costs as much as the decision itself, so it is skipped when a cheap
lower bound already lets the plan through: no plan can beat ``compute / capacity``, where
``compute`` is the model's compute per step on one reference GPU and ``capacity`` bounds what its
stages can deliver together, ``memory / usable x max(speed / GPU memory) + stages x max(speed)``
(a stage takes ``ceil(its memory / (GPU memory x usable))`` GPUs, at most that share plus one, and
there are at most ``stages`` of them, one per cluster). When ``step_now`` is within ``max_slowdown``
of that bound it is within ``max_slowdown`` of the idle plan too. Otherwise the idle plan is
computed and cached per job and per the inputs it depends on (allowed clusters and models, the
nodes' GPUs and which take work, speeds, GPU memory, trust, measured links), so a waiting pipeline
plans the idle platform once, not on every retry.
"""

import math
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from loom.sched.availability import expected_wait_s
from loom.sched.framework import IDLE_PIPELINE_PLAN, Code, CycleState, Decision, Status
from loom.sched.pipeline import DEFAULT_MAX_SITES, DEFAULT_USABLE_FRACTION, PipelinePlan, whole_model
from loom.sched.plugins.network import MIN_WAIT_S, WAIT_MARGIN, wait_unless_lost

DEFAULT_MAX_SLOWDOWN = 1.5
"""A plan this many times slower per step than the idle platform's best is worth waiting for."""
DEFAULT_CACHE_SIZE = 4096
"""Idle plans kept (one per waiting pipeline; the least recently used goes first)."""


class PipelinePatience:
    """Permit: refuse a pipeline plan much slower than the idle platform's, within the ski-rental bound."""

    name = "pipeline_patience"

    def __init__(
        self, max_slowdown: float = DEFAULT_MAX_SLOWDOWN, cache_size: int = DEFAULT_CACHE_SIZE
    ) -> None:
        if not max_slowdown >= 1.0:
            raise ValueError(f"max_slowdown must be at least 1, got {max_slowdown}")
        if cache_size < 1:
            raise ValueError(f"cache_size must be at least 1, got {cache_size}")
        self.max_slowdown = max_slowdown
        self.cache_size = cache_size
        self._ideal: OrderedDict[tuple[str, bytes], tuple[float, tuple[tuple[str, str, int], ...]] | None] = (
            OrderedDict()
        )

    def permit(self, state: CycleState, decision: Decision) -> Status:
        if not decision.parts or any(p.layers is None for p in decision.parts):
            return Status()
        step_now = decision.predicted_step_s
        if step_now is None:
            return Status()
        try:
            lazy = state.read(IDLE_PIPELINE_PLAN)
        except KeyError:  # not decided by the pipeline planner
            return Status()
        if step_now <= self.max_slowdown * lower_bound_step_s(state):
            return Status()
        idle = self._idle_step(state, lazy)
        if idle is None or step_now <= self.max_slowdown * idle[0]:
            return Status()
        step_idle, stages = idle
        snap = state.snapshot
        wait_s = max(
            (
                expected_wait_s(snap, snap.cluster_index[c], snap.model_index[m], gpus)
                for c, m, gpus in stages
                if c in snap.cluster_index and m in snap.model_index
            ),
            default=math.inf,
        )
        steps = state.job.work.steps
        if not wait_s + steps * step_idle < (1.0 - WAIT_MARGIN) * steps * step_now:
            return Status()  # the better plan is too far away to pay for its wait
        status = wait_unless_lost(
            state,
            step_now,
            step_idle,
            f"the stages free now take {step_now:.2f} s per step against {step_idle:.2f} s on an idle"
            f" platform, expected to have room in {wait_s:.0f} s; waiting for a better plan",
        )
        if status.code == Code.UNSCHEDULABLE and wait_s >= MIN_WAIT_S:
            return Status(status.code, status.reason, wait_s=min(status.wait_s, wait_s))
        return status

    def _idle_step(
        self, state: CycleState, lazy: Callable[[], PipelinePlan | None]
    ) -> tuple[float, tuple[tuple[str, str, int], ...]] | None:
        snap = state.snapshot
        inputs = b"".join(
            (
                (state.policy_mask if state.policy_mask is not None else state.cluster_mask).tobytes(),
                state.model_mask.tobytes(),
                snap.total_sum.tobytes(),
                np.packbits(snap.schedulable).tobytes(),
                snap.job_speeds(state.job).tobytes(),
                repr(sorted(snap.gpu_memory_gib.items())).encode(),
                snap.trust.tobytes(),
                snap.net.rtt_ms.tobytes(),
                snap.net.bandwidth_gbps.tobytes(),
            )
        )
        key = (state.job.job_id, inputs)
        if key in self._ideal:
            self._ideal.move_to_end(key)
            return self._ideal[key]
        plan = lazy()
        step = None
        if plan is not None:
            stages = tuple((st.site.cluster, st.site.gpu_model, st.gpus) for st in plan.stages)
            step = (plan.step_s, stages)
        self._ideal[key] = step
        while len(self._ideal) > self.cache_size:
            self._ideal.popitem(last=False)
        return step


def lower_bound_step_s(state: CycleState) -> float:
    """A step time no pipeline plan of the job can beat on the idle platform (see the module
    docstring); 0 when no allowed pool has GPUs."""
    job, snap = state.job, state.snapshot
    if job.pipeline is None:
        return 0.0
    layers = job.pipeline.layers
    compute, memory = whole_model(layers)
    m_count = snap.total_sum.shape[1]
    allowed = state.policy_mask if state.policy_mask is not None else state.cluster_mask
    up = np.bincount(
        snap.pool_of, weights=np.where(snap.schedulable, snap.total, 0), minlength=snap.total_sum.size
    )
    pools = allowed[:, None] & state.model_mask[None, :m_count] & (up.reshape(snap.total_sum.shape) > 0)
    if not pools.any():
        return 0.0
    # The same GPU memory the framework's pipeline sites assume (16 GiB when a model's is unknown).
    gib = np.array([snap.gpu_memory_gib.get(m, 0.0) or 16.0 for m in snap.models[:m_count]])
    speed = snap.job_speeds(job)[None, :m_count] * snap.trust[:, None]
    fastest = float(speed[pools].max())
    per_gib = float((speed / gib[None, :])[pools].max())
    stages = min(job.pipeline.max_stages, int(pools.any(axis=1).sum()), DEFAULT_MAX_SITES)
    capacity = memory / DEFAULT_USABLE_FRACTION * per_gib + stages * fastest
    return compute / capacity if capacity > 0 else 0.0
