"""The tiny offline model for tests: built once per session into the session's temp folder, never downloaded."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.model.tiny_model import ensure_tiny_model

    # ensure_tiny_model is idempotent, so a second registration of this fixture costs nothing.
    return ensure_tiny_model(seed=0, cache_dir=tmp_path_factory.getbasetemp() / "asyncgrpo-cache")


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """The tiny model's matrices are too small to gain from threads; on a busy 2-core machine they lose."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
