"""Native checkpoints: bit-exact resume, weights-only loading, atomic staged loads, golden vectors."""

from __future__ import annotations

import copy
import io
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from gefen_contracts import StaleTransactionError, StateValidationError
from gefen_contracts.testing import deep_snapshot, snapshot_diff
from gefen_contracts.testing.checks.checkpoint import assert_trees_equal
from gefen_core import Gefen, GefenMuon
from gefen_core_test_support import MIRROR, edit_mirror, edit_mirrors, mirror_of, single_threaded_torch  # noqa: F401  (autouse fixture)

GOLDEN = Path(__file__).parent / "golden" / "native_state_v10.pt"


class _Net(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.randn(16, 24, dtype=dtype))
        self.proj = torch.nn.Linear(24, 32, dtype=dtype)
        self.norm = torch.nn.LayerNorm(32, dtype=dtype)
        self.head = torch.nn.Linear(32, 8, bias=False, dtype=dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed[tokens].mean(dim=1)
        return self.head(self.norm(torch.tanh(self.proj(hidden))))


def _net(dtype: torch.dtype = torch.float32) -> _Net:
    torch.manual_seed(0)
    return _Net(dtype)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, start: int, steps: int) -> None:
    for index in range(start, start + steps):
        generator = torch.Generator().manual_seed(index)
        tokens = torch.randint(0, 16, (8, 5), generator=generator)
        target = torch.randn(8, 8, generator=generator)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(tokens).float(), target)
        loss.backward()
        opt.step()


def _roundtrip(value: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "block": {"factored_v_2d": False},
    "weight_decay": {"weight_decay": 0.1},
    "stochastic_round": {"stochastic_round": True},
    "maximize_deterministic": {"maximize": True, "deterministic": True},
    "capturable": {"capturable": True},
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_resume_is_bit_exact(name: str) -> None:
    options = {"lr": 1e-2, "fused": False, **CONFIGS[name]}
    straight = _net()
    opt = Gefen(straight.named_parameters(), **options)
    _train(straight, opt, 0, 6)
    halves = _net()
    first = Gefen(halves.named_parameters(), **options)
    _train(halves, first, 0, 3)
    saved = _roundtrip(first.state_dict())
    resumed = Gefen(halves.named_parameters(), **options)
    resumed.load_state_dict(saved)
    _train(halves, resumed, 3, 3)
    for (pname, a), (_, b) in zip(straight.named_parameters(), halves.named_parameters()):
        assert torch.equal(a, b), pname
    assert_trees_equal(opt.state_dict(), resumed.state_dict())


def test_bf16_resume_is_bit_exact() -> None:
    straight, halves = _net(torch.bfloat16), _net(torch.bfloat16)
    opt = Gefen(straight.parameters(), lr=1e-2)
    _train(straight, opt, 0, 4)
    first = Gefen(halves.parameters(), lr=1e-2)
    _train(halves, first, 0, 2)
    resumed = Gefen(halves.parameters(), lr=1e-2)
    resumed.load_state_dict(_roundtrip(first.state_dict()))
    _train(halves, resumed, 2, 2)
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), halves.parameters()))
    assert resumed.state[halves.embed]["m_magnitude"].dtype is torch.float32


def test_capturable_toggle_is_portable_both_ways() -> None:
    for source, target in ((True, False), (False, True)):
        straight, halves = _net(), _net()
        opt = Gefen(straight.parameters(), lr=1e-2, capturable=source)
        _train(straight, opt, 0, 4)
        first = Gefen(halves.parameters(), lr=1e-2, capturable=source)
        _train(halves, first, 0, 2)
        resumed = Gefen(halves.parameters(), lr=1e-2, capturable=target)
        resumed.load_state_dict(_roundtrip(first.state_dict()))
        counter = resumed.state[halves.embed]["step"]
        assert isinstance(counter, torch.Tensor) == target
        _train(halves, resumed, 2, 2)
        assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), halves.parameters()))


def test_load_leaves_the_callers_dict_alone_and_can_repeat() -> None:
    model = _net()
    opt = Gefen(model.parameters(), lr=1e-2)
    _train(model, opt, 0, 2)
    saved = _roundtrip(opt.state_dict())
    reference = _roundtrip(saved)
    twin = Gefen(_net().parameters(), lr=1e-2)
    twin.load_state_dict(saved)
    twin.load_state_dict(saved)
    assert_trees_equal(saved, reference)
    live = twin.state[next(iter(twin.state))]["m_codes"]
    assert live.data_ptr() != saved["state"][0]["m_codes"].data_ptr()


@pytest.mark.parametrize("kind", ["tiled", "ragged", "muon"])
def test_a_load_of_its_own_views_keeps_the_live_tensors(kind: str) -> None:
    """A state dict whose tensors are this optimizer's own live state (its ``state_dict()``, or
    torch's recipe's template after ``dcp.load`` wrote into it) loads without copying them:
    the live tensors stay, padding of ragged codes included, and training goes on bit for bit.
    A copy of them (equal values, other storage) is copied in, as a foreign state is."""
    ragged = kind == "ragged"
    shape = (4099,) if ragged else (16, 24)  # a prime length: ragged blocks of 2048, the last of 3
    params = [torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(0))) for _ in range(2)]
    opts: list[torch.optim.Optimizer] = [
        GefenMuon([p], lr=1e-2)
        if kind == "muon"
        else Gefen([p], lr=1e-2, factored_v_2d=False, force_1d_period_one=False)
        for p in params
    ]

    def step(index: int) -> None:
        for param, opt in zip(params, opts):
            opt.zero_grad()
            (param * torch.randn(shape, generator=torch.Generator().manual_seed(index))).square().sum().backward()
            opt.step()

    step(0)
    step(1)
    (live,) = opts[0].state.values()
    before = {key: value for key, value in live.items() if isinstance(value, torch.Tensor)}
    opts[0].load_state_dict(opts[0].state_dict())
    (after,) = opts[0].state.values()
    assert all(after[key] is tensor for key, tensor in before.items()), "a load of its own views copied them"
    assert not ragged or after["m_codes"].numel() > params[0].numel()  # the padded live codes were kept
    copies = copy.deepcopy(opts[1].state_dict())
    opts[1].load_state_dict(copies)
    (loaded,) = opts[1].state.values()
    assert all(loaded[key].data_ptr() != copies["state"][0][key].data_ptr() for key in before)
    assert all(torch.equal(loaded[key], tensor) for key, tensor in before.items())
    step(2)
    assert torch.equal(params[0], params[1])


@pytest.mark.parametrize("kind", ["gefen", "muon"])
def test_a_loaded_group_shares_no_mutable_option_with_the_saved_one(kind: str) -> None:
    """torch's load deep-copies the saved groups; so does this one: a caller editing its state
    dict (or the optimizer it came from) after the load does not edit the loaded groups."""
    build: Callable[[], torch.optim.Optimizer] = (
        (lambda: Gefen(_net().parameters(), lr=1e-2))
        if kind == "gefen"
        else (lambda: GefenMuon([p for p in _net().parameters() if p.dim() == 2], lr=1e-2))
    )
    source = build()
    source.param_groups[0]["warmup"] = {"steps": 10}
    source.param_groups[0]["lr"] = torch.tensor(0.01)
    saved = source.state_dict()
    target = build()
    target.load_state_dict(saved)
    saved["param_groups"][0]["warmup"]["steps"] = 99
    source.param_groups[0]["lr"].fill_(0.5)
    assert target.param_groups[0]["warmup"] == {"steps": 10}
    assert float(target.param_groups[0]["lr"]) == pytest.approx(0.01)


def test_torch_dcp_state_dict_helpers_round_trip() -> None:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    straight, halves = _net(), _net()
    opt = Gefen(straight.parameters(), lr=1e-2)
    _train(straight, opt, 0, 4)
    first = Gefen(halves.parameters(), lr=1e-2)
    _train(halves, first, 0, 2)
    exported = _roundtrip(get_optimizer_state_dict(halves, first))
    assert set(exported) == {"state", "param_groups"}  # torch keeps only these; our mirror carries the rest
    fresh_model = _net()
    fresh_model.load_state_dict(halves.state_dict())
    resumed = Gefen(fresh_model.parameters(), lr=1e-2)
    set_optimizer_state_dict(fresh_model, resumed, exported)
    _train(fresh_model, resumed, 2, 2)
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), fresh_model.parameters()))
    assert resumed.global_step == 4


def test_a_stale_or_foreign_staged_load_is_refused() -> None:
    model = _net()
    opt = Gefen(model.parameters(), lr=1e-2)
    _train(model, opt, 0, 1)
    staged = opt.stage_state_dict(opt.state_dict())
    other = Gefen(_net().parameters(), lr=1e-2)
    with pytest.raises(StaleTransactionError):
        other.commit_staged_state_dict(staged)
    _train(model, opt, 1, 1)
    with pytest.raises(StaleTransactionError):
        opt.commit_staged_state_dict(staged)


def _first_state(sd: dict[str, Any]) -> dict[str, Any]:
    return next(s for s in sd["state"].values() if "vmean" in s)


def _factored_state(sd: dict[str, Any]) -> dict[str, Any]:
    return next(s for s in sd["state"].values() if "v_row" in s)


def _element_state(sd: dict[str, Any]) -> dict[str, Any]:
    return next(s for s in sd["state"].values() if "v" in s)


def _set(path: Callable[[dict[str, Any]], dict[str, Any]], key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(sd: dict[str, Any]) -> None:
        path(sd)[key] = value

    return apply


def _mutate_tensor(key: str, change: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict[str, Any]], None]:
    def apply(sd: dict[str, Any]) -> None:
        entry = _first_state(sd)
        entry[key] = change(entry[key].clone())

    return apply


def _mirror_step(sd: dict[str, Any]) -> None:
    group = sd["param_groups"][0]
    edit_mirror(group, global_step=mirror_of(group)["global_step"] + 1)


def _edit_mirror_text(change: Callable[[str], str]) -> Callable[[dict[str, Any]], None]:
    def apply(sd: dict[str, Any]) -> None:
        group = sd["param_groups"][0]
        text = change(group[MIRROR])
        assert text != group[MIRROR]
        group[MIRROR] = text

    return apply


def _mirror_codebook_entry(value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(sd: dict[str, Any]) -> None:
        codebook = mirror_of(sd["param_groups"][0])["codebook"]
        edit_mirror(sd["param_groups"][0], codebook=[value, *codebook[1:]])

    return apply


def _mirror_as_dict(version: int) -> Callable[[dict[str, Any]], None]:
    """A mirror as format version 9 held it (a dict), tagged ``version``."""

    def apply(sd: dict[str, Any]) -> None:
        for group in sd["param_groups"]:
            record = {**mirror_of(group), "format_version": version}
            group[MIRROR] = {**record, "codebook": torch.tensor(record["codebook"])}

    return apply


def _drop_mirror_of_one_group(sd: dict[str, Any]) -> None:
    del sd["param_groups"][1]["_gefen_checkpoint_metadata"]


def _codebook(change: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict[str, Any]], None]:
    def apply(sd: dict[str, Any]) -> None:
        new = change(sd["gefen_codebook"].clone())
        sd["gefen_codebook"] = new
        edit_mirrors(sd, codebook=new)

    return apply


def _no_codebook(sd: dict[str, Any]) -> None:
    sd["gefen_codebook"] = None


def _factored_on_vector(sd: dict[str, Any]) -> None:
    entry = sd["state"][2]  # proj.bias, a vector
    entry.pop("vmean")
    entry["factored_step"] = entry.pop("vmean_step")
    entry["v_row"] = torch.zeros(32)
    entry["v_col"] = torch.zeros(1)


def _record(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """Set a record field at the top level (``gefen_<field>``) and in every group's mirror."""

    def apply(sd: dict[str, Any]) -> None:
        sd[f"gefen_{field}"] = value
        edit_mirrors(sd, **{field: value})

    return apply


def _topology(sd: dict[str, Any]) -> None:
    record = [None] * 6
    sd["gefen_topology"] = record
    edit_mirrors(sd, topology=record)


BAD: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "undeclared_key": (_set(_first_state, "exp_avg", torch.zeros(3)), "undeclared key 'exp_avg'"),
    "missing_field": (lambda sd: _first_state(sd).pop("m_magnitude"), "missing authoritative fields"),
    "bool_counter": (_set(_first_state, "step", True), "must be an int"),
    "float_counter": (_set(_first_state, "step", 2.0), "must be an int"),
    "negative_counter": (_set(_first_state, "vmean_step", -1), ">= 1"),
    "age_exceeds_step": (_set(_first_state, "vmean_step", 3), "exceeds step"),
    "step_exceeds_global": (lambda sd: _first_state(sd).update(step=9, vmean_step=9), "exceeds the global step"),
    "scales_of_no_period": (_set(_first_state, "m_magnitude", torch.zeros(7)), "no block period of a parameter"),
    "stored_period": (_set(_first_state, "automatic_period", 4), "undeclared key 'automatic_period'"),
    "float_indices": (_mutate_tensor("m_codes", lambda t: t.float()), "torch.uint8"),
    # the parameter is named where the optimizer names it
    "negative_magnitude": (
        _mutate_tensor("m_magnitude", lambda t: t - 10.0),
        r"state\[2\] \('proj\.bias', param_groups\[0\] position 2\)\['m_magnitude'\] must be >= 0",
    ),
    "nan_vmean": (_mutate_tensor("vmean", lambda t: t.fill_(float("nan"))), "finite"),
    "missing_v_col": (lambda sd: _factored_state(sd).pop("v_col"), "missing authoritative fields"),
    "missing_v": (lambda sd: _element_state(sd).pop("v"), "missing authoritative fields"),
    "element_v_shape": (lambda sd: _element_state(sd).__setitem__("v", _element_state(sd)["v"][:1]), "shape"),
    "element_v_negative": (
        lambda sd: _element_state(sd).__setitem__("v", -_element_state(sd)["v"] - 1),
        "must be >= 0",
    ),
    "factored_vector": (_factored_on_vector, "factored second moment but the parameter is 1-D"),
    "short_codebook": (_codebook(lambda c: c[:255]), "float32 tensor of 256 entries"),
    "unsorted_codebook": (_codebook(lambda c: c.flip(0)), "sorted"),
    "unpinned_codebook": (_codebook(lambda c: c * 0.5), "exactly -1"),
    "missing_codebook": (_no_codebook, "float32 tensor of 256 entries"),
    "unlearned_codebook_not_zeros": (
        _record("codebook_learned", False),
        "codebook_learned is False but the codebook is not all zeros",
    ),
    "learned_not_bool": (_record("codebook_learned", 1), "codebook_learned must be a bool"),
    "deterministic_mismatch": (_record("deterministic", True), "deterministic=True"),
    "deterministic_not_bool": (_record("deterministic", 1), "must be a bool"),
    "mirrors_disagree": (_mirror_step, "disagree on global_step"),
    "mirror_not_json": (_set(lambda sd: sd["param_groups"][0], MIRROR, "{"), "is not valid JSON"),
    "mirror_repeats_a_key": (_edit_mirror_text(lambda t: t.replace("{", '{"deterministic":false,', 1)), "twice"),
    "mirror_nan": (_edit_mirror_text(lambda t: t.replace('"global_step":2', '"global_step":NaN')), "finite"),
    "mirror_codebook_not_float32": (_mirror_codebook_entry(0.1), "float32 values"),
    "mirror_codebook_ints": (_mirror_codebook_entry(0), "list of 256 floats"),
    "mirror_as_dict": (_mirror_as_dict(10), "must be the JSON string"),
    "mirror_of_version_9": (_mirror_as_dict(9), r"version 9; Gefen reads 'gefen.native_state' version 10"),
    "mirror_on_some_groups": (_drop_mirror_of_one_group, "only some parameter groups"),
    "topology_mismatch": (_topology, "topology"),
    "unknown_top_level_key": (_set(lambda sd: sd, "exp_avg", 1), "unknown top-level keys"),
    "no_metadata": (
        lambda sd: (
            [sd.pop(k) for k in list(sd) if k.startswith("gefen_")]
            + [g.pop("_gefen_checkpoint_metadata") for g in sd["param_groups"]]
        ),
        "no Gefen metadata",
    ),
    "renamed_parameter": (
        lambda sd: sd["param_groups"][0]["param_names"].__setitem__(0, "other"),
        "param_names differ",
    ),
    "bad_hyperparameter": (_set(lambda sd: sd["param_groups"][1], "eps", 0.0), "epsilon"),
    "unknown_id": (lambda sd: sd["state"].__setitem__(99, _first_state(sd)), "names no parameter"),
}


@pytest.fixture(scope="module")
def trained() -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
    model = _net()
    groups = [
        {"params": [("embed", model.embed), ("proj.weight", model.proj.weight), ("proj.bias", model.proj.bias)]},
        {"params": [(n, p) for n, p in model.named_parameters() if n.startswith(("norm", "head"))]},
    ]
    opt = Gefen(groups, lr=1e-2, min_dim_size_to_factor=24)  # element, factored and block entries
    _train(model, opt, 0, 2)
    return _roundtrip(opt.state_dict()), groups


@pytest.mark.parametrize("name", sorted(BAD))
def test_corrupted_checkpoints_are_refused_without_mutation(
    name: str, trained: tuple[dict[str, Any], list[dict[str, Any]]]
) -> None:
    valid, _ = trained
    model = _net()
    groups = [
        {"params": [("embed", model.embed), ("proj.weight", model.proj.weight), ("proj.bias", model.proj.bias)]},
        {"params": [(n, p) for n, p in model.named_parameters() if n.startswith(("norm", "head"))]},
    ]
    opt = Gefen(groups, lr=1e-2, min_dim_size_to_factor=24)
    _train(model, opt, 0, 1)
    post_calls: list[int] = []
    opt.register_load_state_dict_post_hook(lambda *_: post_calls.append(1))
    corrupted = copy.deepcopy(valid)
    apply, message = BAD[name]
    apply(corrupted)
    before = deep_snapshot(opt, model)
    with pytest.raises(StateValidationError, match=message):
        opt.load_state_dict(corrupted)
    assert not snapshot_diff(before, opt, model) and not post_calls
    opt.load_state_dict(valid)
    assert post_calls == [1]


def test_a_checkpoint_of_the_other_second_moment_kind_migrates_on_the_next_step() -> None:
    model = _net()
    opt = Gefen(model.parameters(), lr=1e-2, factored_v_2d=True, min_dim_size_to_factor=0)
    _train(model, opt, 0, 3)
    block = Gefen(model.parameters(), lr=1e-2, factored_v_2d=False)
    saved = _roundtrip(opt.state_dict())
    for group in saved["param_groups"]:
        group["factored_v_2d"] = False
    block.load_state_dict(saved)
    assert "v_row" in block.state[model.embed]
    _train(model, block, 3, 2)
    state = block.state[model.embed]
    assert state["step"] == 5 and state["vmean_step"] == 2 and "v_row" not in state
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_narrow_matrix_switches_between_element_and_factored_v_with_min_dim_size_to_factor() -> None:
    """``embed`` is 16 x 24: per-element ``v`` under the default, factored with the bound at 16;
    a checkpoint of one kind loads into the other and re-warms the new kind from age 0."""
    model = _net()
    opt = Gefen(model.parameters(), lr=1e-2)
    _train(model, opt, 0, 3)
    assert opt.state[model.embed]["v"].shape == model.embed.shape and "v_row" not in opt.state[model.embed]
    factored = Gefen(model.parameters(), lr=1e-2, min_dim_size_to_factor=16)
    saved = _roundtrip(opt.state_dict())
    for group in saved["param_groups"]:
        group["min_dim_size_to_factor"] = 16
    factored.load_state_dict(saved)
    _train(model, factored, 3, 2)
    state = factored.state[model.embed]
    assert state["step"] == 5 and state["factored_step"] == 2 and "v" not in state
    assert "v" in factored.state[model.head.weight]  # 8 x 32 stays narrow
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _exact(shape: tuple[int, ...], salt: int) -> torch.Tensor:
    """Values k / 1024 for integers |k| <= 1024: the same bits on every CPU (no BLAS, no
    transcendental function), unlike a model's forward and backward."""
    count = math.prod(shape)
    k = (torch.arange(count, dtype=torch.int64) * 7919 + salt * 104729) % 2049 - 1024
    return (k.to(torch.float32) / 1024).reshape(shape)


def _golden_scenario() -> dict[str, Any]:
    """Two Gefen steps on ``_Net``'s parameter shapes with exact values and gradients: the golden
    vector must not depend on the CPU's matrix library (an AMD host's BLAS rounds a model's
    gradients differently from an Intel host's, which once broke this test)."""
    shapes = [(name, tuple(p.shape)) for name, p in _net().named_parameters()]
    named = [(name, torch.nn.Parameter(_exact(shape, i))) for i, (name, shape) in enumerate(shapes)]
    opt = Gefen(named, lr=1e-2, weight_decay=0.05, min_dim_size_to_factor=24)  # all three variants
    for step in range(2):
        for i, (_, parameter) in enumerate(named):
            parameter.grad = _exact(tuple(parameter.shape), 100 * (step + 1) + i)
        opt.step()
    return opt.state_dict()


def test_golden_native_state_dict() -> None:
    """The committed vector pins the format (keys, types, dtypes, shapes) and its values.

    Regenerate deliberately with ``GEFEN_REGEN_GOLDEN=1`` when the format version changes.
    """
    produced = _roundtrip(_golden_scenario())
    if os.environ.get("GEFEN_REGEN_GOLDEN") == "1":
        torch.save(produced, GOLDEN)
    golden = torch.load(GOLDEN, weights_only=True)
    assert golden["gefen_format_version"] == 10
    assert mirror_of(golden["param_groups"][0])["format"] == "gefen.native_state"
    assert_trees_equal(produced, golden, "golden native state dict")
    model = _net()
    resumed = Gefen(model.named_parameters(), lr=1e-2, weight_decay=0.05, min_dim_size_to_factor=24)
    resumed.load_state_dict(golden)
    assert resumed.global_step == 2


def test_a_state_dict_kept_while_stepping_is_refused_naming_the_views_and_a_copy_loads() -> None:
    """``state_dict()`` returns views of the live state, as torch's does, with a digest of the
    moment: kept in memory while the optimizer steps on, it no longer matches, and the refusal
    says so; a ``copy.deepcopy`` is a snapshot that loads."""
    model = _net()
    opt = Gefen(model.named_parameters(), lr=1e-2)
    _train(model, opt, 0, 2)
    kept, snapshot = opt.state_dict(), copy.deepcopy(opt.state_dict())
    _train(model, opt, 2, 1)
    with pytest.raises(StateValidationError, match=r"views of the live state, so copy\.deepcopy it"):
        opt.load_state_dict(kept)
    opt.load_state_dict(snapshot)
    assert opt.global_step == 2


@pytest.mark.parametrize("kind", ["gefen", "muon"])
def test_a_state_dict_of_transposed_views_loads_contiguous_and_steps_fused(kind: str) -> None:
    """tensor.to(copy=True) kept a saved tensor's strides: fused=True then refused it mid-step,
    after the counters had moved."""
    from gefen_core import GefenMuon

    build = (
        (lambda p, fused: Gefen([p], fused=fused))
        if kind == "gefen"
        else (lambda p, fused: GefenMuon([p], fused=fused))
    )
    torch.manual_seed(0)
    source = torch.nn.Parameter(torch.randn(64, 64))
    optimizer = build(source, False)
    source.grad = torch.randn(64, 64)
    optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict())
    for entry in saved["state"].values():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() == 2 and min(value.shape) > 1:
                entry[key] = value.t().contiguous().t()  # same values, column-major strides
    results = []
    for fused in (False, None):
        param = torch.nn.Parameter(source.detach().clone())
        target = build(param, fused)
        target.load_state_dict(copy.deepcopy(saved))
        assert all(t.is_contiguous() for t in target.state[param].values() if isinstance(t, torch.Tensor))
        param.grad = torch.ones(64, 64)
        target.step()
        results.append(param.detach().clone())
    assert torch.equal(results[0], results[1])


def test_a_topology_mismatch_names_where_the_records_differ() -> None:
    """Said only "differs" for a GefenMuon approx-mode checkpoint that torch's DCP recipe had
    saved with one rank's record (its coordinate), the topology otherwise the same."""
    from gefen_core.native_records import check_common_record

    live = [{"mesh_size": 2, "coordinate": 0, "placement": "shard0", "global_shape": [6, 8], "local_shape": [3, 8]}]
    saved = [dict(live[0], coordinate=1)]
    record = {"global_step": 3, "deterministic": False, "topology": saved, "codebook_learned": False}
    with pytest.raises(StateValidationError, match=r"at \[0\]\['coordinate'\] \(saved 1, live 0\)"):
        check_common_record(record, deterministic=False, topology=live, optimizer="GefenMuon")
