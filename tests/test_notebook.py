"""The notebook runs top to bottom: its code cells, in order, in one namespace (no kernel)."""

import json
import os

import matplotlib

NB = os.path.join(os.path.dirname(__file__), "..", "experiments", "speculation_walkthrough.ipynb")


def test_notebook_runs_top_to_bottom(monkeypatch):
    matplotlib.use("Agg")
    monkeypatch.chdir(os.path.join(os.path.dirname(NB)))
    nb = json.load(open(NB))
    ns = {"__name__": "__main__"}
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert len(cells) >= 4
    for i, cell in enumerate(cells):
        src = "".join(cell["source"])
        exec(compile(src, f"{NB}:cell{i}", "exec"), ns)
    assert ns["out_spec"].token_ids == ns["out_stock"].token_ids
    assert ns["diff"].max() < 1e-3
