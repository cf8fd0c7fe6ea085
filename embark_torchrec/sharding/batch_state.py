"""The state an input dist's forward cuts from a batch (de-duplication, placement), handed once to the sharded
module, which files it in that batch's context: with TrainPipelineSparseDist the next batch's input dist runs
before this batch's output dist, so the state must travel with the context, not stay on the dist."""

from __future__ import annotations

from typing import Generic, Optional, TypeVar

S = TypeVar("S")


class BatchStateHandover(Generic[S]):
    """Mixed into an input dist: its forward sets `last_state`; `take_state()` hands it over exactly once."""

    last_state: Optional[S] = None

    def take_state(self) -> S:
        state, self.last_state = self.last_state, None
        if state is None:
            raise RuntimeError(f"{type(self).__name__}: no batch state to take; was forward called?")
        return state
