"""A batch source: the one thing a recipe hands the loop. Each call of next() gives this rank's micro-batches of one
optimizer step (what the objective trains on) and the source's own metrics; position() is where a resume starts
(TrainState.data); state_dict()/load_state_dict() carry anything else it must keep across a resume (Recipe.source_state
names it in the checkpoints). The data's micro-batches are one source (DataSource); GRPO's rollouts (prompts -> engine
-> rewards -> rows) another; a DerivedSource remakes another source's micro-batches."""

from __future__ import annotations

from typing import NamedTuple, Protocol


class Batch(NamedTuple):
    micro: list[dict]    # this rank's micro-batches of one step
    metrics: dict = {}   # the source's metrics for the step's record (equal on every rank)
    work_s: float = 0.0  # seconds of next() spent making the batch (sampling, scoring): step time, not data wait


class BatchSource(Protocol):
    def next(self) -> Batch: ...

    def position(self) -> dict:
        """Where the next step's data starts, as the checkpoint records it (TrainState.data)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class DataSource:
    """This rank's micro-batches of each global batch (data.make_steps: one global order whatever the world
    size or accumulation split); nothing to keep beyond the position."""

    def __init__(self, steps):
        self.steps = steps

    def next(self) -> Batch:
        return Batch(next(self.steps))

    def position(self) -> dict:
        return self.steps.position()

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class DerivedSource:
    """A source that remakes another's micro-batches (its own next()) and keeps that one's position and state
    as they are: distillation's offline teacher and on-policy steps."""

    def __init__(self, inner: BatchSource):
        self.inner = inner

    def position(self) -> dict:
        return self.inner.position()

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


class Held:
    """A source's state registered with the checkpoints before the source exists (build() resumes it): the
    source loads what a resume read, and from then on checkpoints save the source's own state_dict()."""

    def __init__(self):
        self.source: BatchSource | None = None
        self.loaded: dict = {}

    def state_dict(self) -> dict:
        return self.source.state_dict() if self.source is not None else {}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state

    def load_into(self, source: BatchSource) -> BatchSource:
        """`source` loads what a resume read; from now on the checkpoints save its state. Returns it."""
        source.load_state_dict(self.loaded)
        self.source = source
        return source
