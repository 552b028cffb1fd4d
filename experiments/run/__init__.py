"""Running: the sweep driver, one trial on a worker, reproduce."""
