"""Names and version of Gefen's native state-dict format (``gefen.native_state`` v10).

::

    {
      "state": {pid: {"step": int,
                      "m_codes": uint8[*shape], "m_magnitude": fp32[S],
                      "vmean": fp32[S], "vmean_step": int}                          # block
                 | {..., "v_row": fp32[R], "v_col": fp32[K], "factored_step": int}   # factored
             },
      "param_groups": [{"params": [pid, ...], "lr", "betas", "eps", "weight_decay", "maximize",
                        "factored_v_2d", "min_dim_size_to_factor", "clip_threshold", "force_1d_period_one", "force_2d_period_one",
                        "period_one_substrings", ["param_names"], <other keys kept>,
                        "_gefen_checkpoint_metadata": <mirror>}],
      "gefen_format_version": 10,
      "gefen_global_step": int,
      "gefen_codebook": fp32[256],                 # zeros until one is learned
      "gefen_codebook_learned": bool,
      "gefen_deterministic": bool,
      "gefen_state_digest": {"layout": str, "content": str | None},   # gefen_core.native_records
    }

The state tensors are shaped like their parameter (:mod:`gefen_core.state_placement`: codes
of the parameter's ``shape``, ``S = [rows, row_length / P]`` scales for a parameter of two or
more dimensions, ``[ceil(numel / P)]`` otherwise (ragged blocks: only ``P = 2048``); the block period ``P`` is not stored, the scales'
shape gives it) and, for a DTensor (FSDP2) parameter, are
DTensors placed like it (``v_col`` replicated), so torch's DCP reshards them N -> M.

``<mirror>`` is the JSON string of ``{"codebook", "codebook_learned", "deterministic", "format":
"gefen.native_state", "format_version": 10, "global_step", "state_digest"}`` (the same values,
the codebook as its 256 floats; sorted keys, no whitespace), repeated in every group because
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` keeps only ``state`` and
``param_groups``. A string, so that DCP writes it as one item where a dict costs one per
leaf, per parameter under ``flatten_optimizer_state_dict=True``
(:mod:`gefen_core.native_records`). Parameter ids are the positions in ``param_groups`` order (ints), or any
unique keys (torch's DCP helpers pass FQN strings); they are matched by position.
Only tensors and primitives appear, so ``torch.load(weights_only=True)`` reads it.

Differences from the reference implementation's format: no per-parameter ``name`` (names
live in the groups' ``param_names``, as in torch), ``betas`` instead of ``beta1``/``beta2``,
counters are always ints (also under ``capturable``), no ``device_anchor``, state shaped like
the parameter (so one checkpoint loads on any number of ranks), and its own format name and
version. The codes and scales hold the EMA of the preconditioned gradient ``g / (sqrt(V) + eps)``
(since ``gefen::block_step.v2`` and ``gefen::factored_step.v3``). Version 9 held the mirror as
a dict (eight DCP items per group, and per parameter in torch's flattened recipe; refused naming
both versions). Version 8 had no
``min_dim_size_to_factor`` group option and no ``element`` variant (it factored every matrix;
refused naming both versions, as a group without the option cannot say which second moment its
narrow matrices keep). Version 7 named the codes
``m_codebook`` (they are codes into the codebook, not a codebook; refused naming both
versions). Version 6 also stored each entry's period
as ``automatic_period``, which the scales' shape already gave (one pickled item per parameter in
torch's DCP recipe; refused naming both versions). Version 5 had no ``clip_threshold`` group
option (its factored matrices stepped unclipped; refused naming both versions, as a group
without the option cannot say which update it was trained with). Version 4 had no ``state_digest`` (a
flipped bit loaded silently; refused naming both versions). Version 3 had the same shapes but held the
EMA of ``g`` itself (a different quantity: refused, not converted); version 2 held blocked
``[B, P]`` tensors and a per-rank topology record.
"""

from __future__ import annotations

from .native_records import DIGEST_FIELD, GROUP_MIRROR, NativeFormat

__all__ = [
    "CODEBOOK",
    "CODEBOOK_LEARNED",
    "FORMAT",
    "DETERMINISTIC",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "GLOBAL_STEP",
    "GROUP_MIRROR",
    "STATE_DIGEST",
    "TOP_LEVEL_KEYS",
    "VERSION",
]

FORMAT_NAME = "gefen.native_state"
VERSION = 10

FORMAT_VERSION = "gefen_format_version"
GLOBAL_STEP = "gefen_global_step"
CODEBOOK = "gefen_codebook"
CODEBOOK_LEARNED = "gefen_codebook_learned"
DETERMINISTIC = "gefen_deterministic"
STATE_DIGEST = DIGEST_FIELD[1]

TOP_LEVEL_KEYS = (FORMAT_VERSION, GLOBAL_STEP, CODEBOOK, CODEBOOK_LEARNED, DETERMINISTIC, STATE_DIGEST)

#: The format's record, for :mod:`gefen_core.native_records`.
FORMAT = NativeFormat(
    FORMAT_NAME,
    VERSION,
    (
        ("global_step", GLOBAL_STEP),
        ("codebook", CODEBOOK),
        ("codebook_learned", CODEBOOK_LEARNED),
        ("deterministic", DETERMINISTIC),
        DIGEST_FIELD,
    ),
    "Gefen",
)
assert FORMAT.top_level_keys == TOP_LEVEL_KEYS
