"""The kit executes portable resharding itself: flattened layouts and every transition
between one process, replicated members and flattened members run in its own gloo ranks
from ``MODULE:FACTORY`` (gefen-portable's ``portable.reshard`` check). A third-party adopter
that claims them passes with zero waivers; one that drops state on flattened shards is named.
"""

from __future__ import annotations

import pytest
from gefen_contracts.testing import CheckStatus, run_conformance
from gefen_portable.conformance import PortableReshardCheck

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

_FLAT = "checkpoint:canonical_global:flattened_element_shard"
_TRANSITIONS = {
    f"checkpoint:canonical_global:transition:{a}->{b}:placement_reshard"
    for a in ("replicated", "flattened_element_shard")
    for b in ("replicated", "flattened_element_shard")
}


def test_a_third_party_adopter_claiming_portable_resharding_passes_with_zero_waivers() -> None:
    report = run_conformance("conformance_portable_adopters:third_party_factory")
    assert report.ok, report.format()
    assert not [r.name for r in report.results if r.status is CheckStatus.WAIVED]
    reshard = next(r for r in report.results if r.name == "portable.reshard")
    assert reshard.status is CheckStatus.PASSED
    assert {_FLAT, f"{_FLAT}:atomic", *_TRANSITIONS} <= set(reshard.claims)


def test_the_kit_names_an_adopter_that_drops_state_on_flattened_shards() -> None:
    # only the portable resharding check (the adopter's other claims are the honest adopter's above)
    report = run_conformance("conformance_portable_adopters:shard_blind_factory", checks=[PortableReshardCheck()])
    failed = {r.name: r for r in report.failures}
    assert "portable.reshard" in failed, report.format()
    detail = failed["portable.reshard"].detail
    assert _FLAT in detail and "flattened_element_shard->flattened_element_shard" in detail, detail
    assert "replicated->replicated" not in detail, detail  # the replicated transition is honest
