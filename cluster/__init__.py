"""Placement of trials on Ray. Knows nothing of engines or MLflow: it runs a function per item."""
from .dispatcher import CANCELLED, CRASHED, DETERMINISTIC, UNPLACEABLE, Dispatcher, TaskFailure
from .placement import EXCLUSIVE_NODE, ISOLATIONS, SHARED, Placement, capacity, placement
from .ray_runner import ensure_ray, run_on_ray

__all__ = ["CANCELLED", "CRASHED", "DETERMINISTIC", "EXCLUSIVE_NODE", "ISOLATIONS", "SHARED", "UNPLACEABLE",
           "Dispatcher", "Placement", "TaskFailure", "capacity", "ensure_ray", "placement", "run_on_ray"]
