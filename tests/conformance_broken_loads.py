"""Deliberately broken adopters whose loads or steps go wrong (a checkpoint kept in part, a rate
read once, a stage that changes the optimizer): each must fail the conformance kit.
:mod:`conformance_broken_adopters` builds their factories and names the check each fails."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from gefen_contracts import (
    FEATURE_STAGED_NATIVE_LOAD,
    FeatureStatus,
    OptimizerContract,
)
from gefen_contracts.enums import LoadAtomicity
from gefen_contracts.transactions import StagedTransaction
from gefen_example_sgd import CONTRACT, ContractedSGD


class KeepsItsOwnRates(ContractedSGD):
    """Loads the state but keeps the live learning rates (a resumed schedule restarts); passed
    while the kit loaded into twins built with the source's rates."""

    def stage_state_dict(self, state_dict: Any) -> StagedTransaction:
        groups = [{**saved, "lr": live["lr"]} for saved, live in zip(state_dict["param_groups"], self.param_groups)]
        return super().stage_state_dict({**state_dict, "param_groups": groups})


class WritesSavedRatesFirst(ContractedSGD):
    """Publishes the saved learning rates before the load is validated (unseen while the
    source's rates equalled the target's)."""

    def load_state_dict(self, state_dict: Any) -> None:
        for live, saved in zip(self.param_groups, state_dict.get("param_groups", [])):
            if isinstance(saved, dict) and type(saved.get("lr")) is float:
                live["lr"] = saved["lr"]
        super().load_state_dict(state_dict)


class FlatBufferAboveTwoDimensions(ContractedSGD):
    """Declares a buffer shaped like the parameter but keeps a flat one for 3-D and larger
    parameters, which the kit model (1-D and 2-D) never holds."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for parameter, state in self.state.items():
            state["momentum_buffer"] = state["momentum_buffer"].reshape(parameter.shape)
        loss = super().step(closure)
        for parameter, state in self.state.items():
            if parameter.dim() >= 3:
                state["momentum_buffer"] = state["momentum_buffer"].reshape(-1)
        return loss


class CountsOnlyInInit(ContractedSGD):
    """Sets its mutation counter in ``__init__`` only: torch's ``__setstate__`` restores
    defaults, state and groups, so a deep copy or an unpickled optimizer cannot step (the
    example adopter shipped this until 2026-12-06)."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        torch.optim.Optimizer.__setstate__(self, state)


class AliasingLoad(ContractedSGD):
    """Its staged load keeps the caller's momentum tensors (no copy): every later step rewrites
    the checkpoint dict it was loaded from."""

    def stage_state_dict(self, state_dict: Any) -> StagedTransaction:
        staged = super().stage_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        saved = {params[k]: state_dict["state"][pid] for k, pid in enumerate(ids) if pid in state_dict["state"]}
        for param, entry in staged._payload[1].items():
            entry["momentum_buffer"] = saved[param]["momentum_buffer"]
        return staged


class RestoresOnlyTheRate(ContractedSGD):
    """Loads ``lr`` but keeps its live momentum and weight decay (a scheduled momentum, as
    ``OneCycleLR`` cycles it, restarts)."""

    def stage_state_dict(self, state_dict: Any) -> StagedTransaction:
        staged = super().stage_state_dict(state_dict)
        for new, live in zip(staged._payload[0], self.param_groups):
            new.update(momentum=live["momentum"], weight_decay=live["weight_decay"])
        return staged


class DropsSchedulerKeys(ContractedSGD):
    """Loads its own options only and drops any other saved group key (``initial_lr``: a
    scheduler resumed with ``last_epoch`` raises ``KeyError``)."""

    def stage_state_dict(self, state_dict: Any) -> StagedTransaction:
        staged = super().stage_state_dict(state_dict)
        groups = staged._payload[0]
        for index, new in enumerate(groups):
            groups[index] = {key: new[key] for key in ("params", "lr", "momentum", "weight_decay")}
        return staged


class MergingCommit(ContractedSGD):
    """Merges the loaded state into the live state: a parameter without saved state keeps its
    old momentum (a rollback to a step-0 checkpoint does not roll back)."""

    def commit_staged_state_dict(self, staged: StagedTransaction) -> None:
        groups, state = staged.claim(self, kind="native_load", current_token=self._version)  # type: ignore[misc]
        for live, new in zip(self.param_groups, groups):
            live.update(new)
        self.state.update(state)
        self._version += 1


class RequiresFullState(ContractedSGD):
    """Refuses a checkpoint in which a parameter has no state (saved before the first step, or
    a parameter that never had a gradient): valid torch checkpoints."""

    def stage_state_dict(self, state_dict: Any) -> StagedTransaction:
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        if any(i not in state_dict["state"] for i in ids):
            raise ValueError("a parameter has no saved state")
        return super().stage_state_dict(state_dict)


class CommitKeepsToken(ContractedSGD):
    """A commit does not change its freshness token: a load staged before another load was
    committed commits too, replacing the newer one."""

    def commit_staged_state_dict(self, staged: StagedTransaction) -> None:
        version = self._version
        super().commit_staged_state_dict(staged)
        self._version = version


class SkipsLoadHooks(ContractedSGD):
    """Stages and commits without torch's load hooks (a pre-hook that migrates old checkpoints
    never runs)."""

    def load_state_dict(self, state_dict: Any) -> None:
        self.commit_staged_state_dict(self.stage_state_dict(state_dict))


class UncheckedOptions(ContractedSGD):
    """Validates the state but takes the saved group options unchecked: a checkpoint with
    ``lr=nan`` loads, and the next step makes every parameter NaN."""

    unchecked = ("lr", "momentum", "weight_decay")

    def stage_state_dict(self, state_dict: Any) -> StagedTransaction:
        plain = [{**group, **dict.fromkeys(self.unchecked, 0.5)} for group in state_dict["param_groups"]]
        staged = super().stage_state_dict({**state_dict, "param_groups": plain})
        for new, saved in zip(staged._payload[0], state_dict["param_groups"]):
            new.update({key: saved[key] for key in self.unchecked})
        return staged


class ChecksTheRateOnly(UncheckedOptions):
    """Checks the saved ``lr`` but takes the other options unchecked (``momentum=nan`` loads);
    passed while the kit corrupted only the first float option."""

    unchecked = ("momentum", "weight_decay")


class TestsForNaNOnly(ContractedSGD):
    """Refuses a NaN in the momentum but takes an infinity (``isnan`` where ``isfinite``
    belongs); passed while the kit planted NaNs only."""

    def stage_state_dict(self, state_dict: Any) -> StagedTransaction:
        entries = state_dict["state"]
        if any(bool(torch.isnan(entry["momentum_buffer"]).any()) for entry in entries.values()):
            raise ValueError("a NaN in the momentum")
        finite = {
            pid: {**entry, "momentum_buffer": entry["momentum_buffer"].nan_to_num(posinf=0.0, neginf=0.0)}
            for pid, entry in entries.items()
        }
        staged = super().stage_state_dict({**state_dict, "state": finite})
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for pid, param in zip(ids, params, strict=True):  # the infinities back, as saved
            if pid in entries:
                staged._payload[1][param]["momentum_buffer"] = entries[pid]["momentum_buffer"].clone()
        return staged


class FirstGroupOptionsEverywhere(ContractedSGD):
    """Loads the first saved group's options into every group (unseen while the factory built
    one group)."""

    def stage_state_dict(self, state_dict: Any) -> StagedTransaction:
        staged = super().stage_state_dict(state_dict)
        first = {k: v for k, v in staged._payload[0][0].items() if k != "params"}
        for group in staged._payload[0][1:]:
            group.update(first)
        return staged


_NON_ATOMIC = dataclasses.replace(
    CONTRACT,
    capabilities=dataclasses.replace(
        CONTRACT.capabilities,
        checkpoints=tuple(
            dataclasses.replace(c, atomicity=LoadAtomicity.NONE) for c in CONTRACT.capabilities.checkpoints
        ),
        features={
            **CONTRACT.capabilities.features,
            FEATURE_STAGED_NATIVE_LOAD: FeatureStatus.no("torch's own load_state_dict"),
        },
    ),
)


class LaxNonAtomicLoad(ContractedSGD):
    """Claims native checkpoints without atomicity and loads through torch's own
    ``load_state_dict``, which takes a buffer of the wrong shape or dtype, or a NaN, silently
    (every corruption check was gated on an atomic claim)."""

    def optimizer_contract(self) -> OptimizerContract:
        return _NON_ATOMIC

    def load_state_dict(self, state_dict: Any) -> None:
        torch.optim.Optimizer.load_state_dict(self, state_dict)


class WritesEntriesInTurn(ContractedSGD):
    """Validates the groups, then validates and copies each state entry into the live buffers
    in turn: a checkpoint bad in its last entry is refused with the others already written."""

    def load_state_dict(self, state_dict: Any) -> None:
        staged_groups = ContractedSGD.stage_state_dict(self, {**state_dict, "state": {}})
        params = dict(zip([i for g in state_dict["param_groups"] for i in g["params"]], self._params()))
        for pid, entry in state_dict["state"].items():
            ContractedSGD.stage_state_dict(self, {**state_dict, "state": {pid: entry}})  # this entry only
            live = self.state.get(params[pid])
            if live:
                live["momentum_buffer"].copy_(entry["momentum_buffer"])
                live["step"] = entry["step"]
            else:
                self.state[params[pid]] = {"momentum_buffer": entry["momentum_buffer"].clone(), "step": entry["step"]}
        groups, _ = staged_groups.claim(self, kind="native_load", current_token=self._version)  # type: ignore[misc]
        for live, new in zip(self.param_groups, groups):
            live.update(new)
        self._version += 1

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]


class DecaysWithoutTheRate(ContractedSGD):
    """Claims torch's recipe (as the example does) but shrinks every parameter with a gradient
    by its weight decay whatever the learning rate, so the recipe's zero-gradient ``lr=0``
    template step moves the model it loads into."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.mul_(1.0 - group["weight_decay"])
        return super().step(closure)


class PeeksAtStateWhileStaging(ContractedSGD):
    """Looks at ``self.state[p]`` while staging: torch's state is a defaultdict, so a fresh
    optimizer gains an empty entry per parameter (its own checkpoint then fails to load); a
    trained optimizer's full state hid it."""

    def stage_state_dict(self, state_dict: Any) -> StagedTransaction:
        for group in self.param_groups:
            for param in group["params"]:
                _ = self.state[param]
        return super().stage_state_dict(state_dict)


class ReshapesSameCount(ContractedSGD):
    """Accepts a momentum buffer of another shape with its parameter's element count and
    reshapes it (a transposed layer's checkpoint loads silently)."""

    def stage_state_dict(self, state_dict: Any) -> StagedTransaction:
        params = [p for group in self.param_groups for p in group["params"]]
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        shapes = {pid: p.shape for pid, p in zip(ids, params)}
        state = {}
        for pid, entry in state_dict["state"].items():
            buffer = entry.get("momentum_buffer") if isinstance(entry, dict) else None
            if isinstance(buffer, torch.Tensor) and pid in shapes and buffer.numel() == shapes[pid].numel():
                entry = {**entry, "momentum_buffer": buffer.reshape(shapes[pid])}
            state[pid] = entry
        return super().stage_state_dict({**state_dict, "state": state})


class ChecksKeysAndDtypesWhileWriting(WritesEntriesInTurn):
    """Checks every entry's shape and values before it writes anything, but each entry's keys
    and dtype only as it writes that entry: a checkpoint with a missing key or a wrong dtype in
    its last entry is refused with the others written. Passed while those classes corrupted
    the first entry only."""

    def load_state_dict(self, state_dict: Any) -> None:
        lenient = {
            pid: {"momentum_buffer": entry["momentum_buffer"].to(torch.float32), "step": entry["step"]}
            for pid, entry in state_dict["state"].items()
            if isinstance(entry, dict) and isinstance(entry.get("momentum_buffer"), torch.Tensor) and "step" in entry
        }
        ContractedSGD.stage_state_dict(self, {**state_dict, "state": lenient})  # shapes and values
        super().load_state_dict(state_dict)


class WritesGroupsInTurn(ContractedSGD):
    """Validates the state, then checks and writes each group's options in turn: a checkpoint
    whose last group is bad is refused with the first group's options written."""

    def load_state_dict(self, state_dict: Any) -> None:
        valid_options = {option: 0.5 for option in ("lr", "momentum", "weight_decay")}
        masked = [{**group, **valid_options} for group in state_dict["param_groups"]]
        staged = ContractedSGD.stage_state_dict(self, {**state_dict, "param_groups": masked})
        for live, saved in zip(self.param_groups, state_dict["param_groups"]):
            ContractedSGD.stage_state_dict(self, {"state": {}, "param_groups": [  # this group's options only
                saved if g is live else {**g, "params": list(range(1000 * i, 1000 * i + len(g["params"])))}
                for i, g in enumerate(self.param_groups)
            ]})  # fmt: skip
            live.update({k: v for k, v in saved.items() if k != "params"})
        _, state = staged.claim(self, kind="native_load", current_token=self._version)  # type: ignore[misc]
        self.state.clear()
        self.state.update(state)
        self._version += 1


class ReadsTheRateOnce(ContractedSGD):
    """Steps with the learning rate it was built with, whatever a scheduler (or the user)
    writes into ``param_groups`` since."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        live = [group["lr"] for group in self.param_groups]
        for group in self.param_groups:
            group["lr"] = self.defaults["lr"]
        try:
            return super().step(closure)
        finally:
            for group, rate in zip(self.param_groups, live):
                group["lr"] = rate
