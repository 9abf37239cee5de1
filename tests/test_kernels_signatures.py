"""gefen-kernels registers kernels for gefen-core's ops and restates their scalar layout (it
may not import gefen-core): they must agree."""

from __future__ import annotations

import torch
from gefen_contracts.kernels import load_kernel_plugins
from gefen_core import ops, step_scalars
from gefen_kernels import signatures


def test_op_names_agree_with_gefen_core() -> None:
    assert set(ops.OPS) == set(signatures.GEFEN_OPS)
    assert ops.HOST_OPS == signatures.HOST_OPS


def test_scalar_layouts_agree_with_gefen_core() -> None:
    for name, index in signatures.SCALAR_INDEX.items():
        assert getattr(step_scalars, name) == index, name
    assert step_scalars.NUM_SCALARS == signatures.NUM_SCALARS
    for name, index in signatures.MUON_SCALAR_INDEX.items():
        assert getattr(step_scalars, name) == index, name
    assert step_scalars.MUON_NUM_SCALARS == signatures.MUON_NUM_SCALARS


def test_every_op_has_a_cpu_kernel_a_reference_and_a_fake() -> None:
    load_kernel_plugins()
    for op in ops.OPS:
        for key in ("CPU", "CompositeExplicitAutograd"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op, key), (op, key)
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "Meta"), op  # the fake
