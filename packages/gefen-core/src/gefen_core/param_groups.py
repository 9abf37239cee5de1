"""Validation of Gefen's hyperparameters, per-group options and parameters.

Everything here checks and normalises without touching the optimizer, so constructors and
``add_param_group`` can validate a whole group before anything is registered, and
``preflight_step`` can re-check groups that schedulers or users edited.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .distributed import check_parameter_layout
from .errors import GefenOptionError, GefenOptionTypeError, ParameterError

__all__ = [
    "GROUP_OPTIONS",
    "SUPPORTED_DTYPES",
    "check_group_options",
    "check_parameters",
    "flag_option",
    "lr_option",
    "normalize_group_options",
    "optimizer_wide",
    "place",
    "placed",
    "real_option",
    "refuse_edited_groups",
    "refuse_optimizer_wide",
    "where_prefix",
]

#: Options a parameter group may override (everything else is optimizer-wide).
GROUP_OPTIONS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "maximize",
    "factored_v_2d",
    "min_dim_size_to_factor",
    "clip_threshold",
    "force_1d_period_one",
    "force_2d_period_one",
    "period_one_substrings",
)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def where_prefix(group: int | None) -> str:
    """``"param_groups[i]: "`` for messages about group ``i`` (empty for constructor defaults)."""
    return "" if group is None else f"param_groups[{group}]: "


def real_option(value: object, name: str, group: int | None) -> float:
    """A finite real number (``bool`` refused; numpy's scalars taken, as torch's AdamW takes
    them) as a Python float, so a state dict holds no numpy object."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise GefenOptionTypeError(f"{where_prefix(group)}{name} must be a real number, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise GefenOptionError(f"{where_prefix(group)}Invalid {name} value: {value!r} (must be finite)")
    return number


def lr_option(value: object, group: int | None, read_tensor: bool) -> float | torch.Tensor:
    """A learning rate: a float >= 0 or a 1-element floating tensor (its value read only with ``read_tensor``)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise GefenOptionError(f"{where_prefix(group)}Invalid learning rate: a tensor lr must be 1-element")
        if not value.is_floating_point():
            raise GefenOptionTypeError(f"{where_prefix(group)}a tensor lr must be floating point, got {value.dtype}")
        if value.requires_grad:
            raise GefenOptionError(f"{where_prefix(group)}a tensor lr must not require grad")
        if not read_tensor or value.device.type == "meta":
            return value
        number = float(value.detach().reshape(()).item())
        if not math.isfinite(number) or number < 0:
            raise GefenOptionError(f"{where_prefix(group)}Invalid learning rate: {number} (must be finite and >= 0)")
        return value
    number = real_option(value, "learning rate", group)
    if number < 0:
        raise GefenOptionError(f"{where_prefix(group)}Invalid learning rate: {number} (must be >= 0)")
    return number


def _betas(value: object, group: int | None) -> tuple[float, float]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)) or len(value) != 2:
        raise GefenOptionTypeError(f"{where_prefix(group)}betas must be a pair (beta1, beta2), got {value!r}")
    out = []
    for index, beta in enumerate(value):
        number = real_option(beta, f"beta parameter at index {index}", group)
        if not 0.0 <= number < 1.0:
            raise GefenOptionError(
                f"{where_prefix(group)}Invalid beta parameter at index {index}: {number} (must be in [0, 1))"
            )
        out.append(number)
    return out[0], out[1]


def flag_option(value: object, name: str, group: int | None) -> bool:
    """An exact ``bool``."""
    if type(value) is not bool:
        raise GefenOptionTypeError(f"{where_prefix(group)}{name} must be a bool, got {type(value).__name__}")
    return value


def _substrings(value: object, group: int | None) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
        raise GefenOptionTypeError(
            f"{where_prefix(group)}period_one_substrings must be a tuple of strings, got {type(value).__name__}"
        )
    for index, item in enumerate(value):
        if type(item) is not str or not item:
            raise GefenOptionTypeError(f"{where_prefix(group)}period_one_substrings[{index}] must be a non-empty str")
    return tuple(value)


def _clip_threshold(value: object, group: int | None) -> float | None:
    if value is None:
        return None
    threshold = real_option(value, "clip_threshold", group)
    if threshold <= 0:
        raise GefenOptionError(
            f"{where_prefix(group)}Invalid clip_threshold value: {threshold} (must be > 0, or None to turn clipping off)"
        )
    return threshold


def _min_dim(value: object, group: int | None) -> int:
    if type(value) is not int:
        raise GefenOptionTypeError(
            f"{where_prefix(group)}min_dim_size_to_factor must be an int, got {type(value).__name__}"
        )
    if value < 0:
        raise GefenOptionError(f"{where_prefix(group)}Invalid min_dim_size_to_factor value: {value} (must be >= 0)")
    return value


#: AdamW's options that Gefen accepts only as ``False`` (torch's defaults), and why: refused
#: wherever a group is read (the constructor, ``add_param_group``, a load, an import, a step
#: after a user edited the group), so none is ever ignored silently.
REFUSED_FLAGS = {
    "amsgrad": (
        "keeps each element's running maximum of v, but Gefen shares v across a block (or factors it by rows "
        "and columns) at about 1 byte/param; use ContractedAdamW (gefen_hybrid) or torch.optim.AdamW for AMSGrad"
    ),
    "differentiable": (
        "differentiates through the step, but Gefen's momentum is codes into a learned codebook, which carry no "
        "gradient; use torch.optim.AdamW(differentiable=True)"
    ),
}


def refuse_optimizer_wide(group: Mapping[str, Any], index: int, own: Mapping[str, object]) -> None:
    """Refuse a group that sets an optimizer-wide option (``own``: each with this optimizer's
    value) to another value: no group could change it, so it was kept in the group, written
    into checkpoints and silently not applied. The optimizer's own value is accepted, as
    groups copied from another optimizer's carry it. Asked of a new group and, before every
    step, of each live group (an edit such as ``group["stochastic_round"] = True``)."""
    for key, value in own.items():
        if key in group and group[key] != value:
            raise GefenOptionError(
                f"param_groups[{index}]: {key}={group[key]!r} is an option of the whole optimizer (this one has "
                f"{key}={value!r}), which a group cannot change; pass it to the constructor"
            )


def optimizer_wide(optimizer: Any) -> dict[str, object]:
    """Gefen's or GefenMuon's options of the whole optimizer, each with its value: a group may
    carry one only with that value (:func:`refuse_optimizer_wide`)."""
    own: dict[str, object] = {
        "fused": optimizer._dispatch.fused,
        "stochastic_round": optimizer._stochastic_round,
        "deterministic": optimizer._deterministic,
        "capturable": optimizer._capturable,
    }
    if hasattr(optimizer, "_refresh_every"):  # Gefen's codebook_refresh_every
        own["codebook_refresh_every"] = optimizer._refresh_every
    return own


def refuse_edited_groups(optimizer: Any) -> None:
    """Before a step: :func:`refuse_optimizer_wide` for each live group (an edit such as
    ``group["stochastic_round"] = True`` after the group was added)."""
    own = optimizer_wide(optimizer)
    for index, group in enumerate(optimizer.param_groups):
        refuse_optimizer_wide(group, index, own)


def normalize_group_options(
    options: Mapping[str, Any], group: int | None = None, *, read_tensor_lr: bool = True
) -> dict[str, Any]:
    """Validate the group options present in ``options`` and return them normalised.

    Raises :class:`GefenOptionError` / :class:`GefenOptionTypeError` naming the group and
    option. Only keys from :data:`GROUP_OPTIONS` are examined, and those of
    :data:`REFUSED_FLAGS` refused unless ``False``. A tensor ``lr``'s value is read (a device
    synchronisation) only with ``read_tensor_lr``.
    """
    for flag, why in REFUSED_FLAGS.items():
        if flag in options and flag_option(options[flag], flag, group):
            raise GefenOptionError(f"{where_prefix(group)}{flag}=True {why}")
    out: dict[str, Any] = {}
    if "lr" in options:
        out["lr"] = lr_option(options["lr"], group, read_tensor_lr)
    if "betas" in options:
        out["betas"] = _betas(options["betas"], group)
    if "eps" in options:
        eps = real_option(options["eps"], "epsilon", group)
        if eps <= 0:
            raise GefenOptionError(f"{where_prefix(group)}Invalid epsilon value: {eps} (must be finite and > 0)")
        out["eps"] = eps
    if "weight_decay" in options:
        decay = real_option(options["weight_decay"], "weight_decay", group)
        if decay < 0:
            raise GefenOptionError(f"{where_prefix(group)}Invalid weight_decay value: {decay} (must be >= 0)")
        out["weight_decay"] = decay
    if "min_dim_size_to_factor" in options:
        out["min_dim_size_to_factor"] = _min_dim(options["min_dim_size_to_factor"], group)
    if "clip_threshold" in options:
        out["clip_threshold"] = _clip_threshold(options["clip_threshold"], group)
    for flag in ("maximize", "factored_v_2d", "force_1d_period_one", "force_2d_period_one"):
        if flag in options:
            out[flag] = flag_option(options[flag], flag, group)
    if "period_one_substrings" in options:
        out["period_one_substrings"] = _substrings(options["period_one_substrings"], group)
    return out


def check_group_options(group: Mapping[str, Any], index: int) -> None:
    """Re-validate a live group (for example after a scheduler or a user edited it)."""
    missing = [name for name in GROUP_OPTIONS if name not in group]
    if missing:
        raise GefenOptionError(f"param_groups[{index}] is missing options {missing}")
    check_names(group, index)
    normalize_group_options(group, index, read_tensor_lr=False)


def check_names(group: Mapping[str, Any], index: int) -> None:
    """A named group must name each of its parameters (a tensor appended to its ``params`` list
    by hand has no name: the step read past the names with an ``IndexError``)."""
    names = group.get("param_names")
    if names is not None and len(names) != len(group["params"]):
        raise ParameterError(
            f"param_groups[{index}] lists {len(group['params'])} parameters but {len(names)} param_names; "
            "add parameters with add_param_group (a named group needs a name for each)"
        )
    if names is None and group.get("period_one_substrings"):  # set on the live group: it could never act
        raise GefenOptionError(
            f"param_groups[{index}]: period_one_substrings needs named parameters, and this group's are unnamed"
        )


def place(group: int, position: int, name: object = None) -> str:
    """Where a parameter sits, spelled as torch's messages spell it, with its name if it has one."""
    return f"param_groups[{group}]['params'][{position}]" + (f" ({name!r})" if name else "")


def placed(params: list[Any], group: int | None) -> Iterator[tuple[str, Any]]:
    """Each entry of a group's ``params`` (a named pair unpacked) with its :func:`place`
    (``params[i]`` without a group: the functional form's)."""
    for position, param in enumerate(params):
        name, tensor = param if isinstance(param, tuple) and len(param) == 2 else (None, param)
        yield (place(group, position, name) if group is not None else f"params[{position}]"), tensor


def check_parameters(params: list[Any], group: int | None = None, *, optimizer: str = "Gefen") -> None:
    """Every parameter must be a real floating tensor ``optimizer`` supports, in a supported layout."""
    for where, param in placed(params, group):
        if not isinstance(param, torch.Tensor):
            continue  # torch's add_param_group raises its own TypeError
        if param.is_complex():
            raise ParameterError(f"{where}: {optimizer} does not support complex parameters ({param.dtype})")
        if param.dtype not in SUPPORTED_DTYPES:
            raise ParameterError(
                f"{where}: dtype {param.dtype} is not supported (use float32, bfloat16, float16 or float64)"
            )
        if param.layout is not torch.strided:
            raise ParameterError(f"{where}: only strided (dense) parameters are supported, got {param.layout}")
        check_parameter_layout(param, where)
