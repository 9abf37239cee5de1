"""Workspace-wide pytest configuration: the hypothesis profiles (CI caps examples)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("dev", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Triton reads TRITON_INTERPRET when `triton.language` is first imported, and TorchDynamo
# imports it on the first `torch.compile` call, whichever test makes it. On a machine
# without an NVIDIA driver the Triton kernels can only run in the interpreter, so turn it
# on before any test imports Triton (an explicit setting is respected).
if not os.path.exists("/proc/driver/nvidia/version"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
