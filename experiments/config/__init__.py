"""Config: Hydra compose and sweep expansion, the schema, trial specs and the config hash."""
