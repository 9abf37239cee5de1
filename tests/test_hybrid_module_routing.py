"""GefenMuonHybrid's three call forms and its routing on real module trees."""

from __future__ import annotations

import copy
import json
import math
import pickle
import warnings
from collections.abc import Callable

import pytest
import torch
from gefen import Gefen, GefenMuon, GefenMuonHybrid, GefenOptionError, ParameterError
from gefen_hybrid import RoutingWarning
from hybrid_models import SmallCNN, TiedHeadFirst, TinyLlama, seeded, train
from torch import nn

LLAMA_MUON = {
    f"model.layers.{i}.{part}"
    for i in range(2)
    for part in (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    )
}
LLAMA_BACKUP = {"model.embed_tokens.weight", "model.norm.weight"} | {
    f"model.layers.{i}.{norm}.weight" for i in range(2) for norm in ("input_layernorm", "post_attention_layernorm")
}


def _roles(optimizer: GefenMuonHybrid) -> dict[str, set[str]]:
    roles: dict[str, set[str]] = {"muon": set(), "backup": set()}
    for name, role in optimizer.parameter_routing():
        roles[role].add(name)
    return roles


@pytest.mark.parametrize("backup", ["gefen", "adamw"])
def test_a_llama_like_model_routes_matrices_to_muon_and_the_tied_embedding_once_to_the_backup(backup: str) -> None:
    model = seeded(TinyLlama)
    optimizer = GefenMuonHybrid(model, lr=3e-3, backup_optimizer=backup)
    assert _roles(optimizer) == {"muon": LLAMA_MUON, "backup": LLAMA_BACKUP}
    assert isinstance(optimizer.muon, GefenMuon)
    assert type(optimizer.backup).__name__ == ("Gefen" if backup == "gefen" else "ContractedAdamW")
    # The tied head is the embedding's tensor: optimized once, by the backup.
    backup_params = [p for group in optimizer.backup.param_groups for p in group["params"]]
    assert sum(p is model.lm_head.weight for p in backup_params) == 1
    losses = train(model, optimizer, 6)
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]


def test_named_parameters_of_the_llama_route_the_same_way_by_name() -> None:
    model = seeded(TinyLlama)
    optimizer = GefenMuonHybrid(model.named_parameters(), lr=3e-3)
    assert _roles(optimizer) == {"muon": LLAMA_MUON, "backup": LLAMA_BACKUP}


def test_a_tied_head_registered_before_its_embedding_goes_to_the_backup_by_identity() -> None:
    model = TiedHeadFirst()
    routing = dict(GefenMuonHybrid(model, lr=1e-3).parameter_routing())
    assert routing == {"decoder.weight": "backup", "hidden.weight": "muon", "hidden.bias": "backup"}
    # By name only, the same tensor would be taken for a hidden matrix: module types matter.
    assert dict(GefenMuonHybrid(model.named_parameters(), lr=1e-3).parameter_routing())["decoder.weight"] == "muon"


def test_a_cnn_keeps_convolutions_norms_and_the_classifier_in_the_backup() -> None:
    model = seeded(SmallCNN)
    optimizer = GefenMuonHybrid(model, lr=3e-3)
    assert _roles(optimizer) == {
        "muon": {"fc1.weight"},
        "backup": {
            "conv1.weight",
            "conv1.bias",
            "bn1.weight",
            "bn1.bias",
            "conv2.weight",
            "conv2.bias",
            "fc1.bias",
            "classifier.weight",
            "classifier.bias",
        },
    }
    losses = train(model, optimizer, 5)
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]


def test_backup_substrings_and_rules_override_the_defaults() -> None:
    model = seeded(TinyLlama)
    moved = GefenMuonHybrid(model, lr=1e-3, backup_substrings=("embed", "down_proj"))
    assert {name for name, role in moved.parameter_routing() if role == "backup" and "down_proj" in name} == {
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
    }
    from gefen import RoutingRules

    pinned = GefenMuonHybrid(
        model, lr=1e-3, rules=RoutingRules(overrides={"model.layers.0.self_attn.q_proj.weight": "backup"})
    )
    assert dict(pinned.parameter_routing())["model.layers.0.self_attn.q_proj.weight"] == "backup"
    with pytest.raises(TypeError, match="not both"):
        GefenMuonHybrid(model, lr=1e-3, backup_substrings=("x",), rules=RoutingRules())


def test_the_two_list_form_is_used_as_given() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    named = dict(model.named_parameters())
    optimizer = GefenMuonHybrid(
        [("0.weight", named["0.weight"])], [(n, named[n]) for n in ("0.bias", "1.weight")], lr=1e-3
    )
    assert optimizer.parameter_routing() == (("0.bias", "backup"), ("0.weight", "muon"), ("1.weight", "backup"))
    backup_only = GefenMuonHybrid([], list(model.named_parameters()), lr=1e-3)
    assert backup_only.muon is None and isinstance(backup_only.backup, Gefen)
    muon_only = GefenMuonHybrid([("0.weight", named["0.weight"])], [], lr=1e-3)
    assert muon_only.backup is None and repr(muon_only) == (
        "GefenMuonHybrid(muon_params=1, backup_params=0, backup_optimizer='gefen')"
    )
    with pytest.raises(TypeError, match="two explicit lists"):
        GefenMuonHybrid([], list(model.named_parameters()), lr=1e-3, backup_substrings=("norm",))
    with pytest.raises(ValueError, match="stepped twice"):
        GefenMuonHybrid([("0.weight", named["0.weight"])], [("again", named["0.weight"])], lr=1e-3)
    with pytest.raises(ParameterError, match="2D"):
        GefenMuonHybrid([("0.bias", named["0.bias"])], [], lr=1e-3)


def test_unnamed_parameters_are_refused_with_how_to_pass_names() -> None:
    model = nn.Linear(4, 4)
    for params in (list(model.parameters()), model.parameters(), [{"params": list(model.parameters())}]):
        with pytest.raises(TypeError, match=r"GefenMuonHybrid routes parameters by name.*named_parameters\(\)"):
            GefenMuonHybrid(params, lr=1e-3)
    with pytest.raises(TypeError, match="param-group dicts"):
        GefenMuonHybrid([{"params": list(model.named_parameters())}], lr=1e-3)
    with pytest.raises(TypeError, match="backup_params"):
        GefenMuonHybrid(list(model.named_parameters())[:1], [model.bias], lr=1e-3)
    with pytest.raises(TypeError, match="iterable of"):
        GefenMuonHybrid(model.weight, lr=1e-3)


def test_frozen_placeholder_and_empty_parameter_sets_are_refused() -> None:
    model = nn.Linear(4, 4)
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        GefenMuonHybrid(model, lr=1e-3)
    placeholders = [("w", nn.Parameter(torch.empty(0))), ("b", nn.Parameter(torch.empty(0)))]
    with pytest.raises(ValueError, match="zero elements"):
        GefenMuonHybrid(placeholders, lr=1e-3)
    with pytest.raises(ValueError, match="zero elements"):
        GefenMuonHybrid([], placeholders, lr=1e-3)


def test_add_param_group_routes_new_parameters_into_the_right_child_with_its_options() -> None:
    model = seeded(TinyLlama)
    optimizer = GefenMuonHybrid(model, lr=1e-3, ns_schedule="tuned3", normuon=True)
    extra = nn.Linear(16, 16)
    optimizer.add_param_group({"params": [("extra.weight", extra.weight), ("extra.bias", extra.bias)], "lr": 5e-4})
    routing = dict(optimizer.parameter_routing())
    assert routing["extra.weight"] == "muon" and routing["extra.bias"] == "backup"
    new_muon_group = optimizer.muon.param_groups[-1]  # type: ignore[union-attr]
    assert new_muon_group["lr"] == 5e-4 and new_muon_group["ns_schedule"] == "tuned3" and new_muon_group["normuon"]
    # a child's refusal numbers the child's groups: a note names the child (the muon part is removed again)
    more = nn.Linear(16, 16)
    groups = [len(child.param_groups) for child in optimizer.child_optimizers().values()]
    with pytest.raises(GefenOptionError, match=r"param_groups\[2\]: amsgrad=True") as refused:
        optimizer.add_param_group(
            {"params": [("more.weight", more.weight), ("more.bias", more.bias)]},
            role_options={"backup": {"amsgrad": True}},
        )
    assert refused.value.__notes__ == [
        "refused by the composite's 'backup' child, for which this group's backup part would be its param_groups[2]"
    ]
    assert [len(child.param_groups) for child in optimizer.child_optimizers().values()] == groups


def test_gefen_routing_prints_the_hybrids_routing_with_the_deciding_rule(capsys: pytest.CaptureFixture[str]) -> None:
    from gefen.cli.main import main

    assert main(["routing", "hybrid_models:tiny_llama", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    expected = dict(GefenMuonHybrid(seeded(TinyLlama), lr=1e-2).parameter_routing())
    assert {row["name"]: row["role"] for row in rows} == expected
    assert {row["name"] for row in rows if row["role"] == "muon"} == LLAMA_MUON
    reasons = {row["name"]: row["reason"] for row in rows}
    assert reasons["model.embed_tokens.weight"] == "embedding or output-head module"
    assert reasons["model.norm.weight"] == "1-D, not a matrix"
    assert reasons["model.layers.0.mlp.up_proj.weight"] == "hidden 2-D matrix"
    assert main(["routing", "hybrid_models:tiny_llama"]) == 0
    table = capsys.readouterr().out
    assert "model.layers.1.self_attn.q_proj.weight" in table and "muon:" in table and "backup:" in table
    with pytest.raises(SystemExit) as raised:
        main(["routing", "hybrid_models:no_such_function"])
    assert raised.value.code == 2
    assert "cannot load hybrid_models:no_such_function" in capsys.readouterr().err


def _unfrozen_later(optimizer_of: Callable[[nn.Module], GefenMuonHybrid]) -> tuple[nn.Module, GefenMuonHybrid]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    model[0].requires_grad_(False)
    return model, optimizer_of(model)


def _train_step(model: nn.Module, optimizer: GefenMuonHybrid) -> None:
    optimizer.zero_grad()
    model(torch.randn(3, 8)).square().mean().backward()
    optimizer.step()


def test_a_parameter_frozen_at_build_and_unfrozen_later_is_named_once_in_a_warning() -> None:
    """The hybrid leaves out the model's frozen parameters (as documented); torch's optimizers
    keep them, so a gradual-unfreezing fine-tune trained them with AdamW and silently not with
    the hybrid. Its first step with such a gradient now warns, once."""
    model, optimizer = _unfrozen_later(lambda m: GefenMuonHybrid(m, lr=1e-2))
    _train_step(model, optimizer)  # still frozen: nothing to say
    model[0].requires_grad_(True)
    with pytest.warns(RoutingWarning, match=r"2 parameter\(s\) .* frozen when this optimizer was built.*'0.weight'"):
        _train_step(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train_step(model, optimizer)  # said once
        copy.deepcopy(optimizer).step()
        pickle.loads(pickle.dumps(optimizer))


def test_a_frozen_parameter_added_with_add_param_group_is_not_warned_about() -> None:
    model, optimizer = _unfrozen_later(lambda m: GefenMuonHybrid(m, lr=1e-2))
    optimizer.add_param_group({"params": list(model[0].named_parameters(prefix="0"))})
    model[0].requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train_step(model, optimizer)
    assert {name for name, _ in optimizer.parameter_routing()} >= {"0.weight", "0.bias"}


def test_unfreezing_a_role_that_had_no_child_says_to_build_first_and_freeze_after() -> None:
    """With the whole body frozen at construction the hybrid has no Muon child, and adding the
    unfrozen body was refused with no way forward; the refusal now says how to unfreeze in
    stages, and that way (build with every layer trainable, freeze after) trains the body
    once it is unfrozen."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False), nn.Linear(8, 4))
    for layer in model[:2]:
        layer.requires_grad_(False)
    optimizer = GefenMuonHybrid(model, lr=1e-2, backup_substrings=("2.",))
    assert {role for _, role in optimizer.parameter_routing()} == {"backup"}
    for layer in model[:2]:
        layer.requires_grad_(True)
    body = [(f"{i}.weight", model[i].weight) for i in range(2)]
    with warnings.catch_warnings(), pytest.raises(ValueError, match=r"no 'muon' child: .*with every layer trainable"):
        warnings.simplefilter("ignore", RoutingWarning)  # (numbered names: said elsewhere)
        optimizer.add_param_group({"params": body})
    with pytest.warns(RoutingWarning, match="to unfreeze in stages, build the optimizer with every layer trainable"):
        _train_step(model, optimizer)
    staged = GefenMuonHybrid(model, lr=1e-2, backup_substrings=("2.",))  # every layer trainable
    for layer in model[:2]:
        layer.requires_grad_(False)
    frozen = [layer.weight.detach().clone() for layer in model[:2]]
    _train_step(model, staged)
    assert all(torch.equal(layer.weight, before) for layer, before in zip(model[:2], frozen, strict=True))
    for layer in model[:2]:
        layer.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train_step(model, staged)
    assert not any(torch.equal(layer.weight, before) for layer, before in zip(model[:2], frozen, strict=True))


class _BareTable(nn.Module):
    """A learned position table held bare beside the layers, and torch's attention, whose
    ``in_proj_weight`` is bare too (but torch's own module says what it is)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(8, 16))
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.proj = nn.Linear(16, 16)


def test_a_matrix_a_model_module_holds_bare_is_named_when_it_goes_to_muon() -> None:
    """A 2-D position table as a bare ``nn.Parameter`` went to muon without a word when the
    hybrid routed the model (its module type says nothing); the names-only route warned."""
    with pytest.warns(RoutingWarning, match=r"holds them bare.*\[.pos.\]"):
        optimizer = GefenMuonHybrid(_BareTable(), lr=1e-2)
    assert dict(optimizer.parameter_routing())["pos"] == "muon"
    from gefen_hybrid import RoutingRules

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        routed = GefenMuonHybrid(_BareTable(), lr=1e-2, rules=RoutingRules(overrides={"pos": "backup"}))
    assert dict(routed.parameter_routing())["pos"] == "backup"
    # `gefen routing`'s report says so too (it called the table "hidden 2-D matrix", no warning)
    from gefen_hybrid import routing_report

    reasons = {row.name: row.reason for row in routing_report(_BareTable())}
    assert reasons["pos"].startswith("2-D, held bare beside layers") and "overrides" in reasons["pos"]
    assert not routing_report(_BareTable(), RoutingRules(overrides={"pos": "muon"}))[0].reason.startswith("2-D, held")
