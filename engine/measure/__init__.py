"""Measurement: metric definitions, memory, fidelity, the cost model and the hardware probe."""
