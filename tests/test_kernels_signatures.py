"""gefen-kernels restates gefen-core's op ids and scalar layout (it may not import gefen-core): they must agree."""

from __future__ import annotations

from gefen_contracts import KernelProvider
from gefen_core import ops, step_scalars
from gefen_kernels import provider, signatures


def test_op_ids_agree_with_gefen_core() -> None:
    assert set(ops.OPS) == set(signatures.GEFEN_OPS)
    assert provider().op_ids() == frozenset(ops.OPS)
    assert isinstance(provider(), KernelProvider)


def test_scalar_layouts_agree_with_gefen_core() -> None:
    for name, index in signatures.SCALAR_INDEX.items():
        assert getattr(step_scalars, name) == index, name
    assert step_scalars.NUM_SCALARS == signatures.NUM_SCALARS
    for name, index in signatures.MUON_SCALAR_INDEX.items():
        assert getattr(step_scalars, name) == index, name
    assert step_scalars.MUON_NUM_SCALARS == signatures.MUON_NUM_SCALARS


def test_every_dispatched_op_is_implemented() -> None:
    assert set(ops.DISPATCHED_OPS) <= provider().op_ids()
