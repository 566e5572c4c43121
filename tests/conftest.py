import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def selected_calls(request):
    """[(test name, params)] of this module's tests that will run (after -k / -m
    deselection), so that a module's precompile fixture compiles only their kernels (a
    subset of a GPU module then fits one device call)."""
    return [(item.originalname, dict(item.callspec.params) if hasattr(item, "callspec") else {})
            for item in request.session.items if item.module is request.module]
