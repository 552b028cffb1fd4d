"""`infersweep optimize`: decision logic above the sweep.

A strategy (chain.py: the seed's chain, one step at a time; search.py: Optuna's multi-objective search) is
pure decision logic: it proposes configurations (points) and reads their results back through one injected
`Measure` function (measurement.py) -- the dispatcher in production (dispatch.py), a scripted synthetic
objective in tests. What a result means for a decision (objective.py: the ratio to beat; accuracy.py: the
paired accuracy test; decide.py: accept / reject / undecided with the reason) never depends on how it was
measured. engine/ knows nothing of this package.
"""
