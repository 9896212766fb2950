"""QueueOrder: who runs first and who is preempted first, under a scheduling policy."""

from collections.abc import Iterable

from pagedbench.engine.sequence import Sequence

POLICIES = ("fcfs", "priority")


class QueueOrder:
    """ "fcfs": by arrival; "priority": by `priority` value, then arrival. Paused sequences (beams
    waiting for their siblings) are never next."""

    def __init__(self, policy: str):
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy

    def rank(self, seq: Sequence) -> tuple:
        """Who goes first (smallest) and who is preempted first (largest)."""
        return (seq.priority, seq.arrival_time) if self.policy == "priority" else (seq.arrival_time,)

    def first(self, queue: Iterable[Sequence]) -> Sequence | None:
        """The next of a queue: in queue order under "fcfs" (preempted sequences went back to
        its front), the best ranked under "priority"."""
        if self.policy == "priority":
            return self.best(queue)
        return next((s for s in queue if not s.paused), None)

    def best(self, queue: Iterable[Sequence]) -> Sequence | None:
        return min((s for s in queue if not s.paused), key=self.rank, default=None)

    def outranks(self, waiting: Iterable[Sequence], swapped: Sequence) -> bool:
        """Whether the next waiting request is admitted before `swapped` comes back: under
        "priority" when it ranks better; under "fcfs" swapped sequences always come back first."""
        first = self.first(waiting)
        return self.policy == "priority" and first is not None and self.rank(first) < self.rank(swapped)
