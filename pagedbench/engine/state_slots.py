"""Hybrid models' linear-attention state slots. A sequence holding pages also holds one device slot
of the DeltaNet state; a fork's slot starts as a copy of its parent's, and a swapped-out sequence's
state moves to a CPU slot (numbered after the device's running and snapshot slots) and back with
its pages. Every move is a queued (source slot, slot) copy that the engine runs before the step."""

from collections import deque

from pagedbench.engine.sequence import Sequence


class StateSlots:
    def __init__(self, num_slots: int, first_cpu_slot: int, num_cpu_slots: int):
        self.num_slots, self.first_cpu_slot = num_slots, first_cpu_slot
        self.free: deque[int] = deque(range(num_slots))
        self.cpu_free: deque[int] = deque(range(first_cpu_slot, first_cpu_slot + num_cpu_slots))
        self.pending_copies: list[tuple[int, int]] = []  # (source slot, slot), for the engine

    @property
    def num_free(self) -> int:
        return len(self.free)

    def on_device(self, seq: Sequence) -> bool:
        """Whether `seq` holds a device slot (not none, not a swapped-out state's CPU slot)."""
        return 0 <= seq.state_slot < self.first_cpu_slot

    def can_take(self, seq: Sequence) -> bool:
        """Whether `seq` holds a device slot or can get one (always, for a model without state)."""
        return not self.num_slots or self.on_device(seq) or bool(self.free)

    def take(self, seq: Sequence) -> None:
        """Give `seq` a device slot unless it holds one (a swapped-in state comes back from its CPU slot)."""
        if self.num_slots and not self.on_device(seq):
            if not self.free:
                raise RuntimeError("out of linear-attention state slots")
            cpu, seq.state_slot = seq.state_slot, self.free.popleft()
            if cpu >= 0:  # swapped back in: its state returns from its CPU slot (read before any reuse)
                self.pending_copies.append((cpu, seq.state_slot))
                self.cpu_free.append(cpu)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` continues from `parent`'s state: a copy of its slot. A parent holding no device
        state (preempted to recompute) forks a child that recomputes too."""
        if self.num_slots and self.on_device(parent):
            self.take(child)
            self.pending_copies.append((parent.state_slot, child.state_slot))

    def release(self, seq: Sequence) -> None:
        if seq.state_slot >= 0:
            (self.free if self.on_device(seq) else self.cpu_free).append(seq.state_slot)
            seq.state_slot = -1

    def can_swap_out(self) -> bool:
        return not self.num_slots or bool(self.cpu_free)

    def swap_out(self, seq: Sequence) -> None:
        """`seq`'s state moves out with its pages (its device slot is free)."""
        if self.on_device(seq):
            cpu = self.cpu_free.popleft()
            self.pending_copies.append((seq.state_slot, cpu))
            self.free.append(seq.state_slot)
            seq.state_slot = cpu

    def take_copies(self) -> list[tuple[int, int]]:
        """The copies queued since the last call (forks, snapshot restores, swaps out and in), as one
        set that reads every source before writing any slot: each slot's copy from where its content
        comes in queue order (a fork's child swapped out in the next schedule takes its parent's
        state to the CPU slot), the last copy into a slot winning."""
        origin: dict[int, int] = {}
        for src, dst in self.pending_copies:
            origin[dst] = origin.get(src, src)
        self.pending_copies = []
        return [(src, dst) for dst, src in origin.items() if src != dst]
