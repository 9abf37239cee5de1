"""Test-local contracted optimizers and models for gefen-hybrid's tests.

* ``SignMomentum``: a small Muon-like child for 2-D matrices (``buf = m * buf + g``,
  ``p -= lr * sign(buf)``) with a contract, ``StagedNativeLoad`` and ``StepPreflight`` (it
  refuses non-2-D and non-finite gradients before mutating). Elementwise, so it trains
  DTensor shards exactly like the full tensor.
* ``UnstagedSGD``: ``torch.optim.SGD`` with a contract but without staged load, to show
  how the composite reports a non-atomic native load.

Importable by spawned gloo ranks (module-level names only).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import pytest
import torch
from gefen_contracts import (
    FEATURE_CANONICAL_IDENTITY,
    FEATURE_CANONICAL_LOCAL_STATE,
    FEATURE_COLLECTIVE_SCOPE,
    FEATURE_COMPOSITE,
    FEATURE_PARAMETER_SHAPED_STATE,
    FEATURE_PORTABLE_STATE,
    FEATURE_POST_SHARDING,
    FEATURE_STAGED_NATIVE_LOAD,
    CheckpointSupport,
    FeatureStatus,
    OptimizerCapabilities,
    OptimizerContract,
    OptimizerStateLayout,
    StateField,
    StateGeometry,
    StateRole,
    StateScope,
    StateValidationError,
    StateVariant,
    TrainingSupport,
)
from gefen_contracts.enums import (
    CheckpointTransport,
    LoadAtomicity,
    ParameterLayout,
    Precision,
    ProcessGroupScope,
    StateExtent,
)
from gefen_contracts.transactions import StagedTransaction
from torch import nn


@pytest.fixture(autouse=True, scope="module")
def single_threaded_torch() -> Iterator[None]:
    """Tiny tensors run far faster on one intra-op thread on a shared 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


_CONTRIBUTED_WHY = (
    "executed by the checks gefen-portable and gefen-dcp contribute (tests/test_adamw_composite_conformance.py runs the "
    "kit with them); gefen-hybrid's own tests run only the kit's built-in checks"
)
_SHAPED = ("replicated", "dtensor_1d_default_world")
_PORTABLE = ("replicated", "flattened_element_shard")
#: The portable and parameter-shaped claims of ContractedAdamW (and composites of it) that only the
#: contributed checks execute.
CONTRIBUTED_WAIVERS: dict[str, str] = {
    claim: _CONTRIBUTED_WHY
    for claim in (
        "feature:portable_state",
        "feature:parameter_shaped_state",
        "checkpoint:canonical_global:replicated",
        "checkpoint:canonical_global:replicated:atomic",
        "checkpoint:canonical_global:flattened_element_shard",
        "checkpoint:canonical_global:flattened_element_shard:atomic",
        *(f"checkpoint:canonical_global:transition:{a}->{b}:placement_reshard" for a in _PORTABLE for b in _PORTABLE),
        *(f"checkpoint:parameter_shaped:{layout}" for layout in _SHAPED),
        *(f"checkpoint:parameter_shaped:{layout}:atomic" for layout in _SHAPED),
        *(f"checkpoint:parameter_shaped:transition:{a}->{b}:placement_reshard" for a in _SHAPED for b in _SHAPED),
    )
}

_NEGATIVE = {
    FEATURE_POST_SHARDING: FeatureStatus.no("toy optimizer: no identity binding"),
    FEATURE_CANONICAL_IDENTITY: FeatureStatus.no("toy optimizer: no post_sharding"),
    FEATURE_CANONICAL_LOCAL_STATE: FeatureStatus.no("toy optimizer: native state dicts only"),
    FEATURE_PORTABLE_STATE: FeatureStatus.no("toy optimizer: no portable adapter"),
    FEATURE_PARAMETER_SHAPED_STATE: FeatureStatus.no("toy optimizer: its state is not declared parameter-shaped"),
    FEATURE_COLLECTIVE_SCOPE: FeatureStatus.no("toy optimizer: learns nothing collectively"),
    FEATURE_COMPOSITE: FeatureStatus.no("toy optimizer: no children"),
}
_REPLICATED = frozenset({ParameterLayout.REPLICATED})


def _buffer_field() -> StateField:
    return StateField("momentum_buffer", StateScope.PARAMETER, StateRole.AUTHORITATIVE, StateGeometry.PARAMETER)


SIGN_CONTRACT = OptimizerContract(
    implementation="gefen_tests.SignMomentum",
    state_layout=OptimizerStateLayout(
        fields=(
            _buffer_field(),
            StateField("step", StateScope.PARAMETER, StateRole.AUTHORITATIVE, StateGeometry.SCALAR),
        ),
        parameter_variants=(
            StateVariant(
                "sign_momentum",
                ("momentum_buffer", "step"),
                frozenset({ParameterLayout.REPLICATED, ParameterLayout.DTENSOR_1D_DEFAULT_WORLD}),
                StateExtent.LOCAL_STORAGE,
                parameter_ranks=(2,),
            ),
        ),
    ),
    capabilities=OptimizerCapabilities(
        training=(
            TrainingSupport(ParameterLayout.REPLICATED, ProcessGroupScope.NONE),
            TrainingSupport(ParameterLayout.DTENSOR_1D_DEFAULT_WORLD, ProcessGroupScope.NONE),
        ),
        checkpoints=(
            CheckpointSupport(
                CheckpointTransport.NATIVE_OPTIMIZER,
                _REPLICATED,
                ProcessGroupScope.NONE,
                LoadAtomicity.LOCAL_FAIL_BEFORE_MUTATION,
            ),
        ),
        precisions=frozenset({Precision.FLOAT32, Precision.FLOAT64}),
        supported_parameter_ranks=(2,),
        features={FEATURE_STAGED_NATIVE_LOAD: FeatureStatus.yes(), **_NEGATIVE},
    ),
)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    if to_local is None:
        return tensor
    with torch.no_grad():
        return to_local()  # type: ignore[no-any-return]


class SignMomentum(torch.optim.Optimizer):
    """A toy Muon-like optimizer for 2-D parameters that keeps the convention."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-2, momentum: float = 0.9) -> None:
        self._version = 0
        super().__init__(params, {"lr": lr, "momentum": momentum})

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_version", 0)

    def optimizer_contract(self) -> OptimizerContract:
        return SIGN_CONTRACT

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        lr = param_group.get("lr", self.defaults["lr"])
        if type(lr) is not float or not math.isfinite(lr) or lr < 0:
            raise ValueError(f"SignMomentum: lr must be a finite float >= 0, got {lr!r}")
        super().add_param_group(param_group)
        self._version += 1

    def preflight_step(self) -> None:
        for group in self.param_groups:
            for name, parameter in zip(group.get("param_names", ()), group["params"]):
                if parameter.grad is None:
                    continue
                if parameter.dim() != 2:
                    raise ValueError(f"SignMomentum steps 2-D parameters only; {name!r} is {parameter.dim()}-D")
                if not bool(torch.isfinite(_local(parameter.grad)).all()):
                    raise ValueError(f"SignMomentum: the gradient of {name!r} is not finite")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.preflight_step()
        for group in self.param_groups:
            for parameter in group["params"]:
                if parameter.grad is None:
                    continue
                state = self.state[parameter]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(parameter)
                    state["step"] = 0
                buffer = state["momentum_buffer"]
                buffer.mul_(group["momentum"]).add_(parameter.grad)
                state["step"] += 1
                parameter.add_(buffer.sign(), alpha=-group["lr"])
        self._version += 1
        return loss

    def stage_state_dict(self, state_dict: Mapping[str, Any]) -> StagedTransaction:
        if not isinstance(state_dict, Mapping) or set(state_dict) != {"state", "param_groups"}:
            raise StateValidationError("SignMomentum state dict must have exactly 'state' and 'param_groups'")
        groups = state_dict["param_groups"]
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            raise StateValidationError(f"SignMomentum expects {len(self.param_groups)} param groups")
        by_id: dict[int, torch.Tensor] = {}
        new_groups = []
        for index, (saved, live) in enumerate(zip(groups, self.param_groups)):
            if not isinstance(saved, Mapping) or not set(live) <= set(saved):  # a scheduler adds keys
                raise StateValidationError(f"SignMomentum param group {index} keys differ")
            ids = saved["params"]
            if not isinstance(ids, list) or len(ids) != len(live["params"]) or any(type(i) is not int for i in ids):
                raise StateValidationError(f"SignMomentum param group {index} must list int ids")
            for key in ("lr", "momentum"):
                if type(saved[key]) is not float or not math.isfinite(saved[key]) or saved[key] < 0:
                    raise StateValidationError(f"SignMomentum param group {index} option {key!r} is invalid")
            for pid, parameter in zip(ids, live["params"]):
                if pid in by_id:
                    raise StateValidationError(f"SignMomentum parameter id {pid} appears twice")
                by_id[pid] = parameter
            new_groups.append({**saved, "params": live["params"]})  # every saved key (initial_lr too)
        state: dict[torch.Tensor, dict[str, Any]] = {}
        saved_state = state_dict["state"]
        if not isinstance(saved_state, Mapping):
            raise StateValidationError("SignMomentum 'state' must be a mapping")
        for pid, entry in saved_state.items():
            parameter = by_id.get(pid) if type(pid) is int else None
            if parameter is None or not isinstance(entry, Mapping) or set(entry) != {"momentum_buffer", "step"}:
                raise StateValidationError(f"SignMomentum state entry {pid!r} is invalid")
            buffer, step = entry["momentum_buffer"], entry["step"]
            if type(step) is not int or step < 1:
                raise StateValidationError(f"SignMomentum step of {pid} must be an int >= 1")
            if (
                not isinstance(buffer, torch.Tensor)
                or buffer.dtype != parameter.dtype
                or buffer.shape != parameter.shape
            ):
                raise StateValidationError(f"SignMomentum momentum_buffer of {pid} has the wrong dtype or shape")
            if not bool(torch.isfinite(buffer).all()):
                raise StateValidationError(f"SignMomentum momentum_buffer of {pid} is not finite")
            state[parameter] = {"momentum_buffer": buffer.detach().clone(), "step": step}
        return StagedTransaction(self, kind="sign_load", token=self._version, payload=(new_groups, state))

    def commit_staged_state_dict(self, staged: StagedTransaction) -> None:
        payload: Any = staged.claim(self, kind="sign_load", current_token=self._version)
        groups, state = payload
        for live, new in zip(self.param_groups, groups):
            live.update(new)
        fresh: defaultdict[torch.Tensor, Any] = defaultdict(dict)
        fresh.update(state)
        self.state = fresh
        self._version += 1

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        current: Any = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, current)
            if result is not None:
                current = result
        self.commit_staged_state_dict(self.stage_state_dict(current))
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


UNSTAGED_CONTRACT = OptimizerContract(
    implementation="gefen_tests.UnstagedSGD",
    state_layout=OptimizerStateLayout(
        fields=(_buffer_field(),),
        parameter_variants=(
            StateVariant("sgd_momentum", ("momentum_buffer",), _REPLICATED, StateExtent.GLOBAL_PARAMETER),
        ),
    ),
    capabilities=OptimizerCapabilities(
        training=(TrainingSupport(ParameterLayout.REPLICATED, ProcessGroupScope.NONE),),
        checkpoints=(
            CheckpointSupport(
                CheckpointTransport.NATIVE_OPTIMIZER, _REPLICATED, ProcessGroupScope.NONE, LoadAtomicity.NONE
            ),
        ),
        precisions=frozenset(Precision),
        supported_parameter_ranks=None,
        features={
            FEATURE_STAGED_NATIVE_LOAD: FeatureStatus.no("it loads with torch.optim.SGD.load_state_dict"),
            **_NEGATIVE,
        },
    ),
)


class UnstagedSGD(torch.optim.SGD):
    """torch SGD with momentum and a contract, but no staged load."""

    def optimizer_contract(self) -> OptimizerContract:
        return UNSTAGED_CONTRACT


def sign_factory(named: list[tuple[str, torch.Tensor]]) -> SignMomentum:
    return SignMomentum(named, lr=1e-2, momentum=0.9)


def adamw_factory(named: list[tuple[str, torch.Tensor]]) -> torch.optim.Optimizer:
    from gefen_hybrid import ContractedAdamW

    return ContractedAdamW(named, lr=5e-3, weight_decay=0.01)


class TinyLlama(nn.Module):
    """A decoder-only block stack with an LM head tied to the token embedding."""

    def __init__(self, vocab: int = 32, dim: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            block = nn.Module()
            block.input_layernorm = nn.LayerNorm(dim)
            block.q_proj = nn.Linear(dim, dim, bias=False)
            block.k_proj = nn.Linear(dim, dim, bias=False)
            block.o_proj = nn.Linear(dim, dim, bias=False)
            block.up_proj = nn.Linear(dim, 2 * dim, bias=False)
            block.down_proj = nn.Linear(2 * dim, dim, bias=False)
            self.layers.append(block)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(tokens)
        for block in self.layers:
            x = block.input_layernorm(hidden)
            attn = torch.softmax(block.q_proj(x) @ block.k_proj(x).transpose(-1, -2), dim=-1) @ x
            hidden = hidden + block.o_proj(attn)
            hidden = hidden + block.down_proj(torch.relu(block.up_proj(hidden)))
        return self.lm_head(self.norm(hidden))  # type: ignore[no-any-return]


def make_tiny_llama(seed: int = 0) -> TinyLlama:
    torch.manual_seed(seed)
    return TinyLlama()


def llama_loss(model: nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, 32, (2, 6), generator=generator)
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class ScopedSignMomentum(SignMomentum):
    """SignMomentum that declares a collective scope (it learns nothing; the binding is what
    the composite must vote over)."""

    def __init__(self, params: Iterable[Any], binding: object, lr: float = 1e-2) -> None:
        super().__init__(params, lr=lr)
        self._binding = binding

    def optimizer_contract(self) -> OptimizerContract:
        features = {**SIGN_CONTRACT.capabilities.features, FEATURE_COLLECTIVE_SCOPE: FeatureStatus.yes()}
        capabilities = dataclasses.replace(SIGN_CONTRACT.capabilities, features=features)
        return dataclasses.replace(SIGN_CONTRACT, capabilities=capabilities)

    def collective_scope(self) -> object | None:
        return self._binding

    def initialize_collective_state(self) -> bool:
        return True

    def refresh_collective_state(self) -> bool:
        return False

    def collective_budget(self) -> int:
        return 0
