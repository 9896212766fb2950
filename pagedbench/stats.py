"""Engine statistics: counters and the wall time of each named part of a step."""

from dataclasses import dataclass, field

# The parts of one engine step, in order; reports name their columns time_<part>_s.
STEP_PARTS = ("schedule", "metadata", "backend_prepare", "forward", "sample")
TIME_COLUMNS = [f"time_{part}_s" for part in STEP_PARTS]


@dataclass(slots=True)
class EngineStats:
    """Counters, and seconds per step part summed over steps."""

    steps: int = 0
    preemptions: int = 0
    peak_blocks_used: int = 0
    peak_shared_blocks: int = 0  # blocks read by several sequences at once (prefix caching, forks)
    block_copies: int = 0  # copy-on-write page copies (a fork writing into a shared page)
    prompt_tokens: int = 0  # prompt tokens run through the model (cached and recomputed ones not counted)
    generation_tokens: int = 0  # tokens sampled (every sample and beam)
    swap_outs: int = 0  # steps that moved preempted pages to CPU swap space
    used_block_steps: int = 0  # blocks in use, summed over steps (mean utilization = / steps / num_blocks)
    wasted_slot_steps: int = 0  # allocated slots holding no token (last pages), summed over steps
    peak_wasted_slots: int = 0
    time: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PARTS, 0.0))
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # per step: (time, blocks used, empty slots)

    def reset(self) -> None:
        self.steps = self.preemptions = self.peak_blocks_used = self.peak_shared_blocks = self.block_copies = 0
        self.used_block_steps = self.wasted_slot_steps = self.peak_wasted_slots = self.swap_outs = 0
        self.prompt_tokens = self.generation_tokens = 0
        self.time = dict.fromkeys(STEP_PARTS, 0.0)
        self.timeline = []

    def time_columns(self) -> dict[str, float]:
        return {column: self.time[part] for column, part in zip(TIME_COLUMNS, STEP_PARTS)}
