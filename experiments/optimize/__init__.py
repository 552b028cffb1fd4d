"""`infersweep optimize`: decision logic above the sweep.

A strategy (chain.py: the seed's chain, one step at a time; search.py: Optuna's multi-objective search, its best
raced) is pure decision logic: it proposes configurations (points) and reads their results back through one
injected `Measure` function (measurement.py) -- the trial runner in production (dispatch.py `TrialMeasure`), a
scripted synthetic objective in tests. What a result means for a decision (objective.py: the ratio to beat;
accuracy.py: the paired non-inferiority gate; decide.py: accept / reject / undecided with the reason, at levels
that keep the stated error over every look) never depends on how it was measured; calibration.py measures what
those verdicts guarantee by driving the chain's own pair loop over simulated machines. types.py holds the shared
types (a leaf); settings.py reads `optimize.*`; deploy.py turns the final configuration into its deploy command.
engine/ knows nothing of this package.
"""
