"""Metering and chargeback: what each job attempt used, priced, by tenant and label (pure core).

A **run record** (:class:`~loom.metering.run.RunRecord`) is one attempt of one job as its
lifecycle events tell it: the GPUs placement gave each part (cluster, region, GPU model), the
resizes that changed them, when the run started (``JobStarted.started_at``) and when it ended (the
earliest of ``completed``, ``failed``, ``cancelled`` or the ``requeued`` that gave the attempt up;
preempted and failed runs are metered too, and marked). Times are counted in whole milliseconds
(``round(t * 1000)``), so GPU-milliseconds are integers and every sum is exact.

:func:`~loom.metering.usage.meter` turns a finished run into **usage rows**, one per part, GPU
count and UTC hour (a row never crosses an hour, so each has one price, and any month or window
is a whole number of rows or an exact clip of one). Each row carries GPU-ms, the SCU of one GPU
of its model for the job's task type and precision (:func:`loom.model.profiles.speeds_for_model`),
and the region's price per SCU-hour at that hour (:class:`loom.sched.snapshot.Economics`, the
table the cost plugin scores with). :func:`~loom.metering.usage.aggregate` sums rows by tenant,
label, region or model over a window; :func:`~loom.metering.usage.statement` is a tenant's month.

No clock, no I/O: the metrics service folds events into run records (exactly once, through its
inbox) and stores the rows (``services/metrics/metering.py``); ``loom usage`` reads them.
"""

from loom.metering.run import END_OUTCOMES, Part, RunRecord, fold, to_ms
from loom.metering.usage import (
    Group,
    Statement,
    UsageRow,
    aggregate,
    clip,
    group_key,
    meter,
    month_window_ms,
    scu_of,
    statement,
)

__all__ = [
    "END_OUTCOMES",
    "Group",
    "Part",
    "RunRecord",
    "Statement",
    "UsageRow",
    "aggregate",
    "clip",
    "fold",
    "group_key",
    "meter",
    "month_window_ms",
    "scu_of",
    "statement",
    "to_ms",
]
