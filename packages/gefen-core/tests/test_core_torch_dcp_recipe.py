"""What torch's documented optimizer-checkpoint recipe needs of Gefen and GefenMuon.

torch's template step (zero gradients, ``lr=0``) must make state for every parameter and
learn no codebook; an older native format is refused. The round trip itself, for every
optimizer the project ships, is ``tests/test_torch_dcp_recipe.py``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gefen_contracts import StateValidationError
from gefen_contracts.testing.model import kit_loss, make_kit_model
from gefen_core import Gefen, GefenMuon
from gefen_core.param_state import period_of
from gefen_core_test_support import single_threaded_torch  # noqa: F401  (autouse fixture)
from torch import nn

Factory = Callable[[nn.Module], torch.optim.Optimizer]


def _gefen(model: nn.Module) -> torch.optim.Optimizer:
    return Gefen(model.named_parameters(), lr=1e-2, weight_decay=0.1, fused=False)


def _muon(model: nn.Module) -> torch.optim.Optimizer:
    return GefenMuon([(n, p) for n, p in model.named_parameters() if p.ndim == 2], lr=1e-2, fused=False)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    optimizer.zero_grad(set_to_none=True)
    kit_loss(model, step).backward()
    optimizer.step()


@pytest.mark.parametrize("factory", [_gefen, _muon], ids=["gefen", "gefen_muon"])
def test_a_zero_gradient_step_makes_state_but_learns_no_codebook(factory: Factory) -> None:
    model = make_kit_model(0)
    optimizer = factory(model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    sd = optimizer.state_dict()
    assert len(sd["state"]) == sum(len(g["params"]) for g in sd["param_groups"])
    assert sd["gefen_codebook_learned"] is False
    assert sd["gefen_codebook"].shape == (256,)
    _step(model, optimizer, 3)
    assert optimizer.state_dict()["gefen_codebook_learned"] is True


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
@pytest.mark.parametrize("factory", [_gefen, _muon], ids=["gefen", "gefen_muon"])
def test_a_template_made_with_gradients_allocated_is_refused_naming_the_fix(
    tmp_path: Path, factory: Factory, flatten: bool
) -> None:
    """torch's ``_init_optim_state`` skips its zero-gradient step when any parameter already has a
    gradient, so ``get_optimizer_state_dict`` returns a template without state and ``dcp.load``
    fills only the groups: loading that would silently drop every state (torch AdamW's load
    accepts it). The refusal names the cause and the fix, not a flipped bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    model = make_kit_model(0)
    optimizer = factory(model)
    for step in range(2):
        _step(model, optimizer, step)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"optim": get_optimizer_state_dict(model, optimizer, options=options)}, checkpoint_id=tmp_path)
        twin_model = make_kit_model(0)
        twin = factory(twin_model)
        for param in twin_model.parameters():
            param.grad = torch.zeros_like(param)  # a trainer that keeps its gradients allocated
        template = get_optimizer_state_dict(twin_model, twin, options=options)
        assert not template.get("state") and not [key for key in template if key.startswith("state.")]
        dcp.load({"optim": template}, checkpoint_id=tmp_path)
    with pytest.raises(StateValidationError, match=r"zero_grad\(set_to_none=True\) before get_optimizer_state_dict"):
        set_optimizer_state_dict(twin_model, twin, template, options=options)
    assert not any(twin.state.values())  # (torch's flattened path leaves empty entries behind)


def test_a_refusal_after_dcp_load_wrote_the_live_state_says_so(tmp_path: Path) -> None:
    """The template's tensors are views of the live state, so ``dcp.load`` writes the checkpoint
    into the optimizer before ``set_optimizer_state_dict`` can refuse it: the refusal says the
    optimizer may hold part of it. A refused copy (no live tensor in it) changed nothing and
    does not say so."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = make_kit_model(0)
    optimizer = _gefen(model)
    for step in range(2):
        _step(model, optimizer, step)
    copied = copy.deepcopy(optimizer.state_dict())
    next(iter(copied["state"].values()))["m_codes"].view(-1)[0] ^= 1  # a flipped bit
    with pytest.raises(StateValidationError) as refused:
        optimizer.load_state_dict(copied)
    assert "state_digest" in str(refused.value) and "part of the refused checkpoint" not in str(refused.value)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=tmp_path)
        template = get_optimizer_state_dict(model, optimizer)
        dcp.load({"optim": template}, checkpoint_id=tmp_path)
    next(iter(template["state"].values()))["m_codes"].view(-1)[0] ^= 1  # as a flipped bit on disk would
    with pytest.raises(StateValidationError, match=r"may hold part of the refused checkpoint"):
        set_optimizer_state_dict(model, optimizer, template)


def test_a_template_built_without_normuon_names_the_option_it_lacks(tmp_path: Path) -> None:
    """normuon=True adds state entries, and torch's template is built from the loading optimizer,
    so ``dcp.load`` leaves them out without an error: the refusal names the option, not a corruption."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    def muon(model: nn.Module, normuon: bool) -> torch.optim.Optimizer:
        return GefenMuon([(n, p) for n, p in model.named_parameters() if p.ndim == 2], lr=1e-2, normuon=normuon)

    model = make_kit_model(0)
    optimizer = muon(model, True)
    _step(model, optimizer, 0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=tmp_path)
        twin_model = make_kit_model(0)
        twin = muon(twin_model, False)
        template = get_optimizer_state_dict(twin_model, twin)
        dcp.load({"optim": template}, checkpoint_id=tmp_path)
    with pytest.raises(StateValidationError, match=r"saved with normuon=True \(here False\).*checkpoint's options"):
        set_optimizer_state_dict(twin_model, twin, template)


def test_an_older_native_format_is_refused_naming_both_versions() -> None:
    model = make_kit_model(0)
    optimizer = _gefen(model)
    _step(model, optimizer, 4)
    sd = optimizer.state_dict()
    sd["gefen_format_version"] = 3  # version 3 held the EMA of g, not of the preconditioned gradient
    with pytest.raises(StateValidationError, match=r"version 3.*reads version 10"):
        optimizer.load_state_dict(sd)


def test_state_tensors_are_shaped_like_their_parameter_and_blocked_ones_are_refused() -> None:
    model = make_kit_model(0)
    optimizer = _gefen(model)
    _step(model, optimizer, 2)
    sd = optimizer.state_dict()
    for pid, param in enumerate(model.parameters()):
        entry = sd["state"][pid]
        assert entry["m_codes"].shape == param.shape
        period = period_of(optimizer.state[param])
        if param.dim() == 2:
            assert entry["m_magnitude"].shape == (param.shape[0], param.shape[1] // period)
        else:
            assert entry["m_magnitude"].shape == (param.numel() // period,)
    params = list(model.parameters())
    pid = next(i for i, p in enumerate(params) if p.dim() == 1 and period_of(optimizer.state[p]) > 1)
    entry = sd["state"][pid]
    entry["m_codes"] = entry["m_codes"].reshape(-1, period_of(optimizer.state[params[pid]]))  # v2's blocks
    before = optimizer.state_dict()["state"][pid]["m_codes"].clone()
    with pytest.raises(StateValidationError, match=rf"state\[{pid}\] .*\['m_codes'\] must have shape"):
        optimizer.load_state_dict(sd)
    assert torch.equal(optimizer.state_dict()["state"][pid]["m_codes"], before)
