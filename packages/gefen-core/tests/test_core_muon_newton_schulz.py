"""Newton-Schulz: schedules, a float64 reference, torch parity, the fp8 twin and batched NS."""

from __future__ import annotations

import pytest
import torch
from gefen_core.batched_newton_schulz import (
    newton_schulz_batched,
    plan_chunks,
    shape_eligible,
    workspace_bytes,
)
from gefen_core.fp8_newton_schulz import (
    FP8_MAX,
    emulated_scaled_mm,
    fp8_eligible,
    newton_schulz_fp8,
    quantize_rows,
)
from gefen_core.newton_schulz import (
    DEFAULT_COEFFICIENTS,
    NS_SCHEDULES,
    ScheduleError,
    newton_schulz,
    orthogonality_error,
    polynomial_schedule_value,
    resolve_schedule,
)
from gefen_core_test_support import single_threaded_torch  # noqa: F401  (autouse fixture)
from torch.optim._muon import _zeropower_via_newtonschulz

SCHEDULES = ("standard", "tuned3", "tuned4")
#: Stated bound: the fp8 iteration (e4m3 operands, per-row scales) stays within this relative
#: L2 distance of the bf16 iteration (measured 0.06 to 0.15 on 96x384 to 256x1024 Gaussians).
FP8_RELATIVE_BOUND = 0.2
#: Stated bound: bf16 NS stays within this relative L2 distance of the float64 iteration
#: (measured 4e-3 to 1.3e-2).
BF16_RELATIVE_BOUND = 3e-2


def _gaussian(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_the_schedules_hold_the_specified_coefficients() -> None:
    assert DEFAULT_COEFFICIENTS == (3.4445, -4.7750, 2.0315)
    assert NS_SCHEDULES["tuned3"] == ((5.0067, -14.4125, 10.6001), (3.7534, -6.8083, 3.3840), (3.2080, -4.3501, 2.0330))
    assert NS_SCHEDULES["tuned4"] == (
        (5.4261, -15.5285, 11.2657),
        (3.0766, -4.9701, 2.1297),
        (3.0008, -6.4486, 4.3696),
        (2.8386, -4.1421, 2.5758),
    )


def test_schedule_resolution_rules() -> None:
    assert resolve_schedule() == (DEFAULT_COEFFICIENTS,) * 5
    assert resolve_schedule(ns_steps=3, ns_schedule="standard") == (DEFAULT_COEFFICIENTS,) * 3
    assert resolve_schedule(ns_steps=0, ns_schedule="tuned3") == NS_SCHEDULES["tuned3"]  # ns_steps ignored
    custom = [(3.0, -3.0, 1.0), [2.0, -1.5, 0.5]]
    assert resolve_schedule(ns_schedule=custom) == ((3.0, -3.0, 1.0), (2.0, -1.5, 0.5))
    assert resolve_schedule(ns_coefficients=custom, ns_steps=7) == ((3.0, -3.0, 1.0), (2.0, -1.5, 0.5))
    assert resolve_schedule(ns_coefficients=(1, 2, 3), ns_steps=2) == ((1.0, 2.0, 3.0),) * 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ns_steps": 0}, "ns_steps must be in .* got 0 [(]0 steps would skip"),
        ({"ns_steps": -1}, "ns_steps must be in .* got -1$"),
        ({"ns_steps": 100}, "ns_steps must be in .* got 100$"),
        ({"ns_steps": 2.0}, "ns_steps must be an int"),
        ({"ns_steps": True}, "ns_steps must be an int"),
        ({"ns_coefficients": (1.0, 2.0)}, "exactly 3"),
        ({"ns_coefficients": []}, "must not be empty"),
        ({"ns_coefficients": [(1.0, 2.0, 3.0), (1.0, 2.0)]}, r"ns_coefficients\[1\]"),
        ({"ns_coefficients": (1.0, float("nan"), 3.0)}, "finite"),
        ({"ns_schedule": "tuned5"}, "unknown"),
        ({"ns_schedule": []}, "ns_schedule must not be empty"),
        ({"ns_schedule": [(1.0, 2.0, 3.0)] * 100}, "fewer than 100"),
        ({"ns_schedule": [(1.0, 2.0, 3.0), "abc"]}, r"ns_schedule\[1\]"),
    ],
)
def test_malformed_schedules_are_refused_naming_the_argument(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        resolve_schedule(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (32, 32)])
def test_standard_schedule_is_torch_muons_iteration_bit_for_bit(shape: tuple[int, int]) -> None:
    x = _gaussian(*shape)
    ours = newton_schulz(x, resolve_schedule(), 1e-7)
    theirs = _zeropower_via_newtonschulz(x, DEFAULT_COEFFICIENTS, 5, 1e-7)
    assert ours.dtype is torch.bfloat16 and ours.shape == x.shape
    assert torch.equal(ours, theirs)
    repeated = newton_schulz(x, resolve_schedule(ns_schedule=[DEFAULT_COEFFICIENTS] * 5), 1e-7)
    assert torch.equal(ours, repeated)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("shape", [(48, 160), (160, 48)])
def test_float64_iteration_applies_the_schedule_polynomials_to_singular_values(
    name: str, shape: tuple[int, int]
) -> None:
    x = _gaussian(*shape, seed=3).double()
    schedule = resolve_schedule(ns_schedule=name)
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    expected = u @ torch.diag(polynomial_schedule_value(s / x.norm(), schedule)) @ vh
    reference = newton_schulz(x, schedule, 1e-7, compute_dtype=torch.float64)
    torch.testing.assert_close(reference, expected, rtol=0, atol=1e-10)
    bf16 = newton_schulz(x.float(), schedule, 1e-7)
    assert _relative(bf16, reference) < BF16_RELATIVE_BOUND


def test_documented_schedule_properties() -> None:
    grid = torch.linspace(0, 1, 20001, dtype=torch.float64)
    assert polynomial_schedule_value(grid, NS_SCHEDULES["tuned3"]).abs().max() <= 1.15
    assert polynomial_schedule_value(grid, NS_SCHEDULES["tuned4"]).abs().max() <= 1.01
    for shape in ((128, 512), (512, 128)):
        x = _gaussian(*shape, seed=4)
        errors = {
            name: orthogonality_error(newton_schulz(x, resolve_schedule(ns_schedule=name), 1e-7)) for name in SCHEDULES
        }
        assert errors["tuned4"] <= 1.10 * errors["standard"]
        assert all(error < 0.5 for error in errors.values()), errors


def test_zero_input_gives_a_finite_zero_output() -> None:
    for schedule in ("standard", "tuned3"):
        out = newton_schulz(torch.zeros(8, 12), resolve_schedule(ns_schedule=schedule), 1e-7)
        assert torch.equal(out, torch.zeros(8, 12, dtype=torch.bfloat16))
    assert torch.equal(
        newton_schulz_batched(torch.zeros(9, 5, 7), NS_SCHEDULES["tuned3"], 1e-7), torch.zeros(9, 5, 7).bfloat16()
    )
    with pytest.raises(ValueError, match="2-D"):
        newton_schulz(torch.zeros(2, 3, 4), NS_SCHEDULES["tuned3"], 1e-7)


def test_row_quantisation_is_scaled_per_row_and_saturates_at_448() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [1e3, 1.0, -1e3]])
    q, scale = quantize_rows(x)
    assert q.dtype is torch.float8_e4m3fn and scale.shape == (3, 1)
    torch.testing.assert_close(scale, torch.tensor([[2.0 / FP8_MAX], [1e-12], [1e3 / FP8_MAX]]))
    assert q.float().abs().max() == FP8_MAX and torch.equal(q[1].float(), torch.zeros(3))
    torch.testing.assert_close(q.float() * scale, x, rtol=0.07, atol=0.0)  # e4m3 keeps 3 mantissa bits


def test_emulated_scaled_mm_matches_torchs_scaled_mm_where_it_runs() -> None:
    a, b = _gaussian(32, 48, 5), _gaussian(16, 48, 6)
    aq, sa = quantize_rows(a)
    bq, sb = quantize_rows(b)
    emulated = emulated_scaled_mm(aq, sa, bq.T, sb.T)
    try:
        real = torch._scaled_mm(aq, bq.T, scale_a=sa, scale_b=sb.T, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):  # a torch build without CPU fp8 GEMMs
        real = None
    if real is not None:
        torch.testing.assert_close(emulated.float(), real.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(emulated.float(), (a @ b.T), rtol=0.1, atol=0.5)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("shape", [(96, 384), (384, 96)])
def test_fp8_twin_stays_within_the_stated_bound_of_bf16(name: str, shape: tuple[int, int]) -> None:
    x = _gaussian(*shape, seed=7)
    schedule = resolve_schedule(ns_schedule=name)
    bf16 = newton_schulz(x, schedule, 1e-7)
    fp8 = newton_schulz_fp8(x, schedule, 1e-7)
    assert fp8.dtype is torch.bfloat16 and fp8.shape == x.shape
    assert 0 < _relative(fp8, bf16) < FP8_RELATIVE_BOUND
    assert abs(orthogonality_error(fp8) - orthogonality_error(bf16)) < 0.1
    assert not fp8_eligible(shape, torch.device("cpu"))


def test_batched_workspace_gate_and_chunks() -> None:
    mib = 1 << 20
    assert [workspace_bytes(32, m, n) // mib for m, n in ((128, 1024), (256, 2048), (512, 2048))] == [26, 104, 224]
    for shape in ((512, 2048), (2048, 512), (256, 4096)):
        assert shape_eligible(*shape)
    for shape in ((513, 2044), (512, 2049), (1024, 1024), (0, 1024)):
        assert not shape_eligible(*shape)
    table = {
        (7, 64): ([], 7),
        (8, 8): ([8], 0),
        (17, 10): ([9, 8], 0),
        (17, 8): ([8, 8], 1),
        (18, 10): ([10, 8], 0),
        (15, 8): ([8], 7),
        (64, 7): ([], 64),
    }
    for (count, cap), expected in table.items():
        assert plan_chunks(count, cap) == expected
    for count in range(40):
        for cap in range(1, 30):
            chunks, serial = plan_chunks(count, cap)
            assert sum(chunks) + serial == count and all(8 <= c <= cap for c in chunks)


@pytest.mark.parametrize("shape", [(17, 31), (31, 17)])
def test_batched_iteration_stays_close_to_serial(shape: tuple[int, int]) -> None:
    stack = torch.randn(9, *shape, generator=torch.Generator().manual_seed(8))
    schedule = NS_SCHEDULES["tuned3"]
    batched = newton_schulz_batched(stack, schedule, 1e-7)
    serial = torch.stack([newton_schulz(m, schedule, 1e-7) for m in stack])
    assert batched.shape == stack.shape and batched.dtype is torch.bfloat16
    assert _relative(batched, serial) <= 2e-2
    assert float((batched.double() - serial.double()).abs().max()) <= 2e-2
    with pytest.raises(ValueError, match=r"\[batch, rows, cols\]"):
        newton_schulz_batched(stack[0], schedule, 1e-7)
