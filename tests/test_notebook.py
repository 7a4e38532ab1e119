"""notebooks/quickstart.ipynb runs end to end on the venv's kernel, and its loss falls.

The notebook is stored without outputs; this test executes it with nbclient (kernel
``python3``: jupyter_client starts it with this interpreter, ``sys.executable``), then
checks every cell ran, the plan's picture and the loss plot were displayed, and the run
trained. A probe cell appended to the in-memory copy reports the kernel's interpreter and
the history the notebook's ``run`` returned; the file on disk is not changed.
"""

import json
import os
import sys

import pytest

from tests.common import ROOT

NOTEBOOK = os.path.join(ROOT, "notebooks", "quickstart.ipynb")
PROBE = """import json, sys
print("PROBE " + json.dumps({"python": sys.executable, "history": history}))"""


def _read():
    nbformat = pytest.importorskip("nbformat")
    return nbformat, nbformat.read(NOTEBOOK, as_version=4)


def test_notebook_is_stored_without_outputs():
    _, nb = _read()
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code
    for cell in code:
        assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]


@pytest.mark.slow
def test_notebook_runs_and_the_loss_falls():
    nbformat, nb = _read()
    nbclient = pytest.importorskip("nbclient")
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    client = nbclient.NotebookClient(
        nb,
        timeout=900,
        kernel_name="python3",
        resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}},
    )
    client.execute()  # raises CellExecutionError on the first failing cell

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 2, "expected the plan drawing and the loss plot"
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "plan on topology cpu8-two-islands" in text  # the trainer's own plan block
    assert "step time: predicted" in text

    probe = [line for line in nb.cells[-1].outputs[0].text.splitlines() if line.startswith("PROBE")]
    got = json.loads(probe[0].removeprefix("PROBE "))
    assert got["python"] == sys.executable  # the venv's interpreter, not one on PATH
    history = got["history"]
    assert history[0]["step"] == 1 and history[-1]["step"] >= 20
    assert history[-1]["loss"] < history[0]["loss"] - 1.0
    assert history[-1]["eval_loss"] < history[0]["loss"] - 1.0
