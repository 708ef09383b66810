"""ResourceFit: GPU model, count and device memory, CPU and RAM.

Pre-filter: the allowed models (an unknown model is rejected at once) and the device memory each
GPU must have narrow the model mask. Filter: per node, room for at least one worker's CPU and RAM
(nodes that do not report CPU or RAM are not checked). The framework itself checks free GPUs.
"""

from collections.abc import Collection

import numpy as np

from loom.sched.framework import SUCCESS, Code, CycleState, Status
from loom.sched.snapshot import BoolArray, IntArray


class ResourceFit:
    """Pre-filter and filter on what one worker needs."""

    name = "resource_fit"

    def __init__(self, known_models: Collection[str] = ()) -> None:
        self.known_models = {m.upper() for m in known_models}

    def pre_filter(self, state: CycleState) -> Status:
        snap = state.snapshot
        res = state.job.resources
        wanted = {m.upper(): m for m in res.gpu_models}
        present = {m.upper() for m in snap.models} if wanted else set()
        unknown = (
            sorted(v for k, v in wanted.items() if k not in present and k not in self.known_models)
            if wanted
            else []
        )
        if unknown:
            known = sorted(present | self.known_models)
            return Status(
                Code.UNRESOLVABLE,
                f"unknown GPU model(s) {', '.join(unknown)}; known models: {', '.join(known)}",
            )
        if wanted:
            allowed = np.array([m.upper() in wanted for m in snap.models], dtype=np.bool_)
            state.model_mask[: allowed.size] &= allowed
        if res.gpu_memory_gib > 0:
            enough = np.array(
                [snap.gpu_memory_gib.get(m, 0.0) >= res.gpu_memory_gib for m in snap.models], dtype=np.bool_
            )
            if not (enough & state.model_mask[: enough.size]).any():
                biggest = max((snap.gpu_memory_gib.get(m, 0.0) for m in snap.models), default=0.0)
                return Status(
                    Code.UNRESOLVABLE,
                    f"no allowed GPU model has {res.gpu_memory_gib:g} GiB of device memory"
                    f" (the largest here has {biggest:g} GiB)",
                )
            state.model_mask[: enough.size] &= enough
        if snap.models and not state.model_mask[: len(snap.models)].any():
            models = ", ".join(sorted(wanted.values())) or "any"
            return Status(
                Code.UNSCHEDULABLE, f"no cluster has joined with GPUs of the allowed models ({models}) yet"
            )
        return SUCCESS

    def filter(self, state: CycleState, nodes: IntArray) -> BoolArray:
        snap = state.snapshot
        res = state.job.resources
        mask = np.ones(nodes.size, dtype=np.bool_)
        if res.cpu_milli:
            mask &= ~snap.cpu_known[nodes] | (snap.cpu_free[nodes] >= res.cpu_milli)
        if res.memory_mib:
            mask &= ~snap.mem_known[nodes] | (snap.mem_free[nodes] >= res.memory_mib)
        return mask

    def filter_key(self, state: CycleState) -> tuple[int, int]:
        """All the filter reads of the job: a worker's CPU and memory (the framework keeps
        workers per pool for each such shape)."""
        res = state.job.resources
        return (res.cpu_milli, res.memory_mib)

    def describe(self, state: CycleState) -> str:
        res = state.job.resources
        parts = [f"{res.gpus} GPU(s)"]
        if res.cpu_milli:
            parts.append(f"{res.cpu_milli / 1000:g} CPU")
        if res.memory_mib:
            parts.append(f"{res.memory_mib / 1024:g} GiB RAM")
        return "each worker needs " + ", ".join(parts) + " on one node"
