"""examples/quickstart.ipynb runs headless, top to bottom, on the embedded default."""

from pathlib import Path

import nbformat
from nbclient import NotebookClient


def test_quickstart_notebook_executes():
    path = Path(__file__).resolve().parents[1] / "examples" / "quickstart.ipynb"
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "speedup" in outputs and "tau" in outputs
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1  # the acceptance plot
