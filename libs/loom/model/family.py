"""A job's *family*: the key under which its measured speed on each GPU model is learned and looked up.

Jobs of one family (the same model code at the same precision) speed up alike between GPU
models, so what one of them delivered on a GPU says how fast the next one will run there. The
family comes from the job's labels, most specific first:

1. ``labels["family"]``: the submitter's own name for it;
2. ``labels["model"]``: the model the job trains or serves (the simulator's workloads set it);
3. the task type, when the job says nothing more.

Names are folded so that spellings of one model meet: lower case, and every run of characters
other than letters and digits becomes one ``-`` (``"ResNet-50"``, ``"resnet 50"`` and
``"RESNET_50"`` are all ``resnet-50``). A ``labels["precision"]`` of ``fp16``/``bf16`` (mixed
precision) makes its own family (``resnet-50@fp16``): the same model gains far more from a
tensor-core GPU in half precision than in single precision.
"""

import re
from collections.abc import Mapping
from typing import Final, Protocol

__all__ = [
    "FULL_PRECISIONS",
    "HALF_PRECISIONS",
    "PRECISIONS",
    "HasLabels",
    "family_of",
    "fold_family",
    "is_half_precision",
    "job_family",
]

HALF_PRECISIONS: Final = frozenset({"fp16", "bf16", "amp", "mixed"})
"""``labels["precision"]`` values that mean half (mixed) precision training."""
FULL_PRECISIONS: Final = frozenset({"fp32", "tf32", "float32", "full"})
"""``labels["precision"]`` values that mean full precision (what no label means too)."""
PRECISIONS: Final = HALF_PRECISIONS | FULL_PRECISIONS
"""Every ``labels["precision"]`` value the speed tables know (any case)."""

_SEPARATORS: Final = re.compile(r"[^a-z0-9]+")


def is_half_precision(value: str) -> bool:
    """Whether a ``labels["precision"]`` value (any case) means half (mixed) precision training."""
    return value.casefold() in HALF_PRECISIONS


def fold_family(name: str) -> str:
    """``name`` folded for comparison: lower case, runs of separators as one ``-``, none at the ends."""
    return _SEPARATORS.sub("-", name.casefold()).strip("-")


def family_of(labels: Mapping[str, str], task_type: str) -> str:
    """The family of a job with these labels and task type (see the module's docstring)."""
    base = labels.get("family") or labels.get("model") or ""
    folded = fold_family(base) or task_type
    if is_half_precision(labels.get("precision", "")):
        return f"{folded}@fp16"
    return folded


class HasLabels(Protocol):
    """Anything with a job's labels and task type (a ``JobSpec``, a running job's record)."""

    @property
    def labels(self) -> Mapping[str, str]: ...

    @property
    def task_type(self) -> str: ...


def job_family(spec: HasLabels) -> str:
    """The family of a :class:`~loom_proto.jobs.JobSpec` (anything with ``labels`` and ``task_type``)."""
    return family_of(spec.labels, spec.task_type)
