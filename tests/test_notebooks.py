"""Every tutorial notebook follows the house conventions (fast) and runs top to bottom with its
small default parameters (slow)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from queue import Empty

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_conventions(path):
    """Outputs stripped, one code cell tagged `parameters` (before any other code), specflash imported."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.get("outputs") for c in code), "commit notebooks without outputs"
    tagged = [i for i, c in enumerate(code) if "parameters" in c.metadata.get("tags", [])]
    assert tagged == [0], "the first code cell, and only it, is the parameters cell (tag it `parameters`)"
    assert any("import specflash" in c.source or "from specflash" in c.source for c in code)


class SlicedPollClient(NotebookClient):
    """NotebookClient whose waits for the kernel's messages poll in slices of at most a second.

    Why: with nbclient 0.11, jupyter_client 8 and pyzmq 27, now and then a message that has
    arrived wakes no waiting poll (the asyncio poller missed its socket's edge), and the client
    sees it only when that poll times out and looks once more. nbclient waits for a cell's reply
    with one poll as long as the cell timeout, so notebook 05's widget cell, done in under 45 s,
    stalled for the whole 180 s in three CI runs of four (600 s with a timeout of 600). A poll
    that ends every second looks again every second."""

    async def async_start_new_kernel_client(self):
        kc = await super().async_start_new_kernel_client()
        for channel in (kc.shell_channel, kc.iopub_channel):
            channel.get_msg = _sliced(channel.get_msg)
        return kc


def _sliced(get_msg, most: float = 1.0):
    async def get(timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = most if deadline is None else min(most, max(0.0, deadline - time.monotonic()))
            try:
                return await get_msg(timeout=left)
            except Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    return get


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit notebooks without outputs"
    # 180 s leaves every cell four times its time here.
    SlicedPollClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
