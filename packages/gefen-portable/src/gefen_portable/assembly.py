"""From every member's contribution to the one catalog every member agrees on.

Every member runs :func:`assemble_catalog` on the same contributions (in coordinate order)
and so builds the same catalog and the same holder assignment, or fails with the same
error. Rules, per parameter (spec section 2.12, generalised):

* all members agree bitwise on implementation, policy, common state and manifest (by
  digest), and each member contributes exactly one slot per manifest parameter;
* every member's slot agrees on the original position, the native name and the options;
* payload pieces agree on the variant, the counters, the field specs and the
  replica fields (bitwise); pieces that carry no payload are ignored;
* payload pieces with the same extent are replicas and must be bitwise equal (compared by
  fragment digest); the distinct extents become the fragments, which must tile the
  parameter exactly once.

Each fragment is then kept by one *holder* among the members that have it: the only one
for a slice or an owner, and for replicas the least-loaded candidate by bytes (largest
fragments first, ties to the lowest coordinate), so a rank-sharded save writes each byte
once and spreads the writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gefen_contracts.codec import to_primitive
from gefen_contracts.identity import ProcessGroupIdentity
from gefen_contracts.torch_support import tensor_digest

from .catalog import Catalog, FragmentRecord, parse_extent
from .errors import PortableStateError
from .extents import Extent, extent_runs
from .records import ELEMENT_PROJECTION, REPLICA_PROJECTION, ParameterRecord, StateHeader, check_digest_text
from .values import check_name

__all__ = ["Assembly", "assemble_catalog"]

_CONTRIBUTION_KEYS = {"member", "implementation", "header_digest", "slots"}
_SLOT_KEYS = {
    "fqn",
    "position",
    "compatibility_name",
    "options",
    "payload",
    "variant",
    "counters",
    "fields",
    "fragment",
    "replica_digest",
    "replica_fields",
}


@dataclass(frozen=True, slots=True, eq=False)
class Assembly:
    """The agreed catalog and, per fragment, the coordinate of the member that keeps it."""

    catalog: Catalog
    holders: dict[tuple[str, int], int]


def _dict(value: object, keys: set[str], where: str) -> dict[str, object]:
    if type(value) is not dict or set(value) != keys:
        raise PortableStateError(f"{where} is not a well-formed contribution record")
    return value


def assemble_catalog(
    contributions: Sequence[object],
    header: StateHeader,
    identity: ProcessGroupIdentity,
) -> Assembly:
    """Build the catalog from every member's contribution (see the module docstring).

    ``header`` is this member's; its digest is one of the contributions, so agreeing with
    coordinate 0 means agreeing with every member.
    """
    members = identity.ordered_members
    if len(contributions) != len(members):
        raise PortableStateError(f"expected {len(members)} contributions, got {len(contributions)}")
    manifest = header.manifest
    fqns = manifest.fqns
    per_fqn: dict[str, list[tuple[int, dict[str, object]]]] = {fqn: [] for fqn in fqns}
    for coordinate, raw in enumerate(contributions):
        where = f"the contribution of coordinate {coordinate}"
        record = _dict(raw, _CONTRIBUTION_KEYS, where)
        if record["member"] != members[coordinate]:
            raise PortableStateError(f"{where} names member {record['member']!r}, expected {members[coordinate]!r}")
        first = contributions[0]
        assert type(first) is dict
        if (record["implementation"], record["header_digest"]) != (first["implementation"], first["header_digest"]):
            raise PortableStateError(
                f"members disagree on the implementation, policy, common state or manifest "
                f"(coordinate {coordinate} differs from coordinate 0)"
            )
        slots = record["slots"]
        if type(slots) is not list:
            raise PortableStateError(f"{where} has no slot list")
        seen: set[str] = set()
        for index, raw_slot in enumerate(slots):
            slot = _dict(raw_slot, _SLOT_KEYS, f"{where} slot {index}")
            fqn = slot["fqn"]
            if type(fqn) is not str or fqn not in per_fqn or fqn in seen:
                raise PortableStateError(f"{where} has an unknown or repeated parameter {fqn!r}")
            seen.add(fqn)
            per_fqn[fqn].append((coordinate, slot))
        grouped = {s.fqn for s in manifest.shards if s.process_group is None or s.local_member == members[coordinate]}
        if seen != grouped:
            raise PortableStateError(f"{where} does not hold one slot per manifest parameter of its member")
    parameters: dict[str, ParameterRecord] = {}
    fragments: dict[str, tuple[FragmentRecord, ...]] = {}
    candidates: dict[tuple[str, int], list[int]] = {}
    for fqn in fqns:
        parameter, frags, owners = _parameter(fqn, per_fqn[fqn], header)
        parameters[fqn] = parameter
        fragments[fqn] = frags
        for index, coordinates in enumerate(owners):
            candidates[(fqn, index)] = coordinates
    catalog = Catalog.build(header, parameters, fragments)
    return Assembly(catalog, _assign_holders(catalog, candidates))


def _same(entries: list[tuple[int, dict[str, object]]], key: str, fqn: str) -> object:
    first_coordinate, first = entries[0]
    # compare by digest: bitwise, and it works for tensors, where == is elementwise
    reference = tensor_digest(first[key])
    for coordinate, entry in entries[1:]:
        if tensor_digest(entry[key]) != reference:
            raise PortableStateError(
                f"members disagree on the {key.replace('_', ' ')} of {fqn!r} "
                f"(coordinate {coordinate} differs from coordinate {first_coordinate})"
            )
    return first[key]


def _parameter(
    fqn: str, entries: list[tuple[int, dict[str, object]]], header: StateHeader
) -> tuple[ParameterRecord, tuple[FragmentRecord, ...], list[list[int]]]:
    shards = header.manifest.for_parameter(fqn)
    identity = shards[0].parameter
    position = _same(entries, "position", fqn)
    name = _same(entries, "compatibility_name", fqn)
    options = _same(entries, "options", fqn)
    payload = [(c, e) for c, e in entries if e["payload"] is True]
    if not payload:
        raise PortableStateError(f"no member holds a payload piece of {fqn!r}")
    variant = check_name(_same(payload, "variant", fqn), f"the variant of {fqn!r}")
    counters = _same(payload, "counters", fqn)
    specs = _same(payload, "fields", fqn)
    replica_digest = _same(payload, "replica_digest", fqn)
    senders = [e for _, e in payload if e["replica_fields"] is not None]
    if len(senders) != 1 or type(senders[0]["replica_fields"]) is not dict:
        raise PortableStateError(f"exactly one member must send the replica fields of {fqn!r}")
    replica = senders[0]["replica_fields"]
    assert type(replica) is dict
    # only one member sent the tensors; the agreement above covered only their digest
    if tensor_digest(replica) != replica_digest:
        raise PortableStateError(f"the replica fields sent for {fqn!r} differ from their agreed digest")
    if type(specs) is not dict:
        raise PortableStateError(f"the field specs of {fqn!r} are malformed")
    by_extent: dict[Extent, tuple[FragmentRecord, list[int]]] = {}
    for coordinate, entry in payload:
        raw = entry["fragment"]
        if raw is None:
            if specs:
                raise PortableStateError(f"coordinate {coordinate} sent no fragment for {fqn!r}")
            continue
        if type(raw) is not dict or set(raw) != {"extent", "block_period", "digest", "nbytes"}:
            raise PortableStateError(f"coordinate {coordinate} sent a malformed fragment for {fqn!r}")
        extent = parse_extent(raw["extent"], f"the fragment of {fqn!r} from coordinate {coordinate}")
        digest = check_digest_text(raw["digest"], f"the fragment digest of {fqn!r}")
        nbytes, period = raw["nbytes"], raw["block_period"]
        if type(nbytes) is not int or type(period) is not int:
            raise PortableStateError(f"coordinate {coordinate} sent a malformed fragment size for {fqn!r}")
        frag = FragmentRecord(extent, period, digest, nbytes)
        known = by_extent.get(extent)
        if known is None:
            by_extent[extent] = (frag, [coordinate])
        elif known[0] != frag:
            raise PortableStateError(
                f"replicas of {fqn!r} disagree on their element fields "
                f"(coordinate {coordinate} differs from coordinate {known[1][0]})"
            )
        else:
            known[1].append(coordinate)
    shape = identity.global_shape
    # validate_tiling's order (first flat index); a numel-0 parameter's full extent has no runs
    ordered = sorted(by_extent.values(), key=lambda item: (extent_runs(item[0].extent, shape) or [(0, 0, 0)])[0][0])
    raw_record = {
        "identity": to_primitive(identity),
        "position": position,
        "compatibility_name": name,
        "options": options,
        "variant": variant,
        "counters": counters,
        "fields": specs,
        "replica_fields": dict(replica),
        "projection_hints": {
            "source_layout": shards[0].layout.value,
            "element_fields": ELEMENT_PROJECTION,
            "replica_fields": REPLICA_PROJECTION,
        },
    }
    record = ParameterRecord.parse(fqn, raw_record, header.manifest, f"the record of {fqn!r}")
    return record, tuple(f for f, _ in ordered), [c for _, c in ordered]


def _assign_holders(catalog: Catalog, candidates: dict[tuple[str, int], list[int]]) -> dict[tuple[str, int], int]:
    load: dict[int, int] = {}
    holders: dict[tuple[str, int], int] = {}
    shared = []
    for key in catalog.fragment_keys():
        options = candidates[key]
        if len(options) == 1:
            holders[key] = options[0]
            load[options[0]] = load.get(options[0], 0) + catalog.fragments[key[0]][key[1]].nbytes
        else:
            shared.append(key)
    # sole holders' loads are counted first; then largest first to the least loaded, same on every member
    shared.sort(key=lambda k: (-catalog.fragments[k[0]][k[1]].nbytes, k))
    for key in shared:
        chosen = min(candidates[key], key=lambda c: (load.get(c, 0), c))
        holders[key] = chosen
        load[chosen] = load.get(chosen, 0) + catalog.fragments[key[0]][key[1]].nbytes
    return holders
