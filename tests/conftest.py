"""Fixtures of the top-level tests: real gloo process groups of 2 and 3 ranks on 127.0.0.1,
one per test module that asks for them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gefen_contracts.testing import GlooWorld


@pytest.fixture(scope="module")
def world2() -> Iterator[GlooWorld]:
    with GlooWorld(2) as world:
        yield world


@pytest.fixture(scope="module")
def world3() -> Iterator[GlooWorld]:
    with GlooWorld(3) as world:
        yield world
