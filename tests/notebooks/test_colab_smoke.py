"""The Colab smoke notebook runs headless, top to bottom, on CPU (slow tier: several minutes)."""
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "colab_smoke.ipynb"


@pytest.mark.slow
def test_colab_smoke_notebook_executes(monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # the kernel gets one CPU device, like Colab
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=1800, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    text = "".join(o.get("text", "") for o in outputs)
    assert "system_avg_at_k" in text and "reward/solver" in text
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the curves were drawn
