"""Placement of trials on Ray. Knows nothing of engines or MLflow: it runs a function per item."""
from .ray_runner import (
    CANCELLED,
    CRASHED,
    DETERMINISTIC,
    EXCLUSIVE_NODE,
    ISOLATIONS,
    SHARED,
    UNPLACEABLE,
    Placement,
    TaskFailure,
    capacity,
    ensure_ray,
    placement,
    run_on_ray,
)

__all__ = ["CANCELLED", "CRASHED", "DETERMINISTIC", "EXCLUSIVE_NODE", "ISOLATIONS", "SHARED", "UNPLACEABLE",
           "Placement", "TaskFailure", "capacity", "ensure_ray", "placement", "run_on_ray"]
