"""Print issue 21's size figures: product lines, methods and class lines of each optimizer, and
the contracts' top-level names (``uv run python tools/house_figures.py``).

The fifth figure, frames from ``optimizer.step()`` to the arithmetic, is pinned by
``tests/test_kernels_fused_modes.py::test_the_fused_step_reaches_the_c_kernels_within_five_python_frames``.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def product_lines() -> dict[str, int]:
    """Lines of Python and C under each package's ``src`` (tests, docs and tools excluded)."""
    counts = {}
    for src in sorted(ROOT.glob("packages/*/src")):
        files = [p for p in src.rglob("*") if p.suffix in (".py", ".c") and "__pycache__" not in p.parts]
        counts[src.parent.name] = sum(len(p.read_text().splitlines()) for p in files)
    return counts


def methods(cls: type) -> tuple[int, int]:
    """(public, private) methods and properties of ``cls`` beyond ``torch.optim.Optimizer``'s."""
    inherited = set(dir(torch.optim.Optimizer))
    names = []
    for name in dir(cls):
        if name in inherited or name.startswith("__"):
            continue
        value = inspect.getattr_static(cls, name)
        if isinstance(value, (property, staticmethod, classmethod)) or inspect.isfunction(value):
            names.append(name)
    public = sum(1 for name in names if not name.startswith("_"))
    return public, len(names) - public


def class_lines(cls: type) -> int:
    return len(inspect.getsource(cls).splitlines())


def main() -> None:
    import gefen_contracts
    from gefen_core import Gefen, GefenMuon
    from gefen_hybrid import CompositeOptimizer, ContractedAdamW

    lines = product_lines()
    for package, count in lines.items():
        print(f"{package:18} {count:6d} lines")
    print(f"{'product lines':18} {sum(lines.values()):6d}")
    for cls in (Gefen, GefenMuon, ContractedAdamW, CompositeOptimizer):
        public, private = methods(cls)
        print(
            f"{cls.__name__:18} {public + private:3d} methods beyond Optimizer ({public} public), "
            f"class {class_lines(cls)} lines, bases {[base.__name__ for base in cls.__bases__]}"
        )
    print(f"{'gefen_contracts':18} {len(gefen_contracts.__all__):3d} top-level names")


if __name__ == "__main__":
    main()
