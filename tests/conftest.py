import multiprocessing
import os

import torch

# Without a GPU, Triton kernels run in Triton's interpreter. It is read when kernels are decorated, so it
# must be set before any kernel module is imported; never set it on a GPU machine.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Keep runs repeatable and CPU-friendly.
torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# A bug in a backend raises in tests instead of being dropped as a failed candidate.
os.environ["INDUCTOR_ATTN_STRICT"] = "1"
# The rewrite's tests run on the CPU, where it routes nothing unless asked (routing/rewrite.py).
os.environ["INDUCTOR_ATTN_ROUTE_DEVICES"] = "cuda,cpu"


@pytest.fixture(autouse=True)
def _isolated_store(tmp_path, monkeypatch):
    """Each test gets its own decision store, no remembered decisions and no shipped tables (a test that
    reads tables names its own): no state leaks between tests, and the package's tables decide nothing."""
    from inductor_attn.tuning.decisions import forget_decisions

    monkeypatch.setenv("INDUCTOR_ATTN_CACHE_DIR", str(tmp_path / "inductor_attn"))
    monkeypatch.setenv("INDUCTOR_ATTN_PRIORS", "off")
    forget_decisions()
    yield
    forget_decisions()


@pytest.fixture
def fresh_compile():
    """Compile afresh: routing_report counts rewrites, and an FX-graph or AOTAutograd cache hit would
    replay without rewriting. Used by the rewrite and model tests."""
    import torch._functorch.config
    import torch._inductor.config

    import inductor_attn

    torch._dynamo.reset()
    inductor_attn.reset_routing_report()
    inductor_attn.reset_stats()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()


@pytest.fixture
def process_context():
    """How tests start processes (ranks, concurrent writers): forked by one server process (forkserver) that
    imported the package, torch.distributed and Inductor once, instead of each process importing them
    again (spawn: seconds each on two cores). The server is not this process, so no child inherits a lock
    held by a torch.compile thread of an earlier test (fork did, and the suite hung). A child has the
    environment the server started with, not the test's: pass what it needs as arguments."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["inductor_attn", "torch.distributed", "torch._inductor.compile_fx"])
    return ctx


@pytest.fixture
def reference_only():
    """Only the reference kernel is a candidate (CPU tests stay exact when run on a GPU machine)."""
    from inductor_attn.backends import REFERENCE, only_backends

    with only_backends(REFERENCE):
        yield
