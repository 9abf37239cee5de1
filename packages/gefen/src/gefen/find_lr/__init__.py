"""``gefen find-lr``: a learning-rate range test on any model.

:func:`lr_range_test` runs the test on a model, an iterable of batches, an optimizer factory
and a loss function; :func:`load_target` loads a user's ``MODULE:FUNCTION`` returning
``(model, batches[, loss_fn])``; :func:`demo_target` is the default (the demo decoder).
"""

from __future__ import annotations

from .range_test import NoFiniteLossError, RangeTestOptions, RangeTestResult, lr_range_test, ramp, suggest_lr
from .report import range_test_panels, range_test_report, range_test_table
from .target import DEFAULT_TARGET, LRTestTarget, TargetError, default_loss, demo_target, load_target

__all__ = [
    "DEFAULT_TARGET",
    "LRTestTarget",
    "NoFiniteLossError",
    "RangeTestOptions",
    "RangeTestResult",
    "TargetError",
    "default_loss",
    "demo_target",
    "load_target",
    "lr_range_test",
    "ramp",
    "range_test_panels",
    "range_test_report",
    "range_test_table",
    "suggest_lr",
]
