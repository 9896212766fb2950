"""Swap space (preemption by swap, vLLM v0's): a pool of CPU pages. A swapped-out sequence's pages
are copied there (queued (device page, CPU page) copies, the device pages freed) and back into fresh
device pages when it returns; the engine runs the queued copies before the step, swap-outs first."""

from collections import deque


class SwapSpace:
    def __init__(self, num_blocks: int):
        self.free: deque[int] = deque(range(num_blocks))
        self.pending_out: list[tuple[int, int]] = []  # (device page, CPU page)
        self.pending_in: list[tuple[int, int]] = []  # (CPU page, device page)
        self.releasing: list[int] = []  # read by a pending swap-in: free once the copies are taken

    def copy_out(self, block: int) -> int:
        """A CPU page that device page `block` is copied into."""
        cpu = self.free.popleft()
        self.pending_out.append((block, cpu))
        return cpu

    def copy_in(self, cpu: int, block: int) -> int:
        """CPU page `cpu` is copied back into device page `block` (returned); `cpu` is free once the
        copies are taken."""
        self.pending_in.append((cpu, block))
        self.releasing.append(cpu)
        return block

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(swap-outs, swap-ins) queued since the last call."""
        copies = self.pending_out, self.pending_in
        self.pending_out, self.pending_in = [], []
        self.free.extend(self.releasing)
        self.releasing = []
        return copies
