"""The walkthrough notebook runs top to bottom, and is committed without stale outputs."""

from pathlib import Path

import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "walkthrough.ipynb"
# The training cell's 250 steps are for a reader's curves (~50 s on two cores), and the KV cache's timing
# curve has six context lengths; the test runs every cell the same, with fewer steps (the run still
# validates twice and checkpoints at its end) and the shortest and longest lengths.
QUICKER = {"max_steps=250": "max_steps=30", "checkpoint_interval=250": "checkpoint_interval=30",
           "eval_interval=50": "eval_interval=15",
           "contexts = [16, 64, 128, 256, 384, 511]": "contexts = [16, 511]"}


def test_notebook_is_committed_without_outputs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    stale = [i for i, cell in enumerate(notebook.cells)
             if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)]
    assert not stale, f"cells {stale} carry outputs: clear them (jupyter nbconvert --clear-output --inplace)"


@pytest.mark.slow
def test_notebook_runs_clean(tmp_path):
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    for old, new in QUICKER.items():
        cells = [cell for cell in notebook.cells if old in cell.source]
        assert len(cells) == 1, f"no cell of the notebook says {old!r} (once): update QUICKER"
        cells[0].source = cells[0].source.replace(old, new)
    client = NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    try:
        client.execute()
    except CellExecutionError as error:
        pytest.fail(f"the notebook failed:\n{error}")
    errors = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
              if output.output_type == "error"]
    assert not errors
    images = sum("image/png" in output.get("data", {}) for cell in notebook.cells if cell.cell_type == "code"
                 for output in cell.outputs)
    assert images >= 6  # every figure was drawn
