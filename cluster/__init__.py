"""Placement of trials on Ray. Knows nothing of engines or MLflow: it runs a function per item."""
from .ray_runner import TaskFailure, ensure_ray, run_on_ray

__all__ = ["TaskFailure", "ensure_ray", "run_on_ray"]
