"""Export and import in one process (a one-member binding, no collectives): round trips,
refusals that change nothing, misbehaving adapters, limits, freshness, and a live-import fuzz
of random corruptions."""

from __future__ import annotations

import copy
import io
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from gefen_contracts import ContractError, ContractTypeError, NotSupportedError, StaleTransactionError
from gefen_contracts.exchange import PortableExport, PortableSlotState
from gefen_contracts.identity import ProcessGroupIdentity
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.testing import deep_snapshot, snapshot_diff
from gefen_contracts.torch_support import CheckpointProcessGroupBinding, CollectiveCounter
from gefen_portable import (
    PortableLimitError,
    PortableState,
    PortableStateError,
    decode_wire,
    encode_wire,
    export_portable_state,
    import_portable_state,
    reseal_document,
)
from gefen_portable.importer import commit_on_session, prepare_on_session
from gefen_portable.protocol import Session
from portable_sgd_adopter import (
    CONTRACT,
    PortableComposite,
    PortableSGD,
    flattened_manifest,
    group,
    initial_values,
    replicated_manifest,
)

LIMITS = PortableStateLimits()
SPECS = {"encoder.weight": (8, 12), "encoder.bias": (12,), "head.weight": (12, 5), "head.bias": (5,)}
TYPED = (ContractError, ContractTypeError, NotSupportedError, StaleTransactionError)


def solo() -> CheckpointProcessGroupBinding:
    return CheckpointProcessGroupBinding(ProcessGroupIdentity("solo", ("m",)), "m", None, "cpu")


def trained(
    steps: int = 3, *, scaled: bool = True, specs: dict[str, tuple[int, ...]] = SPECS, **kw: Any
) -> PortableSGD:
    optimizer = PortableSGD(replicated_manifest(specs, None), None, initial_values(specs), scaled=scaled, **kw)
    optimizer.train_steps(0, steps)
    return optimizer


def twin_of(source: PortableSGD, **kw: Any) -> PortableSGD:
    values = {fqn: t.detach().clone() for fqn, t in source.pieces.items() if t is not None}
    return PortableSGD(source.manifest, source.member, values, scaled=source.scaled, **kw)


def export(optimizer: Any) -> PortableState:
    return export_portable_state(optimizer, checkpoint_process_group=solo(), transaction_id="e", limits=LIMITS)


def do_import(optimizer: Any, state: Any, *, binding: Any = None, limits: Any = LIMITS, transaction: Any = "i") -> None:
    import_portable_state(
        optimizer, state, checkpoint_process_group=binding or solo(), transaction_id=transaction, limits=limits
    )


def weights_only(value: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def assert_same_training(a: PortableSGD, b: PortableSGD, steps: int = 2) -> None:
    a.train_steps(10, steps)
    b.train_steps(10, steps)
    for fqn, piece in a.pieces.items():
        other = b.pieces[fqn]
        assert piece is not None and other is not None
        assert torch.equal(piece.view(torch.int32), other.view(torch.int32)), fqn


# -- round trips ------------------------------------------------------------------------


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("form", ["document", "state"])
def test_round_trip_restores_state_exactly_and_training_continues_bit_exactly(scaled: bool, form: str) -> None:
    source = trained(scaled=scaled)
    state = export(source)
    target = twin_of(source)
    counter = CollectiveCounter()
    with counter.patched():
        do_import(target, weights_only(state.materialize()) if form == "document" else state)
    assert counter.total == 0, "a one-member binding must run no collective"
    assert target.global_step == source.global_step
    for fqn, (buffer, step) in source.dense_state().items():
        other, other_step = target.dense_state()[fqn]
        assert buffer is not None and other is not None and torch.equal(buffer, other) and step == other_step
    assert_same_training(source, target)


def test_export_is_read_only_and_deterministic() -> None:
    source = trained()
    before = deep_snapshot(source)
    first = export(source).materialize()
    second = export(source).materialize()
    assert not snapshot_diff(before, source)
    assert first["completion"]["digest"] == second["completion"]["digest"]


def test_a_pristine_document_resets_a_trained_target() -> None:
    source = trained(steps=0)
    document = export(source).materialize()
    assert all(not p["fields"] and not p["fragments"] for p in document["parameters"].values())
    target = trained(steps=2)
    do_import(target, document)
    assert not any(target.state.values()) and target.global_step == 0


def test_one_member_flattened_layout_imports_a_replicated_document() -> None:
    source = trained()
    pg = group(1, "dp1")
    values = {fqn: t.detach().clone() for fqn, t in source.pieces.items() if t is not None}
    target = PortableSGD(flattened_manifest(SPECS, pg), "rank:0", values, scaled=True)
    do_import(target, export(source).materialize(), binding=CheckpointProcessGroupBinding(pg, "rank:0", None, "cpu"))
    for fqn, (buffer, step) in source.dense_state().items():
        other, other_step = target.dense_state()[fqn]
        assert buffer is not None and other is not None
        assert torch.equal(buffer.reshape(-1), other) and step == other_step


def test_an_aliasing_adapter_cannot_make_the_export_drift() -> None:
    class Aliasing(PortableSGD):
        def portable_export(self) -> PortableExport:
            exported = super().portable_export()
            slots = []
            for slot in exported.slots:
                piece = self.pieces[slot.fqn]
                live = self.state[piece]["momentum_buffer"] if piece is not None and self.state.get(piece) else None
                fields = {"momentum": live} if live is not None else dict(slot.element_fields)
                slots.append(
                    PortableSlotState(
                        slot.layout, slot.options, slot.variant, slot.counters, fields, slot.replica_fields
                    )
                )
            return PortableExport(
                exported.implementation, exported.policy, exported.common, exported.manifest, tuple(slots)
            )

    source = Aliasing(replicated_manifest(SPECS, None), None, initial_values(SPECS), scaled=True)
    source.train_steps(0, 2)
    state = export(source)
    digest = state.materialize()["completion"]["digest"]
    source.train_steps(2, 2)
    assert state.materialize()["completion"]["digest"] == digest


# -- refusals change nothing -------------------------------------------------------------


def _target() -> PortableSGD:
    return trained(steps=4)


def _resealed(edit: Callable[[dict[str, Any]], None]) -> Callable[[], Any]:
    def make() -> Any:
        document = export(trained()).materialize()
        edit(document)
        reseal_document(document)
        return document

    return make


class NoTransitions(PortableSGD):
    def optimizer_contract(self) -> Any:
        entry = CONTRACT.capabilities.checkpoints[0]
        from dataclasses import replace

        capabilities = replace(CONTRACT.capabilities, checkpoints=(replace(entry, transitions=()),))
        return replace(CONTRACT, capabilities=capabilities)


REFUSALS: dict[str, Callable[[], tuple[Any, Any, dict[str, Any]]]] = {
    "foreign implementation": lambda: (_target(), _resealed(lambda d: d.update(implementation="other.Opt"))(), {}),
    "different policy": lambda: (_target(), _resealed(lambda d: d["policy"].update(scaled=False))(), {}),
    "different options": lambda: (
        _target(),
        _resealed(lambda d: d["parameters"]["head.bias"]["options"].update(lr=0.5))(),
        {},
    ),
    "missing parameter": lambda: (
        PortableSGD(
            replicated_manifest({**SPECS, "extra": (2,)}, None),
            None,
            initial_values({**SPECS, "extra": (2,)}),
            scaled=True,
        ),
        export(trained()).materialize(),
        {},
    ),
    "different global shape": lambda: (
        PortableSGD(
            replicated_manifest({**SPECS, "head.bias": (6,)}, None),
            None,
            initial_values({**SPECS, "head.bias": (6,)}),
            scaled=True,
        ),
        export(trained()).materialize(),
        {},
    ),
    "undeclared transition": lambda: (
        NoTransitions(flattened_manifest(SPECS, group(1, "dp1")), "rank:0", initial_values(SPECS), scaled=True),
        export(trained()).materialize(),
        {"binding": CheckpointProcessGroupBinding(group(1, "dp1"), "rank:0", None, "cpu")},
    ),
    "portable state unsupported": lambda: (trained(portable=False), export(trained()).materialize(), {}),
    "not a document": lambda: (_target(), [1, 2, 3], {}),
    "empty transaction id": lambda: (_target(), export(trained()).materialize(), {"transaction": ""}),
    "limits of the wrong type": lambda: (_target(), export(trained()).materialize(), {"limits": {"chunk_bytes": 1}}),
    "tiny limits": lambda: (
        _target(),
        export(trained()).materialize(),
        {"limits": PortableStateLimits(max_fragment_tensor_bytes=64, max_collective_tensor_bytes=64)},
    ),
    "binding of another group": lambda: (
        PortableSGD(flattened_manifest(SPECS, group(1, "dp1")), "rank:0", initial_values(SPECS), scaled=True),
        export(trained()).materialize(),
        {"binding": CheckpointProcessGroupBinding(group(1, "other"), "rank:0", None, "cpu")},
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_refused_imports_raise_a_typed_error_and_change_nothing(name: str) -> None:
    target, document, kwargs = REFUSALS[name]()
    before = deep_snapshot(target)
    with pytest.raises(TYPED):
        do_import(target, document, **kwargs)
    assert not snapshot_diff(before, target)


def test_tiny_limits_are_named() -> None:
    target = _target()
    tight = PortableStateLimits(max_fragment_tensor_bytes=64, max_collective_tensor_bytes=64)
    with pytest.raises(PortableLimitError) as raised:
        do_import(target, export(trained()).materialize(), limits=tight)
    assert raised.value.limit == "max_fragment_tensor_bytes"
    with pytest.raises(PortableLimitError):
        export_portable_state(trained(), checkpoint_process_group=solo(), transaction_id="e", limits=tight)


def test_wrong_arguments_are_refused_with_type_errors() -> None:
    source = trained()
    with pytest.raises(ContractTypeError, match="CheckpointProcessGroupBinding"):
        export_portable_state(source, checkpoint_process_group="world", transaction_id="e", limits=LIMITS)  # type: ignore[arg-type]
    with pytest.raises(ContractTypeError, match="PortableAdapter"):
        export_portable_state(
            torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1),
            checkpoint_process_group=solo(),
            transaction_id="e",
            limits=LIMITS,
        )
    with pytest.raises(ContractTypeError, match="composite"):
        export_portable_state(
            PortableComposite({"a": source}), checkpoint_process_group=solo(), transaction_id="e", limits=LIMITS
        )
    with pytest.raises(NotSupportedError):
        export(trained(portable=False))


class Misbehaving(PortableSGD):
    """An adapter whose export or staging breaks a promise of the Protocol."""

    mode = ""

    def portable_export(self) -> PortableExport:
        exported = super().portable_export()
        slot = exported.slots[0]
        fields = dict(slot.element_fields)
        if self.mode == "shape":
            fields["momentum"] = torch.zeros(3)
        elif self.mode == "dtype":
            fields["momentum"] = fields["momentum"].to(torch.float8_e4m3fn)  # not a wire dtype
        elif self.mode == "nan":
            fields["momentum"] = torch.full_like(fields["momentum"], float("nan"))
        elif self.mode == "order":
            return PortableExport(
                exported.implementation, exported.policy, exported.common, exported.manifest, exported.slots[::-1]
            )
        elif self.mode == "implementation":
            return PortableExport("other.Opt", exported.policy, exported.common, exported.manifest, exported.slots)
        elif self.mode == "object in common":
            return PortableExport(
                exported.implementation, exported.policy, {"x": object()}, exported.manifest, exported.slots
            )
        replaced = PortableSlotState(
            slot.layout, slot.options, slot.variant, slot.counters, fields, slot.replica_fields
        )
        return PortableExport(
            exported.implementation,
            exported.policy,
            exported.common,
            exported.manifest,
            (replaced, *exported.slots[1:]),
        )

    def portable_prepare_import(self, **kwargs: Any) -> Any:
        staged = super().portable_prepare_import(**kwargs)
        if self.mode == "mutating prepare":
            self.param_groups[0]["lr"] = 0.5
        if self.mode == "foreign transaction":
            other = PortableSGD(replicated_manifest(SPECS, None), None, initial_values(SPECS), scaled=True)
            return other.portable_prepare_import(**kwargs)
        return staged


@pytest.mark.parametrize("mode", ["shape", "dtype", "nan", "order", "implementation", "object in common"])
def test_an_export_that_breaks_the_protocol_is_refused(mode: str) -> None:
    source = Misbehaving(replicated_manifest(SPECS, None), None, initial_values(SPECS), scaled=True)
    source.mode = mode
    source.train_steps(0, 2)
    with pytest.raises(TYPED):
        export(source)


@pytest.mark.parametrize("mode", ["mutating prepare", "foreign transaction"])
def test_staging_that_breaks_the_protocol_is_refused(mode: str) -> None:
    document = export(trained()).materialize()
    target = Misbehaving(replicated_manifest(SPECS, None), None, initial_values(SPECS), scaled=True)
    target.mode = mode
    with pytest.raises(PortableStateError):
        do_import(target, document)


def test_a_stale_staged_import_is_not_published() -> None:
    document = export(trained()).materialize()
    target = _target()
    session = Session(solo(), "import", "stale", LIMITS)
    prepared = prepare_on_session(target, document, session, prefix="")
    target.train_steps(50, 1)
    after_step = deep_snapshot(target)
    with pytest.raises(StaleTransactionError):
        commit_on_session(session, [prepared], phase="commit")
    assert not snapshot_diff(after_step, target)


# -- live-import fuzz ---------------------------------------------------------------------

FUZZ_SPECS = {
    "blocks.0.weight": (16, 24),
    "blocks.0.bias": (24,),
    "blocks.1.weight": (24, 8),
    "norm.gain": (8,),
    "empty": (0, 4),
}


def _invalid_edits() -> list[tuple[str, Callable[[dict[str, Any]], None]]]:
    def record(doc: dict[str, Any]) -> dict[str, Any]:
        return doc["parameters"]["blocks.0.weight"]  # type: ignore[no-any-return]

    return [
        ("negative step", lambda d: record(d)["counters"].update(step=-3)),
        ("zero step", lambda d: record(d)["counters"].update(step=0)),
        ("unknown variant", lambda d: record(d).update(variant="adam")),
        ("pristine with fields", lambda d: record(d).update(variant="pristine") or None),
        ("option changed", lambda d: record(d)["options"].update(momentum=0.5)),
        ("option added", lambda d: record(d)["options"].update(nesterov=True)),
        ("implementation", lambda d: d.update(implementation="gefen.Gefen")),
        ("policy", lambda d: d["policy"].update(schema=2)),
        ("common step negative", lambda d: d["common"].update(global_step=-1)),
        ("common extra", lambda d: d["common"].update(codebook=torch.zeros(4))),
        ("replica removed", lambda d: record(d)["replica_fields"].clear()),
        ("replica shape", lambda d: record(d)["replica_fields"].update(lr_scale=torch.zeros(2))),
        ("element renamed", lambda d: _rename_field(record(d), "momentum", "velocity")),
        ("element shape", lambda d: record(d)["fragments"][0]["fields"].update(momentum=torch.zeros(16, 25))),
        ("element dtype", lambda d: _half_field(record(d), "momentum")),
        ("parameter dropped", lambda d: d["parameters"].pop("norm.gain")),
        ("identity shape", lambda d: record(d)["identity"].update(global_shape=[24, 16])),
        ("position clash", lambda d: record(d).update(position=list(d["parameters"]["norm.gain"]["position"]))),
        ("manifest member", lambda d: d["manifest"]["shards"][0].update(local_member="x")),
        ("hint", lambda d: record(d)["projection_hints"].update(replica_fields="row_slices_v1")),
    ]


def _rename_field(record: dict[str, Any], old: str, new: str) -> None:
    record["fields"][new] = record["fields"].pop(old)
    for fragment in record["fragments"]:
        fragment["fields"][new] = fragment["fields"].pop(old)


def _half_field(record: dict[str, Any], name: str) -> None:
    """The field stored as float16, spec and tensors alike (so only the adapter can object)."""
    record["fields"][name]["dtype"] = "float16"
    for fragment in record["fragments"]:
        fragment["fields"][name] = fragment["fields"][name].half()
        fragment["nbytes"] = sum(t.numel() * t.element_size() for t in fragment["fields"].values())


def _live_import(
    target: PortableSGD, metadata: bytes, tensors: list[torch.Tensor], edit: Any = None, reseal: bool = False
) -> None:
    document = decode_wire(metadata, tensors, limits=LIMITS)
    assert isinstance(document, dict)
    if edit is not None:
        edit(document)
        if reseal:
            reseal_document(document)
    do_import(target, document)


def test_live_imports_of_random_corruptions_are_refused_and_change_nothing(capsys: Any) -> None:
    source = trained(specs=FUZZ_SPECS)
    document = export(source).materialize()
    payload = encode_wire(document, limits=LIMITS)
    metadata, tensors = payload.metadata, [t.clone() for t in payload.tensors]
    target = PortableSGD(replicated_manifest(FUZZ_SPECS, None), None, initial_values(FUZZ_SPECS, seed=1), scaled=True)
    target.train_steps(0, 2)
    do_import(target, decode_wire(metadata, tensors, limits=LIMITS))  # the uncorrupted payload imports
    target.train_steps(5, 1)
    rng = random.Random(20261130)
    edits = _invalid_edits()
    counts: dict[str, int] = {}
    problems: list[str] = []
    cases = 240
    for case in range(cases):
        kind = rng.choice(["metadata bit", "tensor bit", "metadata cut", "tensor cut", "edit", "edit resealed"])
        meta, payload_tensors, edit, reseal = metadata, tensors, None, False
        if kind == "metadata bit":
            flipped = bytearray(metadata)
            bit = rng.randrange(len(flipped) * 8)
            flipped[bit // 8] ^= 1 << (bit % 8)
            meta = bytes(flipped)
        elif kind == "tensor bit":
            index = rng.choice([i for i, t in enumerate(tensors) if t.numel()])
            corrupted = tensors[index].clone()
            raw = corrupted.reshape(-1).view(torch.uint8)
            raw[rng.randrange(raw.numel())] ^= 1 << rng.randrange(8)
            payload_tensors = [*tensors[:index], corrupted, *tensors[index + 1 :]]
        elif kind == "metadata cut":
            meta = metadata[: rng.randrange(len(metadata))]
        elif kind == "tensor cut":
            index = rng.choice([i for i, t in enumerate(tensors) if t.numel()])
            payload_tensors = [*tensors[:index], tensors[index].reshape(-1)[:-1].clone(), *tensors[index + 1 :]]
            if rng.random() < 0.3:
                payload_tensors = tensors[:-1]
        else:
            name, edit = edits[case % len(edits)]
            reseal = kind == "edit resealed"
            kind = f"{kind}: {name}"
        before = deep_snapshot(target)
        try:
            _live_import(target, meta, payload_tensors, edit, reseal)
        except TYPED:
            counts[kind.split(":")[0]] = counts.get(kind.split(":")[0], 0) + 1
        except Exception as exc:
            problems.append(f"case {case} ({kind}): untyped {type(exc).__name__}: {exc}")
        else:
            problems.append(f"case {case} ({kind}): accepted")
        diffs = snapshot_diff(before, target)
        if diffs:
            problems.append(f"case {case} ({kind}) changed the optimizer: {diffs[:2]}")
    with capsys.disabled():
        print(f"\n[live-import fuzz] {sum(counts.values())} of {cases} corrupted imports refused: {counts}")
    assert not problems, problems[:5]
    assert sum(counts.values()) == cases >= 200


def test_a_composite_of_adapters_round_trips_in_one_process() -> None:
    from gefen_portable import export_portable_composite_state, import_portable_composite_state

    first = trained(specs={"a": (3, 4)})
    second = trained(specs={"b": (5,)}, scaled=False, lr=0.02)
    source = PortableComposite({"first": first, "second": second})
    state = export_portable_composite_state(source, checkpoint_process_group=solo(), transaction_id="c", limits=LIMITS)
    document = weights_only(state.materialize())
    target = PortableComposite({"first": twin_of(first), "second": twin_of(second, lr=0.02)})
    import_portable_composite_state(
        target, document, checkpoint_process_group=solo(), transaction_id="c", limits=LIMITS
    )
    for role in ("first", "second"):
        assert_same_training(source.children[role], target.children[role])
    corruptions: dict[str, Callable[[dict[str, Any]], None]] = {
        "routing": lambda d: d["routing"].update(a="second"),
        "roles reordered": lambda d: d["roles"].reverse(),
        "roles unhashable": lambda d: d.update(roles=[["first"], "second"]),
        "missing child": lambda d: d["children"].pop("second"),
        "child counter": lambda d: d["children"]["first"]["parameters"]["a"]["counters"].update(step=9),
        "child digest": lambda d: d["children"]["first"]["completion"].update(digest="0" * 64),
        "wrapper digest": lambda d: d["completion"].update(digest="1" * 64),
        "implementation": lambda d: d.update(implementation="other.Composite"),
    }
    for name, corrupt in corruptions.items():
        broken = copy.deepcopy(document)
        corrupt(broken)
        before = deep_snapshot(target.children["first"], target.children["second"])
        with pytest.raises(PortableStateError):
            import_portable_composite_state(
                target, broken, checkpoint_process_group=solo(), transaction_id="c", limits=LIMITS
            )
        assert not snapshot_diff(before, target.children["first"], target.children["second"]), name
    from gefen_portable import COMPOSITE_FORMAT_VERSION

    older = {**document, "format_version": COMPOSITE_FORMAT_VERSION - 1}
    with pytest.raises(
        PortableStateError,
        match=rf"format_version is {COMPOSITE_FORMAT_VERSION - 1}; this library reads version {COMPOSITE_FORMAT_VERSION}",
    ):
        import_portable_composite_state(
            target, older, checkpoint_process_group=solo(), transaction_id="c", limits=LIMITS
        )
