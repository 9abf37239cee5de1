"""The ops (``torch.library`` qualified names) this package implements and the argument conventions they share.

gefen-core owns these ids, their signatures and their numerics (``gefen_core.ops`` and
``gefen_core.reference_ops``); gefen-kernels never imports gefen-core, so the ids and the
layout of the packed ``scalars`` tensor are restated here. A top-level test checks that
both packages agree.
"""

from __future__ import annotations

__all__ = [
    "GEFEN_OPS",
    "HOST_OPS",
    "HISTOGRAM_BINS",
    "MUON_NUM_SCALARS",
    "MUON_SCALAR_INDEX",
    "CODEBOOK_SIZE",
    "NUM_SCALARS",
    "SCALAR_INDEX",
]

#: Every op this package implements.
GEFEN_OPS = frozenset(
    {
        "gefen::block_step.v4",
        "gefen::codebook_solve.v2",
        "gefen::element_step.v2",
        "gefen::factored_stats.v2",
        "gefen::factored_moments.v3",
        "gefen::factored_step.v5",
        "gefen::histogram.v2",
        "gefen::stochastic_uniform.v1",
        "gefen::muon_momentum.v3",
    }
)

#: The ops whose inputs live on the host (a histogram): registered for the CPU only.
HOST_OPS = frozenset({"gefen::codebook_solve.v2"})

CODEBOOK_SIZE = 256
HISTOGRAM_BINS = 4096

#: Position of each step scalar in the fp32 ``scalars`` tensor (``gefen_core.step_scalars``).
SCALAR_INDEX = {
    "LR": 0,
    "INV_BC1": 1,
    "BC2": 2,
    "DECAY": 3,
    "BETA1": 4,
    "ONE_MINUS_BETA1": 5,
    "BETA2": 6,
    "ONE_MINUS_BETA2": 7,
    "EPS": 8,
}
NUM_SCALARS = 9
#: ``gefen::muon_momentum.v3``'s packet (``gefen_core.step_scalars.muon_scalars``): beta, 1 - beta.
MUON_SCALAR_INDEX = {"MUON_BETA": 0, "MUON_ONE_MINUS_BETA": 1}
MUON_NUM_SCALARS = 2
