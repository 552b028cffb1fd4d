"""`infersweep report` on an optimize: the latest `optimize` run of an experiment (or the run named by its id)
rendered from its artifacts -- the chain table and notes (or the Pareto front), the final hash, the plot."""
from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Optional

from .run import FRONT_ARTIFACT, KIND, PLOT_ARTIFACT, TABLE_ARTIFACT


def find_optimize_run(client, ref: str):
    """The optimize run `ref` names: its run id, or the newest optimize run of experiment `ref`; else None."""
    from mlflow.exceptions import MlflowException

    if re.fullmatch(r"[0-9a-f]{32}", ref):
        try:
            run = client.get_run(ref)
            return run if run.data.tags.get("kind") == KIND else None
        except MlflowException:  # no such run
            return None
    exp = client.get_experiment_by_name(ref)
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id], f"tags.kind = '{KIND}'", order_by=["attributes.start_time DESC"],
                              max_results=1)
    return runs[0] if runs else None


def render(client, run, out_dir: Optional[Path] = None) -> list[str]:
    """Lines to print: the run's table (or front), stop reason, final hash, and where the plot was saved."""
    from mlflow.exceptions import MlflowException

    t = run.data.tags
    lines = [f"optimize run {run.info.run_id} ({t.get('optimize.strategy', '?')}, objective "
             f"{t.get('optimize.objective', '?')}; status {run.info.status})"]
    with tempfile.TemporaryDirectory() as tmp:
        for art in (TABLE_ARTIFACT, FRONT_ARTIFACT):
            try:
                lines.append(Path(client.download_artifacts(run.info.run_id, art, tmp)).read_text().rstrip())
            except (MlflowException, OSError):  # a chain run has no front, a search run no table
                continue
        if out_dir is not None:
            try:
                src = Path(client.download_artifacts(run.info.run_id, PLOT_ARTIFACT, tmp))
                out_dir.mkdir(parents=True, exist_ok=True)
                dst = out_dir / "optimize-path.png"
                dst.write_bytes(src.read_bytes())
                lines.append(f"plot: {dst}")
            except (MlflowException, OSError):  # no plot (a search, or no ratio to draw)
                pass
    if t.get("optimize.stop"):
        lines.append(f"stopped: {t['optimize.stop']}; {t.get('optimize.trials', '?')} trial(s) run, "
                     f"{t.get('optimize.reused', '?')} reused")
    if t.get("final_config_hash"):
        lines.append(f"final config_hash {t['final_config_hash'][:12]}  (infersweep reproduce {t['final_config_hash'][:12]})")
    return lines
