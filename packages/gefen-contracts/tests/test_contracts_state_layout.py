from __future__ import annotations

import pytest
from contract_builders import simple_layout
from gefen_contracts import (
    ContractError,
    ContractTypeError,
    OptimizerStateLayout,
    StateField,
    StateGeometry,
    StateRole,
    StateScope,
    StateValidationError,
    StateVariant,
)
from gefen_contracts.enums import ParameterLayout, ParameterStateRole, StateExtent, StateKeyMatch
from gefen_contracts.state_layout import match_variants, parameter_state_shape

REPL = frozenset({ParameterLayout.REPLICATED})


def test_field_rules_and_matching() -> None:
    field = StateField(
        "_payload_", StateScope.CHECKPOINT_CARRIER, StateRole.TRANSPORT, StateGeometry.OPAQUE, StateKeyMatch.PREFIX
    )
    assert field.matches("_payload_3") and not field.matches("payload") and not field.matches(3)
    assert field.checkpointed and not field.authoritative
    assert not StateField("c", StateScope.PARAMETER, StateRole.CACHE, StateGeometry.BLOCK).checkpointed
    with pytest.raises(ContractTypeError):
        StateField(123, StateScope.PARAMETER, StateRole.CACHE, StateGeometry.BLOCK)  # type: ignore[arg-type]
    with pytest.raises(ContractTypeError, match="optional"):
        StateField("x", StateScope.PARAMETER, StateRole.CACHE, StateGeometry.BLOCK, optional=1)  # type: ignore[arg-type]
    with pytest.raises(ContractTypeError, match="scope"):
        StateField("x", "parameter", StateRole.CACHE, StateGeometry.BLOCK)  # type: ignore[arg-type]


def test_variant_rules() -> None:
    with pytest.raises(ContractError, match="duplicates"):
        StateVariant("v", ("a", "a"), REPL, StateExtent.LOCAL_STORAGE)
    with pytest.raises(ContractError, match="layout"):
        StateVariant("v", ("a",), frozenset(), StateExtent.LOCAL_STORAGE)
    with pytest.raises(ContractTypeError, match="layouts"):
        StateVariant("v", ("a",), frozenset({"junk"}), StateExtent.LOCAL_STORAGE)  # type: ignore[arg-type]
    with pytest.raises(ContractError, match="both requires and excludes"):
        StateVariant("v", ("a",), REPL, StateExtent.LOCAL_STORAGE, parameter_ranks=(2,), excluded_parameter_ranks=(2,))
    with pytest.raises(ContractError, match="subset"):
        StateVariant("v", ("a",), REPL, StateExtent.LOCAL_STORAGE, inactive_fields=("b",))
    with pytest.raises(ContractTypeError, match="initialized"):
        StateVariant("v", ("a",), REPL, StateExtent.LOCAL_STORAGE, initialized=1)  # type: ignore[arg-type]


def test_layout_rules() -> None:
    fields = simple_layout().fields
    with pytest.raises(ContractError, match="unique names"):
        OptimizerStateLayout(fields + (fields[0],), ())
    dup = StateVariant("v", ("step",), REPL, StateExtent.LOCAL_STORAGE)
    with pytest.raises(ContractError, match="unique names"):
        OptimizerStateLayout(fields, (dup, dup))
    with pytest.raises(ContractError, match="authoritative per-parameter"):
        OptimizerStateLayout(fields, (StateVariant("v", ("scratch",), REPL, StateExtent.LOCAL_STORAGE),))
    with pytest.raises(ContractTypeError):
        OptimizerStateLayout(("x",), ())  # type: ignore[arg-type]
    layout = simple_layout()
    assert layout.field("exp_avg").geometry is StateGeometry.PARAMETER
    assert [f.name for f in layout.fields_for_scope(StateScope.OPTIMIZER_COMMON)] == ["global_step"]
    with pytest.raises(KeyError):
        layout.field("nope")


def test_match_variants_exactly_one_and_undeclared_keys() -> None:
    layout = simple_layout()
    kwargs = {"parameter_layout": ParameterLayout.REPLICATED, "parameter_rank": 2}
    assert [v.name for v in match_variants(layout, ["exp_avg", "step", "scratch"], **kwargs)] == ["stepped"]  # type: ignore[arg-type]
    assert match_variants(layout, ["exp_avg"], **kwargs) == ()  # type: ignore[arg-type]
    assert (
        match_variants(
            layout, ["exp_avg", "step"], parameter_layout=ParameterLayout.FLATTENED_ELEMENT_SHARD, parameter_rank=2
        )
        == ()
    )
    with pytest.raises(StateValidationError, match="not declared"):
        match_variants(layout, ["exp_avg", "step", "mystery"], **kwargs)  # type: ignore[arg-type]
    with pytest.raises(StateValidationError, match="optimizer-common"):
        match_variants(layout, ["global_step"], **kwargs)  # type: ignore[arg-type]


def test_match_variants_roles_ranks_and_tags() -> None:
    fields = (StateField("m", StateScope.PARAMETER, StateRole.AUTHORITATIVE, StateGeometry.PARAMETER),)
    owner = StateVariant("owner", ("m",), REPL, StateExtent.OWNER_PARAMETER, role=ParameterStateRole.OWNER)
    matrix = StateVariant(
        "matrix", ("m",), REPL, StateExtent.LOCAL_STORAGE, parameter_ranks=(2,), mode_tags=frozenset({"x.mode=a"})
    )
    layout = OptimizerStateLayout(fields, (owner, matrix))
    assert match_variants(
        layout, ["m"], parameter_layout=ParameterLayout.REPLICATED, parameter_rank=1, role=ParameterStateRole.OWNER
    ) == (owner,)
    assert (
        match_variants(
            layout, ["m"], parameter_layout=ParameterLayout.REPLICATED, parameter_rank=2, role=ParameterStateRole.ANY
        )
        == ()
    )
    assert match_variants(
        layout, ["m"], parameter_layout=ParameterLayout.REPLICATED, parameter_rank=2, mode_tags={"x.mode=a"}
    ) == (matrix,)


def test_row_follows_the_first_dimension_and_column_needs_a_matrix() -> None:
    """ROW is one value per first-dimension row at any rank but 0 (a scalar raised IndexError);
    COLUMN needs a two-dimensional parameter. Both refuse with ``ContractError``."""
    assert parameter_state_shape(StateGeometry.ROW, (4, 6)) == (4,)
    assert parameter_state_shape(StateGeometry.ROW, (2, 3, 4)) == (2,)
    assert parameter_state_shape(StateGeometry.COLUMN, (4, 6)) == (6,)
    with pytest.raises(ContractError, match="a ROW state needs a parameter of at least one dimension"):
        parameter_state_shape(StateGeometry.ROW, ())
    for shape in ((), (6,), (2, 3, 4)):
        with pytest.raises(ContractError, match="a COLUMN state needs a two-dimensional"):
            parameter_state_shape(StateGeometry.COLUMN, shape)
