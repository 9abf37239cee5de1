"""Options and parameters refused before anything changes (issue 19): a parameter listed
twice (within a group, across groups, through ``add_param_group``), a tensor ``lr`` on a
device the step cannot read it from (at construction and when set later), and, in the
hybrid's preflight, a backup gradient of the wrong dtype or a resized backup parameter:
every optimizer and child is left exactly as it was."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from gefen import Gefen, GefenMuon, GefenMuonHybrid, GefenOptionError
from gefen_contracts import StateValidationError
from gefen_contracts.testing import deep_snapshot, snapshot_diff
from gefen_hybrid import ContractedAdamW
from torch import nn

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

Factory = Callable[..., torch.optim.Optimizer]
FACTORIES: dict[str, Factory] = {
    "gefen": lambda params, **kw: Gefen(params, fused=False, **kw),
    "gefen_muon": lambda params, **kw: GefenMuon(params, fused=False, **kw),
    "contracted_adamw": ContractedAdamW,
}


def _matrix(seed: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_a_parameter_listed_twice_is_refused(name: str) -> None:
    factory = FACTORIES[name]
    a, b = _matrix(0), _matrix(1)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[2\] is the same parameter as .*\[0\]"):
        factory([a, b, a], lr=1e-2)
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\] is the same parameter as .*\[1\]"):
        factory([{"params": [a, b]}, {"params": [b]}], lr=1e-2)
    optimizer = factory([a], lr=1e-2)
    before = deep_snapshot(optimizer)
    with pytest.raises(ValueError, match="same parameter"):
        optimizer.add_param_group({"params": [b, a]})
    assert snapshot_diff(before, optimizer) == []
    assert len(optimizer.param_groups) == 1


@pytest.mark.parametrize("name", ["gefen", "gefen_muon"])
def test_a_tensor_lr_on_another_device_is_refused_before_any_state(name: str) -> None:
    factory = FACTORIES[name]
    param = _matrix(0)
    with pytest.raises(ValueError, match="a tensor lr on meta cannot drive a parameter on cpu"):
        factory([param], lr=torch.tensor(1e-2, device="meta"))
    optimizer = factory([param], lr=1e-2)
    param.grad = torch.randn_like(param)
    optimizer.param_groups[0]["lr"] = torch.tensor(1e-2, device="meta")
    before = deep_snapshot(optimizer, param)
    with pytest.raises(ValueError, match="a tensor lr on meta"):
        optimizer.step()
    assert snapshot_diff(before, optimizer, param) == [] and not optimizer.state
    optimizer.param_groups[0]["lr"] = torch.tensor(1e-2)  # on the CPU: accepted
    optimizer.step()
    assert optimizer.state


def _hybrid(backup: str) -> tuple[nn.Module, GefenMuonHybrid]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    optimizer = GefenMuonHybrid(model.named_parameters(), lr=1e-2, backup_optimizer=backup, fused=False)
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    model(torch.randn(3, 8)).sum().backward()
    return model, optimizer


def _wrong_dtype(model: nn.Module) -> None:
    bias: Any = model[1].bias
    bias.grad_dtype = None  # torch 2.15 refuses a mismatched gradient dtype unless told otherwise
    bias.grad = bias.grad.double()


def _resized(model: nn.Module) -> None:
    weight: Any = model[1].weight
    weight.data = torch.randn(9)
    weight.grad = torch.randn(9)


@pytest.mark.parametrize("backup", ["adamw", "gefen"])
@pytest.mark.parametrize("fault", [_wrong_dtype, _resized], ids=["float64_gradient", "resized_parameter"])
def test_the_hybrid_preflight_refuses_a_faulty_backup_before_any_child_steps(
    backup: str, fault: Callable[[nn.Module], None]
) -> None:
    model, optimizer = _hybrid(backup)
    fault(model)
    before = deep_snapshot(optimizer, model)
    with pytest.raises((RuntimeError, ValueError, TypeError)):
        optimizer.step()
    assert snapshot_diff(before, optimizer, model) == []


@pytest.mark.parametrize("backup", ["adamw", "gefen"])
def test_a_bad_backup_option_is_refused_before_any_child_steps_and_placed_in_the_composite(backup: str) -> None:
    """A ``None`` weight decay in the AdamW backup's group reached torch's arithmetic only after
    the Muon child had stepped (its global step advanced, the backup's counters too). The
    preflight refuses it first; the error, naming the child's group index, carries a note
    mapping it to the composite's."""
    model, optimizer = _hybrid(backup)
    last = len(optimizer.param_groups) - 1
    optimizer.param_groups[last]["weight_decay"] = None
    before = deep_snapshot(optimizer, model)
    with pytest.raises(TypeError, match="weight_decay") as raised:
        optimizer.step()
    assert snapshot_diff(before, optimizer, model) == []
    assert any(f"this composite's param_groups[{last}..{last}]" in note for note in raised.value.__notes__)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"betas": (0.9, 1.5)}, r"\['betas'\]\[1\] must be in \[0, 1\), got 1.5"),
        ({"betas": (1.0, 0.999)}, r"\['betas'\]\[0\] must be in \[0, 1\), got 1.0"),
        ({"lr": -1e-3}, r"\['lr'\] must be >= 0"),
        ({"amsgrad": True}, "amsgrad was turned on after a parameter's first step"),
    ],
    ids=["beta2-above-one", "beta1-one", "negative-lr", "amsgrad-late"],
)
def test_a_backup_option_torch_checks_only_when_built_is_refused_before_any_child_steps(
    edit: dict[str, object], message: str
) -> None:
    """torch's AdamW checks ranges in its constructor only: a group edited (or added) later with
    beta >= 1 divided by zero or went NaN in its arithmetic, and amsgrad turned on mid-run raised
    a ``KeyError``, each after the Muon child had stepped."""
    model, optimizer = _hybrid("adamw")
    optimizer.param_groups[-1].update(edit)
    before = deep_snapshot(optimizer, model)
    with pytest.raises((ValueError, RuntimeError), match=message):
        optimizer.step()
    assert snapshot_diff(before, optimizer, model) == []


@pytest.mark.parametrize("name", ["gefen", "gefen-muon", "contracted-adamw"])
def test_names_a_load_could_not_check_are_refused_when_the_group_is_added(name: str) -> None:
    """Names that are not str, or one name on two parameters, were accepted at construction and
    made every checkpoint unloadable (refused even by the optimizer that wrote it) or, repeated,
    let a load give one parameter's state to another."""
    from gefen_hybrid import ContractedAdamW

    cls = {"gefen": Gefen, "gefen-muon": GefenMuon, "contracted-adamw": ContractedAdamW}[name]
    a, b = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
    with pytest.raises(TypeError, match=r"\['params'\]\[0\] is named by int 1; parameter names must be str"):
        cls([(1, a), (2, b)], lr=1e-2)  # type: ignore[list-item]
    optimizer = cls([("a", a)], lr=1e-2)
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\] is named 'a', as param_groups\[0\]"):
        optimizer.add_param_group({"params": [("a", b)]})
    with pytest.raises(ValueError, match="has 1 parameters but param_names 2"):
        optimizer.add_param_group({"params": [b], "param_names": ["b", "c"]})
    assert len(optimizer.param_groups) == 1


@pytest.mark.parametrize(
    ("name", "option"),
    [
        ("gefen", "stochastic_round"),
        ("gefen", "codebook_refresh_every"),
        ("gefen-muon", "stochastic_round"),
        ("gefen-muon", "capturable"),
    ],
)
def test_an_option_of_the_whole_optimizer_set_in_a_group_is_refused(name: str, option: str) -> None:
    """It was kept in the group, written into checkpoints, and silently not applied."""
    cls = {"gefen": Gefen, "gefen-muon": GefenMuon}[name]
    a, b = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
    value = 2 if option == "codebook_refresh_every" else True
    with pytest.raises(GefenOptionError, match=rf"param_groups\[1\]: {option}={value} is an option of the whole"):
        cls([{"params": [a]}, {"params": [b], option: value}], lr=1e-2)
    cls([{"params": [a]}, {"params": [b], option: 0 if value == 2 else False}], lr=1e-2)  # its own value: accepted


@pytest.mark.parametrize(
    ("name", "option"),
    [("gefen", "stochastic_round"), ("gefen", "codebook_refresh_every"), ("gefen-muon", "deterministic")],
)
def test_an_option_of_the_whole_optimizer_edited_into_a_live_group_is_refused_at_the_step(
    name: str, option: str
) -> None:
    """The group check at ``add_param_group`` missed an edit of the live group, which the step
    then carried into checkpoints and silently did not apply."""
    cls = {"gefen": Gefen, "gefen-muon": GefenMuon}[name]
    a = nn.Parameter(torch.randn(4, 4))
    optimizer = cls([a], lr=1e-2)
    a.grad = torch.randn_like(a)
    optimizer.step()
    value = 2 if option == "codebook_refresh_every" else True
    optimizer.param_groups[0][option] = value
    before = deep_snapshot(optimizer, a)
    with pytest.raises(GefenOptionError, match=rf"param_groups\[0\]: {option}={value} is an option of the whole"):
        optimizer.step()
    assert snapshot_diff(before, optimizer, a) == []
    optimizer.param_groups[0][option] = 0 if value == 2 else False  # the optimizer's own value: accepted
    optimizer.step()


@pytest.mark.parametrize("name", ["gefen", "gefen-muon"])
def test_a_tensor_appended_to_a_named_group_is_refused_naming_add_param_group(name: str) -> None:
    """A tensor appended to a named group's ``params`` by hand has no name; the step indexed the
    names past their end (a bare ``IndexError``)."""
    cls = {"gefen": Gefen, "gefen-muon": GefenMuon}[name]
    first, second = nn.Parameter(torch.randn(8, 16)), nn.Parameter(torch.randn(8, 16))
    optimizer = cls([("first", first)], lr=1e-2)
    first.grad = torch.randn_like(first)
    optimizer.step()
    optimizer.param_groups[0]["params"].append(second)
    first.grad, second.grad = torch.randn_like(first), torch.randn_like(second)
    before = deep_snapshot(optimizer, first, second)
    with pytest.raises(ValueError, match="2 parameters but 1 param_names; add parameters with add_param_group"):
        optimizer.step()
    assert snapshot_diff(before, optimizer, first, second) == []


@pytest.mark.parametrize("name", ["gefen", "gefen-muon"])
def test_fused_true_on_a_meta_model_constructs_and_its_first_step_names_the_meta_device(name: str) -> None:
    """``fused=True`` asks the dispatcher whether the parameters' device has a kernel; for the
    meta device it asked for the key "META", which the dispatcher cannot parse (a bare
    ``RuntimeError`` at construction; torch's fused AdamW constructs there). It constructs, and
    the first step refuses the meta parameters as documented."""
    cls = {"gefen": Gefen, "gefen-muon": GefenMuon}[name]
    with torch.device("meta"):
        model = nn.Linear(16, 8)
    optimizer = cls([model.weight], lr=1e-2, fused=True)
    model.weight.grad = torch.zeros_like(model.weight)
    with pytest.raises(ValueError, match="meta"):
        optimizer.step()


def test_distinct_parameters_sharing_memory_are_refused_by_gefen() -> None:
    """A transposed tie (``Parameter(w.data.t())`` beside ``w``): Gefen stepped the strided one
    through a copy written back after the bucket's op, over ``w``'s update, so one update was
    lost (torch applies both). Such parameters are refused at the next step, before anything
    changes, naming both; disjoint column halves of one buffer, and a fake-tensor model, are not
    this."""
    weight = nn.Parameter(torch.randn(16, 12))
    transposed = nn.Parameter(weight.data.t())
    optimizer = Gefen([weight, transposed], lr=1e-2)
    weight.grad, transposed.grad = torch.randn_like(weight), torch.randn_like(transposed)
    before = deep_snapshot(optimizer, weight)
    with pytest.raises(ValueError, match=r"\['params'\]\[0\] and .*\['params'\]\[1\].*tie weights by sharing one"):
        optimizer.step()
    assert snapshot_diff(before, optimizer, weight) == []
    single = Gefen([weight], lr=1e-2)
    single.add_param_group({"params": [nn.Parameter(weight.data[:4])]})
    with pytest.raises(ValueError, match="must not share memory"):
        single.step()
    buffer = torch.randn(8, 16)
    left, right = nn.Parameter(buffer[:, :8]), nn.Parameter(buffer[:, 8:])
    halves = Gefen([left, right], lr=1e-2)
    left.grad, right.grad = torch.randn_like(left), torch.randn_like(right)
    halves.step()  # disjoint elements of one buffer: both update, as with torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        Gefen(fake.parameters(), lr=1e-2).preflight_step()  # fake tensors have no addresses to compare


def test_memory_shared_or_expanded_after_a_step_is_refused_before_anything_changes() -> None:
    """After a step, ``b.data = a.data.t()`` ties two parameters (the check once ran only at
    the first step after the groups changed, and one update was lost: ``b``'s copy, written
    back after the op, overwrote ``a``'s), and an ``expand()``-ed ``.data`` makes a parameter's
    elements share memory (torch refused the in-place write only after the other parameters
    and both states had changed). Both are refused by ``preflight_step`` and ``step`` with
    nothing changed, and once mended the step runs."""
    a, b = nn.Parameter(torch.randn(20, 30)), nn.Parameter(torch.randn(30, 20))
    optimizer = Gefen([a, b], lr=1e-2)
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    optimizer.step()
    for swap, refusal in (
        (a.data.t, r"\['params'\]\[0\] and .*\['params'\]\[1\].*must not share memory"),
        (lambda: torch.randn(1, 20).expand(30, 20), r"\['params'\]\[1\]: the parameter's elements share memory"),
    ):
        b.data = swap()
        a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
        before = deep_snapshot(optimizer, a, b)
        for attempt in (optimizer.preflight_step, optimizer.step):
            with pytest.raises(ValueError, match=refusal):
                attempt()
            assert snapshot_diff(before, optimizer, a, b) == []
        b.data = b.data.clone()
        optimizer.step()
    assert optimizer.global_step == 3
    muon = GefenMuon([a, b], lr=1e-2, fused=False)  # (its plan makes the same check)
    b.data = torch.randn(1, 20).expand(30, 20)
    before = deep_snapshot(muon, a, b)
    with pytest.raises(ValueError, match=r"\['params'\]\[1\] .*: the parameter's elements share memory"):
        muon.step()
    assert snapshot_diff(before, muon, a, b) == []


def test_state_put_into_optimizer_state_without_its_codebook_is_refused() -> None:
    """torch's ZeroRedundancyOptimizer consolidates ``state`` and its own groups and loads them
    by writing ``optimizer.state`` directly: the codes arrive without their codebook, and the
    step learned a new one, misreading them (the resumed run drifted, no error). A checkpoint's
    parameter-shaped codes written there were blamed on a resized parameter."""
    torch.manual_seed(0)
    matrix, vector = nn.Parameter(torch.randn(16, 32)), nn.Parameter(torch.randn(64))
    source = Gefen([matrix, vector], lr=1e-2)
    for _ in range(2):
        matrix.grad, vector.grad = torch.randn_like(matrix), torch.randn_like(vector)
        source.step()
    fresh = Gefen([matrix, vector], lr=1e-2)
    fresh.state[matrix] = {key: value.clone() if isinstance(value, torch.Tensor) else value
                           for key, value in source.state[matrix].items()}  # fmt: skip
    before = deep_snapshot(fresh, matrix, vector)
    with pytest.raises(StateValidationError, match="quantised momentum but no codebook"):
        fresh.step()
    assert snapshot_diff(before, fresh, matrix, vector) == []
    checkpoint_layout = source.state_dict()["state"][1]  # the vector's codes, shaped like it
    fresh.state.clear()
    fresh.state[vector] = dict(checkpoint_layout)
    with pytest.raises(ValueError, match=r"m_codes have shape \(64,\), not \[blocks, period\]"):
        fresh.step()


def test_muon_state_put_into_optimizer_state_without_its_codebook_is_refused() -> None:
    """GefenMuon learned a new codebook over codes loaded the ZeroRedundancyOptimizer way (around
    its load_state_dict) and resumed 3e-4 away from the saved run, silently; it now refuses
    before anything changes, as Gefen does."""
    torch.manual_seed(0)
    matrix = nn.Parameter(torch.randn(16, 32))
    source = GefenMuon([matrix], lr=1e-2)
    for _ in range(2):
        matrix.grad = torch.randn_like(matrix)
        source.step()
    fresh = GefenMuon([matrix], lr=1e-2)
    fresh.state[matrix] = {key: value.clone() if isinstance(value, torch.Tensor) else value
                           for key, value in source.state[matrix].items()}  # fmt: skip
    before = deep_snapshot(fresh, matrix)
    with pytest.raises(StateValidationError, match="quantised momentum but no codebook"):
        fresh.step()
    assert snapshot_diff(before, fresh, matrix) == []
    assert fresh.codebook is None


def test_period_one_substrings_follows_whether_a_group_is_named() -> None:
    """A group named by torch's ``param_names`` key (not by pairs) was refused the option at
    construction though its step honours it; set on a live unnamed group, where it can never
    act, the step took it and every later checkpoint was refused."""
    a, b = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
    named = Gefen([{"params": [a], "param_names": ["enc.weight"], "period_one_substrings": ("enc",)}], lr=1e-2)
    assert named.param_groups[0]["period_one_substrings"] == ("enc",)
    unnamed = Gefen([b], lr=1e-2)
    unnamed.param_groups[0]["period_one_substrings"] = ("enc",)
    b.grad = torch.randn_like(b)
    before = deep_snapshot(unnamed, b)
    with pytest.raises(GefenOptionError, match="period_one_substrings needs named parameters, and this group's are"):
        unnamed.step()
    assert snapshot_diff(before, unnamed, b) == []
