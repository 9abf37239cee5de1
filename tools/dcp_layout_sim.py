"""What torch's checkpoint recipe would cost with Gefen's state *packed*: a stand-in optimizer.

Issue 16 asks for <= 1.05 B/param on disk and <= 0.5x torch AdamW's save and load time through
torch's recipe (``get_optimizer_state_dict`` -> ``dcp.save``; template -> ``dcp.load`` ->
``set_optimizer_state_dict``) at 1-3 FSDP2 ranks. DCP writes every state tensor shard and every
integer as an item of its own (about 1.5-2 KB of framing and one ``torch.load`` each), so the
figure depends on how many entries each parameter's state has, not only on its bytes. This
optimizer holds the layout a packed state would have, and nothing else: per parameter one
``uint8`` tensor sharded like the parameter (a matrix ``[R, C + 8]``: the codes and 8 bytes per
row for its scale and ``v_row``; a vector ``[N]``, its per-block scale and ``vmean`` left out:
8 bytes a block of up to 2048), for a matrix ``v_col`` fp32 ``[C]``
replicated, and one int64 ``[2]`` counter pair; the group options are Gefen's, its optimizer-wide
record one JSON string. Its ``step`` only creates that state (it updates nothing) and its
``load_state_dict`` only copies the loaded tensors in (torch's would cast the codes to the
parameter's dtype), so a run measures the layout's checkpoint cost and no arithmetic::

    PYTHONPATH=tools uv run gefen bench dcp --ranks 1,3 --optimizers recipe:gefen,recipe:dcp_layout_sim:factory
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

__all__ = ["PackedLayoutSim", "factory"]

#: Bytes a packed matrix row carries after its codes: the row's fp32 scale and fp32 ``v_row``.
ROW_TAIL = 8


def _shaped_like(
    param: torch.Tensor, local: torch.Tensor, shape: Sequence[int], placements: Sequence[Placement]
) -> Any:
    """``local`` as this rank's part of a global ``shape`` on ``param``'s mesh (plain when
    ``param`` is plain)."""
    if not isinstance(param, DTensor):
        return local
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return DTensor.from_local(
        local, param.device_mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
    )


class PackedLayoutSim(torch.optim.Optimizer):
    """The packed layout's state for every parameter with a gradient (module docstring)."""

    def __init__(self, params: Any, lr: float = 1e-3) -> None:
        record = json.dumps({"codebook": [round(-1 + 2 * i / 255, 6) for i in range(256)], "format": 10})
        defaults = {
            "lr": lr,
            "betas": (0.9, 0.999),
            "eps": 1e-8,
            "weight_decay": 0.01,
            "min_dim_size_to_factor": 128,
            "clip_threshold": None,
            "maximize": False,
            "factored_v_2d": True,
            "force_1d_period_one": False,
            "force_2d_period_one": False,
            "period_one_substrings": (),
            "_gefen_checkpoint_metadata": record,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None or self.state[param]:
                    continue
                local = param.to_local() if isinstance(param, DTensor) else param
                if param.dim() == 2:
                    rows, cols = param.shape
                    packed = torch.zeros(local.shape[0], cols + ROW_TAIL, dtype=torch.uint8, device=local.device)
                    state = {
                        "packed": _shaped_like(param, packed, (rows, cols + ROW_TAIL), [Shard(0)]),
                        "v_col": _shaped_like(param, torch.zeros(cols, device=local.device), (cols,), [Replicate()]),
                    }
                else:
                    codes = torch.zeros(local.shape, dtype=torch.uint8, device=local.device)
                    state = {"packed": _shaped_like(param, codes, tuple(param.shape), [Shard(0)])}
                state["counters"] = torch.zeros(2, dtype=torch.int64, device=local.device)
                self.state[param] = state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        # saved groups list their parameters' keys (ids, or FQNs through torch's recipe) in order
        by_key: dict[Any, torch.Tensor] = {}
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update({key: value for key, value in saved.items() if key != "params"})
            by_key.update(zip(saved["params"], group["params"], strict=True))
        loaded = {by_key[key]: {k: v.clone() for k, v in entry.items()} for key, entry in state_dict["state"].items()}
        self.state = defaultdict(dict, loaded)


def factory(named: Sequence[tuple[str, torch.nn.Parameter]]) -> PackedLayoutSim:
    """The benchmark's ``MODULE:FACTORY`` entry point."""
    return PackedLayoutSim([p for _, p in named], lr=1e-3)
