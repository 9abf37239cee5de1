"""Shared fixtures for gefen-core's tests (import the fixture name into a test module to use it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def single_threaded_torch() -> Iterator[None]:
    """Small tensors run far faster on one intra-op thread on a shared 2-core machine (a busy
    second thread stalls every parallel op); results do not depend on it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
