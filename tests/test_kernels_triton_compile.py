"""Every Triton kernel compiles for a CUDA GPU, checked on a machine without one.

The parity tests run the kernels under ``TRITON_INTERPRET=1``, which executes the Python of a
kernel and so accepts what compiled Triton refuses (a plain module ``int`` read by a kernel
passed the interpreter and failed on an H200). Triton's compiler runs without a GPU: this test
compiles each kernel, in the configurations the ops launch, down to a ``cubin`` for ``sm_90``
(Triton's bundled ``ptxas``), in a fresh interpreter without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip("triton")

#: Pointer and scalar types of the kernels' arguments, by name (a case overrides some).
_TYPES = {
    "p_ptr": "*fp32",
    "g_ptr": "*fp32",
    "q_ptr": "*u8",
    "mag_ptr": "*fp32",
    "v_ptr": "*fp32",
    "rf_ptr": "*fp32",
    "vc_ptr": "*fp32",
    "cb_ptr": "*fp32",
    "sc_ptr": "*fp32",
    "seed_ptr": "*i64",
    "out_ptr": "*fp32",
    "table_ptr": "*i64",
    "starts_ptr": "*i64",
    "row_part_ptr": "*fp64",
    "col_part_ptr": "*fp64",
    "v_row_ptr": "*fp32",
    "v_col_ptr": "*fp32",
    "counts_ptr": "*i64",
    "index_ptr": "*i64",
    "blocks": "i32",
    "period": "i32",
    "numel": "i32",
    "ncols": "i32",
    "nrows": "i32",
    "rows_per_group": "i32",
    "tiles": "i32",
    "groups": "i32",
    "entries": "i32",
    "n": "i32",
    "sign": "fp32",
}
_STEP = {"ROWS": 4, "COLS": 256, "STOCHASTIC": True, "APPLY_DECAY": True, "F64": False}


def _cases(tl: Any) -> list[tuple[str, dict[str, str], dict[str, Any]]]:
    """(kernel, type overrides, constexprs) for each configuration the ops launch."""
    bf16, f64 = {"p_ptr": "*bf16", "g_ptr": "*bf16"}, {"p_ptr": "*fp64", "g_ptr": "*fp64"}
    cases: list[tuple[str, dict[str, str], dict[str, Any]]] = [
        ("block_step_kernel", {}, _STEP),
        ("block_step_kernel", bf16, {**_STEP, "STOCHASTIC": False}),
        ("element_step_kernel", {}, _STEP),
        ("element_step_kernel", f64, {**_STEP, "F64": True}),
        ("factored_step_kernel", {}, {**_STEP, "ROW_BLOCKS": True}),
        ("factored_step_kernel", bf16, {**_STEP, "ROW_BLOCKS": False, "APPLY_DECAY": False}),
        ("muon_momentum_kernel", {"g_ptr": "*bf16", "out_ptr": "*bf16"}, {"ROWS": 4, "COLS": 256, "STOCHASTIC": True,
                                                                          "NESTEROV": True, "OUT_BF16": True}),
        ("factored_stats_kernel", {"g_ptr": "*bf16"}, {"RB": 16, "CT": 256}),
        ("factored_moments_kernel", {}, {"BLOCK": 1024}),
        ("moments_list_kernel", {}, {"BLOCK": 1024}),
        ("sums_list_kernel", {}, {"BLOCK": 1024}),
        ("histogram_kernel", {"g_ptr": "*fp16"}, {"ROWS": 4, "COLS": 256}),
        ("uniform_kernel", {}, {"BLOCK": 128}),
    ]  # fmt: skip
    for kind, dtype, row_blocks in ((0, tl.uint16, False), (1, tl.float32, False), (2, tl.float64, True)):
        constexprs = {**_STEP, "KIND": kind, "P_DTYPE": dtype, "F64": dtype is tl.float64, "ROW_BLOCKS": row_blocks}
        cases.append(("step_list_kernel", {}, {**constexprs, "SEARCH": 3}))
    cases.append(
        ("step_list_kernel", {}, {**_STEP, "KIND": 2, "P_DTYPE": tl.float16, "ROW_BLOCKS": False, "SEARCH": 1})
    )
    for out_bf16, dtype in ((True, tl.uint16), (False, tl.float32)):
        muon = {"ROWS": 4, "COLS": 256, "STOCHASTIC": out_bf16, "NESTEROV": out_bf16, "OUT_BF16": out_bf16}
        cases.append(("muon_list_kernel", {}, {**muon, "G_DTYPE": dtype, "SEARCH": 2}))
    cases.append(("stats_list_kernel", {}, {"G_DTYPE": tl.uint16, "RB": 16, "CT": 256, "SEARCH": 3}))
    cases.append(("histogram_list_kernel", {}, {"G_DTYPE": tl.float32, "ROWS": 4, "COLS": 256, "SEARCH": 2}))
    return cases


def main() -> int:
    """Compile every case; print one line each; 1 if any failed."""
    import gefen_kernels.triton_elements as elements
    import gefen_kernels.triton_kernels as kernels
    import gefen_kernels.triton_muon as muon
    import gefen_kernels.triton_statistics as statistics
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failed = 0
    for name, types, constexprs in _cases(tl):
        fn = next(getattr(module, name) for module in (kernels, statistics, muon, elements) if hasattr(module, name))
        signature = {arg: "constexpr" if arg in constexprs else {**_TYPES, **types}[arg] for arg in fn.arg_names}
        try:
            compiled = triton.compile(
                ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                target=GPUTarget("cuda", 90, 32),
                options={"enable_fp_fusion": False},
            )
            assert "cubin" in compiled.asm, "no cubin"
            print(f"compiled {name} {sorted(constexprs.items(), key=str)}")
        except Exception as exc:  # report every failing kernel, not the first
            failed += 1
            print(f"FAILED {name} {constexprs}: {type(exc).__name__}: {exc}")
    return 1 if failed else 0


def test_every_triton_kernel_compiles_for_a_cuda_gpu() -> None:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "0"  # the ops pass enable_fp_fusion=False; silences the default's warning
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("compiled ") == len(_cases(__import__("triton.language").language)), done.stdout


if __name__ == "__main__":
    sys.exit(main())
