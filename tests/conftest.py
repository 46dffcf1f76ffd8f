import os

import pytest
import torch

# Keep runs repeatable and CPU-friendly.
torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_store(tmp_path, monkeypatch):
    """Each test gets its own decision store and Inductor cache dir: no state leaks between tests."""
    monkeypatch.setenv("INDUCTOR_ATTN_CACHE_DIR", str(tmp_path / "inductor_attn"))
    yield
