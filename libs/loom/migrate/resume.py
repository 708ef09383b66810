"""Where a re-placed run restarts: its latest checkpoint, else step 0 (pure)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Resume:
    """The step the next run starts from and why (for the job's history)."""

    step: int
    why: str


def resume_point(
    *, steps: int, checkpoint_every_steps: int, progress: float, checkpoint_step: int | None
) -> Resume:
    """The step a run lost with its cluster resumes from.

    * the latest checkpoint the store recorded (a ``checkpointed`` job event), if any;
    * else, for a job that declares checkpoints, the last checkpoint interval at or before the
      progress it reported (its checkpoints were written but their events were lost);
    * else step 0: the job declares no checkpoints, or reached none.

    Never the last step or beyond (the run must still have a step to do).
    """
    last = max(steps - 1, 0)
    if checkpoint_step is not None and checkpoint_step > 0:
        step = min(checkpoint_step, last)
        return Resume(step, f"resumes from its checkpoint at step {step} (recorded)")
    if checkpoint_every_steps <= 0:
        return Resume(0, "restarts from step 0 (the job declares no checkpoints)")
    done = int(min(max(progress, 0.0), 1.0) * steps + 1e-6)
    step = min((done // checkpoint_every_steps) * checkpoint_every_steps, last)
    if step <= 0:
        return Resume(0, f"restarts from step 0 (no checkpoint reached; progress {progress:.3f})")
    return Resume(
        step,
        f"resumes from step {step} (last checkpoint interval at or before reported progress {progress:.3f})",
    )
