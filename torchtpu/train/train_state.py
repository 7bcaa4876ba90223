"""The state a checkpoint saves and restores: the model, the optimizer, the LR schedule and the data
position, with the step beside them.

    state = TrainState(model, optimizer, lr_scheduler, dataloader, dims, mesh, model_args)
    tree = state.tree(step)                    # what CheckpointManager.save writes
    step = state.restore(ck, step, exclude)    # checkpoint `step` of `ck` restored in place
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .loader_state import load_loader_state, loader_states
from .optimizer import init_optimizer_state

__all__ = ["TrainState"]


@dataclass(frozen=True)
class TrainState:
    model: Any
    optimizer: Any
    lr_scheduler: Any
    dataloader: Any
    dims: Any
    mesh: Any
    model_args: Any

    def tree(self, step: int) -> dict:
        """The whole training state at `step`, as a checkpoint holds it."""
        from .checkpoint.manager import model_state, optimizer_state

        return {
            "model": model_state(self.model),
            "optimizer": optimizer_state(self.optimizer),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "dataloader": loader_states(self.dataloader),
            "step": step,
        }

    def restore(self, ck, step: int, exclude=()) -> int:
        """Restore the training state of checkpoint `step` of `ck` in place, but for the parts named in
        `exclude` ([checkpoint] exclude_from_loading); returns the step it holds."""
        from .checkpoint.manager import load_model_state, load_optimizer_state

        init_optimizer_state(self.optimizer, self.mesh)
        excluded = set(exclude)
        # excluded parts are not read at all (restoring fills tensors in place, so reading them and
        # then not loading them would still overwrite the optimizer state)
        restored = ck.restore(step, target=self.tree(step), skip=tuple(excluded))
        load_model_state(self.model, restored["model"])
        if "optimizer" not in excluded:
            load_optimizer_state(self.optimizer, restored["optimizer"])
        if "lr_scheduler" not in excluded:
            self.lr_scheduler.load_state_dict(restored["lr_scheduler"])
        if "dataloader" not in excluded:
            load_loader_state(self.dataloader, restored["dataloader"], self.dims)
        return int(restored["step"])
