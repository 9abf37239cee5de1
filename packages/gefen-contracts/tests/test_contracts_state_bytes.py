"""Optimizer-state bytes counted as unique storages reachable from the optimizer."""

from __future__ import annotations

import torch
from gefen_contracts.torch_support import count_state_bytes, parameter_count


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 16)).square().mean().backward()
    optimizer.step()


def test_adamw_is_exactly_two_fp32_moments_plus_step_counters() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, optimizer)
    _step(model, optimizer)
    counted = count_state_bytes(optimizer)
    n = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    assert counted.parameters == n == parameter_count(optimizer)
    # exp_avg + exp_avg_sq (fp32) and one 0-dim fp32 step tensor per parameter tensor
    assert counted.total == 8 * n + 4 * tensors
    assert counted.by_kind() == {"exp_avg": 4 * n, "exp_avg_sq": 4 * n, "step": 4 * tensors}


def test_params_and_grads_are_not_counted_and_views_count_once() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, optimizer)
    assert count_state_bytes(optimizer).total == 0  # plain SGD holds nothing but params and grads
    weight = next(model.parameters())
    optimizer.state[weight]["alias_of_param"] = weight.detach()
    optimizer.state[weight]["alias_of_grad"] = weight.grad
    assert count_state_bytes(optimizer).total == 0
    buffer = torch.zeros(100)
    optimizer.state[weight]["a"] = buffer[:10]
    optimizer.state[weight]["b"] = buffer[50:]
    counted = count_state_bytes(optimizer, parameter_names={id(weight): "w"})
    assert counted.total == 400  # the whole storage, once
    assert list(counted.by_path) == ["state[w].a"]


class _Cache:
    __slots__ = ("table",)

    def __init__(self) -> None:
        self.table = torch.zeros(8, dtype=torch.float64)


def test_attributes_caches_and_slots_are_found_but_modules_are_skipped() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.codebook = torch.zeros(256)  # type: ignore[attr-defined]
    optimizer.caches = {"cpu": [_Cache()]}  # type: ignore[attr-defined]
    optimizer.model = torch.nn.BatchNorm1d(1000)  # type: ignore[attr-defined]  # buffers are not optimizer state
    optimizer.param_groups[0]["lr_tensor"] = torch.tensor(0.1)
    counted = count_state_bytes(optimizer)
    assert counted.by_kind() == {"codebook": 1024, "table": 64, "lr_tensor": 4}


def test_wrapper_subclasses_are_opened_through_tensor_flatten() -> None:
    from torch.distributed.tensor import DTensor

    assert hasattr(DTensor, "__tensor_flatten__")
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    class Packed(torch.Tensor):
        @staticmethod
        def __new__(cls, codes: torch.Tensor, scale: torch.Tensor) -> Packed:
            return torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=torch.float32)  # type: ignore[attr-defined,no-any-return]

        def __init__(self, codes: torch.Tensor, scale: torch.Tensor) -> None:
            self.codes = codes
            self.scale = scale
            self.mesh = object()  # not a tensor: as a DTensor names its device mesh

        def __tensor_flatten__(self) -> tuple[list[str], None]:
            return ["codes", "scale", "mesh"], None

        @classmethod
        def __torch_dispatch__(cls, func: object, types: object, args: object = (), kwargs: object = None) -> object:
            raise NotImplementedError(f"Packed does not implement {func}")

    weight = next(model.parameters())
    optimizer.state[weight]["exp_avg"] = Packed(torch.zeros(32, 16, dtype=torch.uint8), torch.zeros(4))
    counted = count_state_bytes(optimizer)
    assert counted.total == 32 * 16 + 16
    assert set(counted.by_path) == {"state[param0].exp_avg.codes", "state[param0].exp_avg.scale"}
