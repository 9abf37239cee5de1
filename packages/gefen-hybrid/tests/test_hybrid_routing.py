"""Routing rules on real module trees, overrides, construction forms and add_param_group."""

from __future__ import annotations

import pytest
import torch
from gefen_hybrid import (
    CompositeOptimizer,
    ContractedAdamW,
    RoutingRules,
    route_model,
    route_named_parameters,
    split_by_role,
)
from hybrid_toys import SignMomentum, adamw_factory, make_tiny_llama, sign_factory, single_threaded_torch  # noqa: F401 (autouse fixture)
from torch import nn

FACTORIES = {"muon": sign_factory, "backup": adamw_factory}


def _roles(routing: tuple[tuple[str, str], ...]) -> dict[str, str]:
    return dict(routing)


def test_tiny_llama_routes_hidden_matrices_to_muon_and_the_tied_head_once_to_backup() -> None:
    model = make_tiny_llama()
    roles = _roles(route_model(model).routing())
    hidden = [
        f"layers.{i}.{p}.weight" for i in range(2) for p in ("q_proj", "k_proj", "o_proj", "up_proj", "down_proj")
    ]
    assert {name for name, role in roles.items() if role == "muon"} == set(hidden)
    assert roles["embed_tokens.weight"] == "backup"
    assert "lm_head.weight" not in roles  # tied to the embedding: routed once, under its first name
    assert roles["norm.weight"] == roles["norm.bias"] == roles["layers.0.input_layernorm.weight"] == "backup"


class _HeadFirst(nn.Module):
    """A tied head registered before its embedding, under a name no substring catches."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = nn.Linear(6, 10, bias=False)
        self.shared = nn.Embedding(10, 6)
        self.decoder.weight = self.shared.weight
        self.hidden = nn.Linear(6, 6)


def test_a_tied_head_registered_before_its_embedding_goes_to_backup_by_identity() -> None:
    roles = _roles(route_model(_HeadFirst()).routing())
    assert roles == {"decoder.weight": "backup", "hidden.weight": "muon", "hidden.bias": "backup"}
    # by names and shapes alone the identity is unknown, so the same tensor would go to muon
    named = list(_HeadFirst().named_parameters())
    assert _roles(route_named_parameters(named).routing())["decoder.weight"] == "muon"


class _SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 5)
        self.classifier = nn.Linear(5, 2)


def test_cnn_routes_convolutions_norms_biases_and_classifier_to_backup() -> None:
    roles = _roles(route_model(_SmallCNN()).routing())
    assert roles == {
        "conv.weight": "backup",
        "conv.bias": "backup",
        "bn.weight": "backup",
        "bn.bias": "backup",
        "fc.weight": "muon",
        "fc.bias": "backup",
        "classifier.weight": "backup",
        "classifier.bias": "backup",
    }


def test_named_parameters_route_by_name_substring_case_insensitively() -> None:
    def p(*shape: int) -> nn.Parameter:
        return nn.Parameter(torch.zeros(*shape))

    named = [
        ("transformer.WTE.weight", p(10, 4)),
        ("transformer.wpe.weight", p(8, 4)),
        ("h.0.attn.c_attn.weight", p(4, 12)),
        ("h.0.attn.c_attn.bias", p(12)),
        ("score.weight", p(2, 4)),
        ("model.head.weight", p(3, 4)),  # "head" alone is deliberately not a backup token
    ]
    roles = _roles(route_named_parameters(named).routing())
    assert roles == {
        "transformer.WTE.weight": "backup",
        "transformer.wpe.weight": "backup",
        "h.0.attn.c_attn.weight": "muon",
        "h.0.attn.c_attn.bias": "backup",
        "score.weight": "backup",
        "model.head.weight": "muon",
    }


def test_override_beats_predicate_beats_shape_rules() -> None:
    rules = RoutingRules(
        overrides={"fc.weight": "backup"},
        predicate=lambda name, p: "muon" if p.dim() == 4 else None,
        backup_substrings=("fc_nothing",),
    )
    roles = _roles(route_model(_SmallCNN(), rules).routing())
    assert roles["conv.weight"] == "muon"  # predicate
    assert roles["fc.weight"] == "backup"  # override wins
    assert roles["classifier.weight"] == "muon"  # the substring list was replaced
    assert roles["conv.bias"] == "backup"  # predicate returned None: shape rule


def test_bad_rules_are_refused() -> None:
    with pytest.raises(ValueError, match="overrides"):
        RoutingRules(overrides={"fc.weight": "adam"})
    with pytest.raises(ValueError, match="not trainable parameters here"):
        route_model(_SmallCNN(), RoutingRules(overrides={"missing.weight": "muon"}))
    with pytest.raises(ValueError, match="predicate"):
        route_model(_SmallCNN(), RoutingRules(predicate=lambda name, p: "both"))
    with pytest.raises(TypeError, match="single str"):
        RoutingRules(backup_substrings="embed")  # type: ignore[arg-type]


def test_unnamed_parameters_are_refused_with_how_to_pass_names() -> None:
    model = _SmallCNN()
    with pytest.raises(TypeError, match=r"named_parameters\(\)"):
        route_named_parameters(list(model.parameters()))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"named_parameters\(\)"):
        CompositeOptimizer.from_factories(model.parameters(), FACTORIES)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="param-group dict"):
        route_named_parameters([{"params": list(model.parameters())}])  # type: ignore[list-item]


def test_named_lists_skip_frozen_deduplicate_ties_and_refuse_a_name_on_two_tensors() -> None:
    shared = nn.Parameter(torch.zeros(3, 3))
    frozen = nn.Parameter(torch.zeros(3, 3), requires_grad=False)
    routed = route_named_parameters([("a", shared), ("tied", shared), ("frozen", frozen)])
    assert routed.routing() == (("a", "muon"),)
    with pytest.raises(ValueError, match="two different tensors"):
        route_named_parameters([("a", shared), ("a", nn.Parameter(torch.zeros(2)))])


def test_zero_element_placeholders_are_refused() -> None:
    named = [("w", nn.Parameter(torch.empty(0))), ("b", nn.Parameter(torch.empty(0)))]
    with pytest.raises(ValueError, match="ZeRO-3"):
        route_named_parameters(named)


def test_explicit_split_checks_roles_duplicates_and_takes_no_rules() -> None:
    w, b = nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(2))
    assert split_by_role({"muon": [("w", w)], "backup": [("b", b)]}).routing() == (("b", "backup"), ("w", "muon"))
    with pytest.raises(ValueError, match="stepped twice"):
        split_by_role({"muon": [("w", w)], "backup": [("w2", w)]})
    with pytest.raises(ValueError, match="used under both"):
        split_by_role({"muon": [("w", w)], "backup": [("w", b)]})
    with pytest.raises(ValueError, match="split role"):
        split_by_role({"adam": [("w", w)]})
    with pytest.raises(TypeError, match="explicit split"):
        CompositeOptimizer.from_factories({"muon": [("w", w)]}, FACTORIES, rules=RoutingRules())


def test_from_factories_builds_only_present_roles_and_checks_factories() -> None:
    only_matrices = nn.Sequential(nn.Linear(3, 3, bias=False))
    opt = CompositeOptimizer.from_factories(only_matrices, FACTORIES)
    assert tuple(opt.child_optimizers()) == ("muon",)
    assert opt.optimizer_contract().state_layout.composite_namespaces == ("muon",)
    with pytest.raises(ValueError, match="no factory"):
        CompositeOptimizer.from_factories(_SmallCNN(), {"backup": adamw_factory})
    with pytest.raises(ValueError, match="other parameters"):
        CompositeOptimizer.from_factories(
            _SmallCNN(), {"muon": sign_factory, "backup": lambda named: ContractedAdamW(named[:1])}
        )
    with pytest.raises(ValueError, match="no trainable parameters"):
        CompositeOptimizer.from_factories(nn.Sequential(nn.Linear(2, 2).requires_grad_(False)), FACTORIES)


def test_add_param_group_routes_new_parameters_by_the_same_rules() -> None:
    model = make_tiny_llama()
    opt = CompositeOptimizer.from_factories(model, FACTORIES)
    model.extra_embed = nn.Embedding(5, 8)
    new = [
        ("extra.proj.weight", nn.Parameter(torch.randn(8, 8))),
        ("extra.proj.bias", nn.Parameter(torch.zeros(8))),
        ("extra_embed.weight", model.extra_embed.weight),
    ]
    opt.add_param_group({"params": new}, role_options={"muon": {"lr": 0.5}, "backup": {"lr": 0.25}})
    roles = _roles(opt.parameter_routing())
    assert roles["extra.proj.weight"] == "muon"
    assert roles["extra.proj.bias"] == "backup"
    assert roles["extra_embed.weight"] == "backup"  # an embedding weight of the routed model, by identity
    muon, backup = opt.child_optimizers()["muon"], opt.child_optimizers()["backup"]
    assert muon.param_groups[-1]["lr"] == 0.5 and muon.param_groups[-1]["param_names"] == ["extra.proj.weight"]
    assert backup.param_groups[-1]["lr"] == 0.25
    assert backup.param_groups[-1]["param_names"] == ["extra.proj.bias", "extra_embed.weight"]


def test_add_param_group_keeps_frozen_parameters_so_they_train_once_unfrozen() -> None:
    """torch's ``add_param_group`` keeps a frozen layer; it trains once unfrozen. The composite
    routed only trainable tensors, so a frozen layer added now was silently left out."""
    model = make_tiny_llama()
    opt = CompositeOptimizer.from_factories(model, FACTORIES)
    layer = nn.Linear(8, 8).requires_grad_(False)
    opt.add_param_group({"params": [("extra.weight", layer.weight), ("extra.bias", layer.bias)]})
    roles = _roles(opt.parameter_routing())
    assert roles["extra.weight"] == "muon" and roles["extra.bias"] == "backup"
    layer.requires_grad_(True)
    before = layer.weight.detach().clone()
    layer(torch.randn(4, 8)).square().sum().backward()
    opt.step()
    assert not torch.equal(layer.weight, before)


def test_add_param_group_refuses_before_adding_anything() -> None:
    model = make_tiny_llama()
    opt = CompositeOptimizer.from_factories(model, FACTORIES)
    before = [len(c.param_groups) for c in opt.child_optimizers().values()]
    routing = opt.parameter_routing()
    with pytest.raises(TypeError, match="named_parameters"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2, 2))]})
    with pytest.raises(ValueError, match="already optimized"):
        opt.add_param_group({"params": [("again", model.norm.weight)]})
    with pytest.raises(ValueError, match="already used"):
        opt.add_param_group({"params": [("norm.weight", nn.Parameter(torch.zeros(8)))]})
    fresh = [("fresh.weight", nn.Parameter(torch.randn(8, 8)))]
    # a role's options cannot replace the routed parameters (a tensor in both children)
    with pytest.raises(ValueError, match="cannot set 'params'"):
        opt.add_param_group({"params": fresh}, role_options={"backup": {"params": [model.norm.weight]}})
    with pytest.raises(TypeError, match=r"role_options\['backup'\] must be a mapping"):
        opt.add_param_group({"params": fresh}, role_options={"backup": 3})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="role_options must map"):
        opt.add_param_group({"params": fresh}, role_options=[("backup", {})])  # type: ignore[arg-type]
    only_muon = CompositeOptimizer.from_factories(nn.Sequential(nn.Linear(3, 3, bias=False)), FACTORIES)
    with pytest.raises(ValueError, match="no 'backup' child"):
        only_muon.add_param_group({"params": [("bias", nn.Parameter(torch.zeros(3)))]})
    assert [len(c.param_groups) for c in opt.child_optimizers().values()] == before
    assert opt.parameter_routing() == routing


def test_routing_entry_points_refuse_what_is_not_rules_or_a_model_by_name() -> None:
    from gefen_hybrid import RoutingRules, route_named_parameters, routing_report

    model = make_tiny_llama()
    with pytest.raises(TypeError, match=r"rules must be a gefen_hybrid\.RoutingRules, got dict"):
        CompositeOptimizer.from_factories(model, FACTORIES, rules={})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"rules must be a gefen_hybrid\.RoutingRules, got dict"):
        route_named_parameters(list(model.named_parameters()), rules={})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"routing_report needs an nn\.Module, got NoneType"):
        routing_report(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="embedding_types must be a tuple"):
        RoutingRules(embedding_types=nn.Embedding)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"needs an nn\.Module, got int"):
        CompositeOptimizer(dict(CompositeOptimizer.from_factories(model, FACTORIES).child_optimizers()), model=3)  # type: ignore[arg-type]


def test_add_param_group_removes_the_first_childs_group_when_the_second_refuses() -> None:
    hidden = nn.Parameter(torch.randn(3, 3))
    norm = nn.Parameter(torch.ones(3, 3))
    opt = CompositeOptimizer(
        {
            "muon": ContractedAdamW([("hidden", hidden)]),
            "backup": SignMomentum([("norm_like", norm)]),
        }
    )
    routing = opt.parameter_routing()
    with pytest.raises(ValueError, match="lr must be"):
        opt.add_param_group(
            {"params": [("new.weight", nn.Parameter(torch.randn(3, 3))), ("new.bias", nn.Parameter(torch.zeros(3)))]},
            role_options={"backup": {"lr": -1.0}},
        )
    assert len(opt.child_optimizers()["muon"].param_groups) == 1
    assert opt.parameter_routing() == routing


class _TitanStyle(nn.Module):
    """torchtitan's Llama names: ``tok_embeddings``, ``layers.N.attention.wq``, ``norm``, ``output``."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(10, 6)
        self.layers = nn.ModuleList([nn.ModuleDict({"wq": nn.Linear(6, 6, bias=False)}) for _ in range(2)])
        self.heads = nn.Linear(6, 6, bias=False)  # a hidden matrix whose name merely contains "head"
        self.norm = nn.LayerNorm(6)
        self.output = nn.Linear(6, 10, bias=False)


class _Gpt2Style(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(10, 6), "c_attn": nn.Linear(6, 18)})
        self.lm_head = nn.Linear(6, 10, bias=False)
        if tied:
            self.lm_head.weight = self.transformer["wte"].weight


def test_output_heads_and_embeddings_go_to_backup_by_module_type() -> None:
    roles = _roles(route_model(_TitanStyle()).routing())
    assert roles["output.weight"] == roles["tok_embeddings.weight"] == "backup"
    assert roles["layers.0.wq.weight"] == roles["layers.1.wq.weight"] == roles["heads.weight"] == "muon"
    sequential = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 6), nn.Linear(6, 10))
    assert _roles(route_model(sequential).routing()) == {
        "0.weight": "backup",  # an nn.Embedding whatever its name ("0")
        "1.weight": "muon",
        "1.bias": "backup",
        "2.weight": "muon",
        "2.bias": "backup",
    }
    for tied in (False, True):
        gpt2 = _roles(route_model(_Gpt2Style(tied)).routing())
        assert gpt2["transformer.wte.weight"] == "backup" and gpt2["transformer.c_attn.weight"] == "muon"
        assert ("lm_head.weight" not in gpt2) if tied else (gpt2["lm_head.weight"] == "backup")


def test_named_parameters_whose_names_cannot_be_classified_warn() -> None:
    from gefen_hybrid import RoutingWarning

    sequential = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 6))
    with pytest.warns(RoutingWarning, match=r"\['0.weight', '1.weight'\].*pass the model itself"):
        route_named_parameters(list(sequential.named_parameters()))
    with pytest.warns(RoutingWarning, match=r"\['output.weight'\]"):
        route_named_parameters(list(_TitanStyle().named_parameters()))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        route_model(_TitanStyle())  # module types are known: nothing to warn about
        overrides = RoutingRules(overrides={"output.weight": "backup"})
        route_named_parameters(list(_TitanStyle().named_parameters()), overrides)
