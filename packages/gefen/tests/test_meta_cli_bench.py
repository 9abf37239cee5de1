"""The ``gefen`` command line: one tiny smoke run per command (schema-checked); its arguments are
tested in ``test_meta_cli_arguments.py``."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gefen.bench.schema import read_report, validate_report
from gefen.cli.main import main


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """In-process training runs use one thread (fast and steady on a shared 2-core machine)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_a_recipe_arm_that_cannot_be_built_is_reported_as_such() -> None:
    from gefen.bench.checkpoint_arms import build_status

    assert build_status("gefen") is None
    assert "cannot be built here" in (build_status("nosuch") or "")


@pytest.mark.slow
def test_a_diverged_arm_is_a_note_not_a_crash(tmp_path: Path) -> None:
    """A diverged run's losses are inf, which the report schema refuses: the demo and the
    quality benchmark crashed after all their runs and wrote nothing."""
    code = main(
        ["demo", "--steps", "3", "--model-size", "tiny", "--batch-size", "4", "--threads", "1",
         "--lr", "adamw=1e30", "--out", str(tmp_path / "demo")]
    )  # fmt: skip
    assert code == 0
    demo = read_report(tmp_path / "demo" / "demo.json")
    assert "adamw diverged at lr 1e+30 (a non-finite loss): no test_loss row" in demo.notes
    assert demo.row("gefen", "test_loss").baseline is None  # no baseline loss to compare with
    code = main(
        ["bench", "quality", "--tasks", "char-tiny", "--optimizers", "adamw,gefen", "--lr-grid", "1e30",
         "--seeds", "1", "--steps", "3", "--workers", "1", "--out", str(tmp_path / "quality")]
    )  # fmt: skip
    assert code == 0
    quality = read_report(tmp_path / "quality" / "quality.json")
    assert any(note.startswith("char-tiny/adamw diverged at lr 1e+30") for note in quality.notes)


def _check_files(out: Path, stem: str) -> dict[str, object]:
    for suffix in ("json", "txt", "png"):
        assert (out / f"{stem}.{suffix}").stat().st_size > 0
    assert (out / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    document: dict[str, object] = json.loads((out / f"{stem}.json").read_text())
    validate_report(document)
    return document


@pytest.mark.slow
def test_demo_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["demo", "--steps", "4", "--model-size", "tiny", "--batch-size", "4", "--threads", "1", "--out", str(tmp_path)]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "gefen" in out and "adamw" in out and "state_bytes_per_param" in out
    _check_files(tmp_path, "demo")
    report = read_report(tmp_path / "demo.json")
    assert report.benchmark == "demo"
    gefen = report.row("gefen", "state_bytes_per_param")
    # tiny's matrices (d = 32) keep Adam's per-element v (min_dim_size_to_factor): about 5 of AdamW's 8 bytes
    assert gefen.baseline == "adamw" and gefen.ratio is not None and gefen.ratio < 0.65
    assert report.row("adamw", "peak_rss_over_start").value > 0


@pytest.mark.slow
def test_bench_memory_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "bench",
            "memory",
            "--models",
            "tiny",
            "--optimizers",
            "adamw,gefen",
            "--steps",
            "2",
            "--out",
            str(tmp_path),
            "--json",
        ]
    )
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    document = _check_files(tmp_path, "memory")
    assert printed == document
    report = read_report(tmp_path / "memory.json")
    adamw = report.row("tiny/adamw", "state_bytes_per_param")
    assert 8.0 <= adamw.value < 8.01
    gefen = report.row("tiny/gefen", "state_bytes_per_param")
    assert gefen.baseline == "tiny/adamw" and gefen.value < 5.2  # narrow matrices: per-element v
    assert {row.metric for row in report.rows} == {
        "state_bytes_per_param",
        "step_peak_bytes_per_param",
        "first_step_peak_bytes_per_param",
    }


@pytest.mark.slow
def test_bench_quality_smoke(tmp_path: Path) -> None:
    code = main(
        [
            "bench", "quality", "--tasks", "char-tiny", "--optimizers", "adamw,gefen", "--lr-grid", "1e-3,1e-2",
            "--seeds", "2", "--steps", "3", "--workers", "1", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert code == 0
    _check_files(tmp_path, "quality")
    report = read_report(tmp_path / "quality.json")
    loss = report.row("char-tiny/gefen", "test_loss")
    assert loss.baseline == "char-tiny/adamw"
    assert len(loss.detail["per_seed"]) == 2  # type: ignore[arg-type]
    assert set(loss.detail["valid_by_lr"]) == {"0.001", "0.01"}  # type: ignore[arg-type]
    best = report.row("char-tiny/gefen", "best_lr")
    assert best.value in (1e-3, 1e-2) and best.ratio is not None
    paired = report.row("char-tiny/gefen", "paired_loss_ratio")
    per_seed = loss.detail["per_seed"]
    base_per_seed = report.row("char-tiny/adamw", "test_loss").detail["per_seed"]
    ratios = [a / b for a, b in zip(per_seed, base_per_seed)]  # type: ignore[arg-type, operator]
    assert paired.value == pytest.approx(sum(ratios) / 2)
    assert paired.detail["low"] <= paired.value <= paired.detail["high"]  # type: ignore[operator]
    assert paired.detail["seeds"] == 2
    assert any(note.startswith("char-tiny: gefen / adamw = ") for note in report.notes)
    assert report.config["task_definitions"]["char-tiny"]["corpus_digest"]  # type: ignore[index]
    # The pool options reach the runs (they were parsed and dropped before).
    assert report.config["workers"] == 1 and report.config["threads"] == 1 and report.config["device"] == "cpu"


@pytest.mark.slow
def test_bench_quality_chooses_the_rate_on_the_mean_of_the_sweep_seeds(tmp_path: Path) -> None:
    code = main(
        [
            "bench", "quality", "--tasks", "char-tiny", "--optimizers", "adamw", "--lr-grid", "1e-3,1e-2",
            "--seeds", "2", "--sweep-seeds", "2", "--steps", "3", "--workers", "1", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert code == 0
    report = read_report(tmp_path / "quality.json")
    loss = report.row("char-tiny/adamw", "test_loss")
    # Each rate's valid loss is the mean over sweep seeds 0 and 1; the reported seeds are 2 and 3.
    from gefen.bench.training_pool import TrainJob, run_jobs
    from gefen.demo.train import TrainConfig

    def valid(lr: float, seed: int) -> float:
        config = TrainConfig("adamw", lr, 3, batch_size=4, seed=seed, eval_windows=8)
        return run_jobs([TrainJob("tiny", "tinylang-char", config)])[0].valid_loss

    expected = {str(lr): (valid(lr, 0) + valid(lr, 1)) / 2 for lr in (1e-3, 1e-2)}
    assert loss.detail["valid_by_lr"] == pytest.approx(expected)  # type: ignore[arg-type]
    tests = [run_jobs([TrainJob("tiny", "tinylang-char", TrainConfig("adamw", report.row("char-tiny/adamw", "best_lr").value, 3, batch_size=4, seed=s, eval_windows=8))])[0].test_loss for s in (2, 3)]  # fmt: skip
    assert loss.detail["per_seed"] == pytest.approx(tests)  # type: ignore[arg-type]
    assert report.config["sweep_seeds"] == 2


@pytest.mark.slow
def test_bench_dp_smoke(tmp_path: Path) -> None:
    code = main(
        ["bench", "dp", "--repeats", "1", "--elements", "65536", "--bruteforce-bins", "256", "--out", str(tmp_path)]
    )
    assert code == 0
    _check_files(tmp_path, "dp")
    report = read_report(tmp_path / "dp.json")
    fast = report.row("full-256/fast", "solve_s")
    assert fast.baseline == "full-256/bruteforce" and fast.ratio is not None
    assert fast.detail["identical_to_bruteforce"] is True
    assert {row.name for row in report.rows} >= {"gaussian-4096/fast", "student-t-4096/fast", "full-4096/fast"}
    for kind in ("gaussian", "student-t", "full"):  # the op as a step runs it: gefen-kernels' C solve
        op = report.row(f"{kind}-4096/op", "solve_s")
        assert op.baseline == f"{kind}-4096/fast" and op.ratio is not None
        assert op.detail["identical_to_fast"] is True and op.detail["c_kernel"] is True


def _ratios_hold(document: dict[str, object]) -> None:
    """Every row with a baseline carries value / baseline value (the schema check does too)."""
    rows = {(row["name"], row["metric"]): row for row in document["rows"]}  # type: ignore[attr-defined, index]
    for (_, metric), row in rows.items():
        if row["baseline"] is not None:
            base = rows[(row["baseline"], metric)]["value"]
            assert row["ratio"] is None if base == 0 else math.isclose(row["ratio"], row["value"] / base)


def test_bench_step_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Folds tools/bench_step.py: every arm runs on a tiny decoder, ratios against fused AdamW."""
    code = main(
        ["bench", "step", "--d-model", "64", "--layers", "1", "--vocab", "256", "--warmup", "1", "--repeats", "2",
         "--threads", "1", "--out", str(tmp_path)]
    )  # fmt: skip
    assert code == 0
    document = _check_files(tmp_path, "step")
    report = read_report(tmp_path / "step.json")
    names = {row.name for row in report.rows}
    assert {"adamw-fused", "adamw-default", "copy-14B", "gefen-reference", "gefen-fused"} <= names
    assert "gefenmuon-momentum-fused" in names and "gefen-block-fused" in names
    units = {"ops_per_step": "calls", "host_time_per_tensor": "us"}
    for row in report.rows:
        assert row.unit == units.get(row.metric, "ms")
        assert row.metric in (
            "step_time", "first_step_time", "codebook_solve_time", "kernel_library_load_time", *units
        )  # fmt: skip
        assert row.value > 0
        if row.metric == "step_time":
            assert row.baseline == (None if row.name == "adamw-fused" else "adamw-fused")
    first = report.row("gefen-fused", "first_step_time")
    steady = report.row("gefen-fused", "step_time")
    assert first.detail["x_steady"] == pytest.approx(first.value / steady.value)
    assert "x_steady_without_codebook_solve" in first.detail
    assert report.row("codebook_solve", "codebook_solve_time").value > 0
    assert report.row("kernel_library", "kernel_library_load_time").value >= 0
    assert report.config["parameters"] == 64 * 256 + 3 * 64 + 64 * 64 * (1 + 0.25 + 0.25 + 1 + 12)
    assert report.config["kernels"]["cpu_available"] is True  # type: ignore[index]
    _ratios_hold(document)
    table = capsys.readouterr().out  # the figures tools/bench_step.py printed: size, ms, ns/param, ratio
    assert f"{report.config['parameters']:,} float32 parameters in 11 tensors" in table
    assert "ns/param" in table and "vs adamw-fused" in table
    assert "first step (codebook solve alone:" in table and "x steady w/o solve" in table
    # dispatch figures: fused AdamW is one multi-tensor op (plus its step-count update); Gefen's fused
    # step calls one or two of its ops per tensor; the host time is measured for whole optimizers only
    assert report.row("adamw-fused", "ops_per_step").detail["gefen_ops"] == 0
    fused_ops = report.row("gefen-fused", "ops_per_step")
    # one group: one call per phase for its matrices (moments, step) and one for its vectors,
    # whatever the number of tensors (11 here)
    # d = 64: the matrices keep a per-element v, stepped by factored_step without factored_moments
    assert fused_ops.detail["gefen_ops"] == 2 and fused_ops.value >= 2  # type: ignore[operator]
    # the reference runs through each op's reference twin (gefen::<op>_reference), one call per
    # phase as the kernels'
    assert report.row("gefen-reference", "ops_per_step").detail["gefen_ops"] == 2
    assert {row.name for row in report.rows if row.metric == "host_time_per_tensor"} == {
        "adamw-fused", "adamw-default", "gefen-reference", "gefen-fused", "gefen-block-fused"
    }  # fmt: skip
    # the host times are taken round-robin in one run, so each has its ratio to fused AdamW's
    for row in report.rows:
        if row.metric == "host_time_per_tensor":
            assert row.baseline == (None if row.name == "adamw-fused" else "adamw-fused")
    host_ratio = report.row("gefen-fused", "host_time_per_tensor").ratio
    assert "ops/step" in table and "host us/tensor" in table and f"{host_ratio:.2f}x" in table


def test_bench_step_steps_the_demo_model_when_asked() -> None:
    """``--model demo``: the parameters of ``gefen demo``'s model, shape for shape (issue 17's
    demo figure comes from ``gefen bench step``)."""
    from gefen.bench.step import StepOptions, model_shapes
    from gefen.demo.data import load_tinylang
    from gefen.demo.model import TinyDecoder, preset

    model = TinyDecoder(preset("small").with_vocab(load_tinylang().tokenizer.vocab_size))
    expected = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    assert model_shapes(StepOptions(model="demo")) == expected
    assert len(expected) == 53 and sum(math.prod(shape) for _, shape in expected) == 812_288
    with pytest.raises(ValueError, match=r"StepOptions\.model must be"):
        StepOptions(model="gpt2")


def test_bench_step_runs_only_the_chosen_arms_and_the_baseline(tmp_path: Path) -> None:
    code = main(
        ["bench", "step", "--d-model", "32", "--layers", "1", "--vocab", "64", "--warmup", "1", "--repeats", "1",
         "--threads", "1", "--arms", "gefen-block-fused", "--out", str(tmp_path)]
    )  # fmt: skip
    assert code == 0
    rows = read_report(tmp_path / "step.json").rows
    assert {row.name for row in rows if row.metric == "step_time"} == {"adamw-fused", "gefen-block-fused"}


def test_bench_muon_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Folds tools/bench_muon.py: every schedule against torch's Muon, state bytes, orthogonality."""
    assert main(["bench", "muon", "--tiny", "--repeats", "1", "--threads", "1", "--out", str(tmp_path)]) == 0
    _check_files(tmp_path, "muon")
    report = read_report(tmp_path / "muon.json")
    for schedule in ("standard", "tuned3", "tuned4"):
        step = report.row(f"muon/gefen-{schedule}-reference", "step_time")
        assert step.baseline == "muon/torch-ns5" and step.ratio is not None
        assert report.row(f"ns/gefen-{schedule}", "ns_time").baseline == "ns/torch-ns5"
        assert report.row(f"ns/gefen-{schedule}@64x256", "orthogonality_error").value > 0
    assert report.row("muon/torch-ns5", "state_bytes_per_param").value == 4.0
    assert 1.0 < report.row("muon/gefen-tuned3-reference", "state_bytes_per_param").value < 1.1
    # tuned4 orthogonalises a rectangular Gaussian matrix far better than NS5 (deterministic, not a timing)
    assert report.row("ns/gefen-tuned4@64x256", "orthogonality_error").ratio < 0.5  # type: ignore[operator]
    capsys.readouterr()
    if not torch.cuda.is_available():  # the fp8 device check says it cannot run here and succeeds
        assert main(["bench", "muon", "--device-check", "--out", str(tmp_path / "fp8")]) == 0
        assert "device check skipped" in capsys.readouterr().err


def test_fp8_device_check_bounds_one_gemm_and_the_distance_from_bf16() -> None:
    """The GPU check's logic on CPU: the emulated twin as the "real" GEMM holds every bound; a GEMM
    that rounds its result coarser than bf16 (an fp8 output, say) breaks the per-GEMM bound."""
    from gefen.bench.muon import fp8_agreement, fp8_problems
    from gefen_core.fp8_newton_schulz import emulated_scaled_mm
    from gefen_core.newton_schulz import resolve_schedule

    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    steps = resolve_schedule(ns_schedule="tuned3")
    faithful = fp8_agreement(x, steps, emulated_scaled_mm)
    assert faithful["gemm_vs_twin"] == 0.0 and faithful["real_vs_twin"] == 0.0
    assert 0.0 < faithful["fp8_vs_bf16"] < 0.2
    assert fp8_problems("64x96 tuned3", faithful) == []

    def coarse(p: torch.Tensor, ps: torch.Tensor, q: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
        return emulated_scaled_mm(p, ps, q, qs).to(torch.float8_e5m2).to(torch.bfloat16)

    problems = fp8_problems("64x96 tuned3", fp8_agreement(x, steps, coarse))
    assert any("gemm_vs_twin" in problem for problem in problems), problems
    assert fp8_problems("x", {"gemm_vs_twin": 0.0, "fp8_vs_bf16": 0.5}) == [
        "FAILED: x: fp8 is 0.500 away from bf16 (bound 0.2)"
    ]


def test_bench_guard_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Folds tools/bench_guard.py; Gefen's arms are notes until its contract claims them."""
    code = main(
        ["bench", "guard", "--tensors", "6", "--numel", "16", "--steps", "2", "--repeats", "1", "--out", str(tmp_path)]
    )
    assert code == 0
    document = _check_files(tmp_path, "guard")
    report = read_report(tmp_path / "guard.json")
    assert report.row("contracted-adamw/guard-pass", "time_per_tensor").unit == "us/tensor"
    share = report.row("contracted-adamw/guard-per-step", "step_time")
    assert share.baseline == "contracted-adamw/step-bound" and share.ratio is not None
    assert report.row("composite/guard-per-step", "step_time").baseline == "composite/step-bound"
    assert "µs per parameter tensor per pass" in capsys.readouterr().out and any(
        note.startswith("contracted-adamw: guard") and "% of a bound step" in note for note in report.notes
    )
    _ratios_hold(document)
    from gefen_contracts import FEATURE_POST_SHARDING
    from gefen_core import Gefen

    claims = Gefen([torch.nn.Parameter(torch.ones(2))]).optimizer_contract().capabilities.feature(FEATURE_POST_SHARDING)
    gefen_rows = {row.name for row in report.rows if row.name.startswith("gefen/")}
    if claims.supported:
        assert "gefen/guard-pass" in gefen_rows
        counted = report.row("gefen/scoped-step-counted", "collectives_per_step")
        assert (
            counted.baseline == "gefen/scoped-step-budget"
            and 1 <= counted.value <= report.row("gefen/scoped-step-budget", "collectives_per_step").value
        )
    else:
        assert not gefen_rows and any(note.startswith("gefen: guard not measured") for note in report.notes)


@pytest.mark.slow
def test_bench_dcp_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Folds tools/bench_dcp.py: one rank, Gefen through GefenDCPState and through torch's recipe,
    against torch DCP of AdamW through that recipe (the worker's two paths; a ``recipe:<arm>``
    arm only swaps the optimizer of the second), the recipe flattened as torchtitan's is."""
    arms = ["--optimizers", "gefen,recipe:gefen", "--flatten"]
    code = main(["bench", "dcp", "--model", "tiny", "--ranks", "1", *arms, "--out", str(tmp_path)])
    assert code == 0
    document = _check_files(tmp_path, "dcp")
    report = read_report(tmp_path / "dcp.json")
    assert report.config["flatten"] is True
    operations = ("first_save", "save", "async_save", "load")
    metrics = {f"{op}_{kind}" for op in operations for kind in ("seconds", "peak_bytes_per_param")}
    for arm in ("torch-dcp-adamw", "gefen", "recipe:gefen"):
        assert {row.metric for row in report.rows if row.name == f"tiny/1ranks/{arm}"} == {
            *metrics,
            "disk_bytes_per_param",
        }
    adamw_disk = report.row("tiny/1ranks/torch-dcp-adamw", "disk_bytes_per_param").value
    gefen_disk = report.row("tiny/1ranks/gefen", "disk_bytes_per_param").value
    assert adamw_disk > 8.0 and gefen_disk < adamw_disk  # fp32 m and v against codes and scales (+ metadata)
    # flattened, torch repeats every group option under each of tiny's 17 FQNs (30K parameters): the figure is
    # the benchmark's to print (docs/benchmarks.md), not a bound here
    assert report.row("tiny/1ranks/recipe:gefen", "disk_bytes_per_param").value > gefen_disk
    save = report.row("tiny/1ranks/gefen", "save_seconds")
    assert save.baseline == "tiny/1ranks/torch-dcp-adamw"
    imports = save.detail["per_rank_checkpoint_import_bytes"]
    assert len(imports) == 1 and isinstance(imports[0], int)  # reported apart from the measured peaks
    assert all(row.value > 0 for row in report.rows if row.metric.endswith("seconds"))
    _ratios_hold(document)
    assert "tiny/1ranks/gefen" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.distributed
def test_bench_portable_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks: Gefen bound to flattened slices under a codebook scope, through gefen-portable and
    portable DCP, against torch's optimizer state-dict API under FSDP2; a replicated-only adopter is
    skipped with its contract's reason."""
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    adopter = "meta_portable_sgd:factory"
    code = main(
        [
            "bench",
            "portable",
            "--models",
            "tiny",
            "--ranks",
            "2",
            "--optimizers",
            f"gefen,{adopter}",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    document = _check_files(tmp_path, "portable")
    report = read_report(tmp_path / "portable.json")
    operations = ("memory_export", "memory_import", "storage_export", "storage_import")
    metrics = {f"{op}_{kind}" for op in operations for kind in ("seconds", "peak_bytes_per_param")}
    metrics |= {"export_bytes_per_param", "disk_bytes_per_param"}
    for name in ("torch-adamw", "gefen"):
        assert {row.metric for row in report.rows if row.name == f"tiny/2ranks/{name}"} == metrics
    for size in ("export_bytes_per_param", "disk_bytes_per_param"):  # compact codes and block scales
        compact = report.row("tiny/2ranks/gefen", size)
        assert 1.0 < compact.value < report.row("tiny/2ranks/torch-adamw", size).value / 2, size
    seconds = report.row("tiny/2ranks/gefen", "storage_import_seconds")
    assert seconds.baseline == "tiny/2ranks/torch-adamw" and seconds.value > 0
    assert seconds.detail["layout"] == "flattened+codebook-scope"
    assert seconds.detail["per_rank_local_parameters"] == [15088, 15088]  # 30176 elements in halves
    assert report.row("tiny/2ranks/torch-adamw", "memory_export_seconds").detail["layout"] == "fsdp2"
    assert not any(row.name.endswith(adopter) for row in report.rows)
    assert any(note.startswith(f"{adopter}: not measured on more than one rank") for note in report.notes)
    _ratios_hold(document)
