"""Placement of trials on a worker pool: Ray actors (`run_on_ray`) or this process (`run_in_process`), both
driven by one `Dispatcher`. Knows nothing of engines or MLflow: it runs a function per item."""
from .config import ClusterConfig, placement
from .dispatcher import CANCELLED, CRASHED, DETERMINISTIC, UNPLACEABLE, Dispatcher, Job, TaskFailure, run_pool
from .local_pool import LOCAL_NODE, run_in_process
from .placement import EXCLUSIVE_NODE, ISOLATIONS, SHARED, Placement, capacity
from .ray_pool import ensure_ray, run_on_ray

__all__ = ["CANCELLED", "CRASHED", "DETERMINISTIC", "EXCLUSIVE_NODE", "ISOLATIONS", "LOCAL_NODE", "SHARED",
           "UNPLACEABLE", "ClusterConfig", "Dispatcher", "Job", "Placement", "TaskFailure", "capacity", "ensure_ray",
           "placement", "run_in_process", "run_on_ray", "run_pool"]
