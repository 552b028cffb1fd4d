"""Config hash: stable, order-independent, blind to placement/tracking, sensitive to every measured key."""
from __future__ import annotations

import copy

from experiments.compose import expand
from experiments.hashing import EXCLUDED_TOP, config_hash


def _base():
    (spec,) = expand(["model=tiny-llama"])
    return spec.config


def _leaves(d, prefix=()):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _leaves(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def _set(d, path, value):
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value


def _perturb(v):
    if isinstance(v, bool):
        return not v
    if isinstance(v, (int, float)):
        return v + 1
    if v is None:
        return "x"
    return str(v) + "-x"


def test_same_config_same_hash_across_compositions():
    assert config_hash(_base()) == config_hash(_base())
    assert len(config_hash(_base())) == 64


def test_key_order_is_irrelevant():
    cfg = _base()
    reordered = {k: cfg[k] for k in reversed(list(cfg))}
    reordered["workload"] = {k: cfg["workload"][k] for k in reversed(list(cfg["workload"]))}
    assert config_hash(reordered) == config_hash(cfg)


def test_excluded_keys_are_ignored():
    cfg = _base()
    h = config_hash(cfg)
    other = copy.deepcopy(cfg)
    other["cluster"]["address"] = "ray://elsewhere:10001"
    other["cluster"]["num_cpus_per_trial"] = 7
    other["tracking"]["uri"] = "http://127.0.0.1:5999"
    other["sweep_name"] = "another-name"
    assert config_hash(other) == h
    assert set(EXCLUDED_TOP) >= {"cluster", "tracking", "sweep_name"}


def test_every_measured_key_changes_the_hash():
    cfg = _base()
    h = config_hash(cfg)
    measured = [(p, v) for p, v in _leaves(cfg) if p[0] not in EXCLUDED_TOP]
    assert len(measured) > 20
    for path, value in measured:
        other = copy.deepcopy(cfg)
        _set(other, path, _perturb(value))
        assert config_hash(other) != h, ".".join(path)
