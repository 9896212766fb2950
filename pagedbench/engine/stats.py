"""Engine statistics: counters and the wall time of each named part of a step."""

from dataclasses import dataclass, field

from pagedbench.engine.sequence import Sequence

# The parts of one engine step, in order; reports name their columns time_<part>_s.
STEP_PARTS = ("schedule", "propose", "metadata", "backend_plan", "forward", "sample")
TIME_COLUMNS = [f"time_{part}_s" for part in STEP_PARTS]
TIMELINE_POINTS = 1024  # the KV timeline's bound (EngineStats.timeline); reports plot at most 500


@dataclass(slots=True)
class StepTimes:
    """The wall times (time.perf_counter) at which one engine step's parts end, from its start."""

    start: float
    scheduled: float = 0.0
    proposed: float = 0.0  # speculative proposals made (the page moves before them)
    metadata: float = 0.0  # the step's inputs and attention metadata on the device
    planned: float = 0.0  # the backend's plan()
    forward: float = 0.0  # the logits in hand
    end: float = 0.0  # sampled, and applied to the sequences

    def seconds(self) -> dict[str, float]:
        """Each of STEP_PARTS: from the end of the part before it to its own."""
        return {
            "schedule": self.scheduled - self.start,
            "propose": self.proposed - self.scheduled,
            "metadata": self.metadata - self.proposed,
            "backend_plan": self.planned - self.metadata,
            "forward": self.forward - self.planned,
            "sample": self.end - self.forward,
        }


@dataclass(slots=True)
class EngineStats:
    """Counters, and seconds per step part summed over steps."""

    steps: int = 0
    preemptions: int = 0
    peak_blocks_used: int = 0
    peak_running: int = 0  # sequences running at once (their pages in the cache)
    peak_shared_blocks: int = 0  # blocks read by several sequences at once (prefix caching, forks)
    block_copies: int = 0  # copy-on-write page copies (a fork writing into a shared page)
    prompt_tokens: int = 0  # prompt tokens run through the model (cached and recomputed ones not counted)
    generation_tokens: int = 0  # tokens sampled (every sample and beam)
    swap_outs: int = 0  # steps that moved preempted pages to CPU swap space
    used_block_steps: int = 0  # blocks in use, summed over steps (mean utilization = / steps / num_blocks)
    wasted_slot_steps: int = 0  # allocated slots holding no token (last pages), summed over the sampled steps
    wasted_slot_samples: int = 0  # the steps that counted them (the timeline's: every step until it thins)
    peak_wasted_slots: int = 0
    in_flight_steps: int = 0  # pipeline parallelism, async scheduling: steps in flight when each was launched, summed
    time: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PARTS, 0.0))
    # Every timeline_stride-th step's (time, blocks used, empty slots): at most TIMELINE_POINTS (+1) kept,
    # every other one dropped and the stride doubled when full, so a server's stats stay bounded.
    timeline: list[tuple[float, int, int]] = field(default_factory=list)
    timeline_stride: int = 1
    spec: "SpecStats" = field(default_factory=lambda: SpecStats())
    # Structured outputs: host seconds filling grammar bitmasks (part of "sample"), rows masked,
    # and seconds compiling grammars (when requests are added, outside the steps).
    grammar_fill_s: float = 0.0
    grammar_rows: int = 0
    grammar_compile_s: float = 0.0

    def reset(self) -> None:
        self.steps = self.preemptions = self.peak_blocks_used = self.peak_shared_blocks = self.block_copies = 0
        self.peak_running = 0
        self.used_block_steps = self.wasted_slot_steps = self.peak_wasted_slots = self.swap_outs = 0
        self.wasted_slot_samples = 0
        self.timeline_stride = 1
        self.prompt_tokens = self.generation_tokens = self.in_flight_steps = 0
        self.time = dict.fromkeys(STEP_PARTS, 0.0)
        self.timeline = []
        self.spec = SpecStats()
        self.grammar_fill_s = self.grammar_compile_s = 0.0
        self.grammar_rows = 0

    def time_columns(self) -> dict[str, float]:
        return {column: self.time[part] for column, part in zip(TIME_COLUMNS, STEP_PARTS)}

    @property
    def samples_next_step(self) -> bool:
        """Whether the next recorded step enters the timeline (and its wasted slots are wanted: an
        O(batch) count, so it is taken on the timeline's steps only)."""
        return self.steps % self.timeline_stride == 0

    def record_step(
        self, times: StepTimes, blocks_used: int, shared_blocks: int, wasted: int | None, running: int = 0
    ) -> None:
        """One step: its parts' times, its KV use, how many sequences ran and, on the timeline's
        steps (`samples_next_step`), its wasted slots (None on the others)."""
        if wasted is not None:
            self.wasted_slot_steps += wasted
            self.wasted_slot_samples += 1
            self.peak_wasted_slots = max(self.peak_wasted_slots, wasted)
        if self.samples_next_step:
            self.timeline.append((times.end, blocks_used, wasted or 0))
            if len(self.timeline) > TIMELINE_POINTS:
                del self.timeline[1::2]
                self.timeline_stride *= 2
        self.steps += 1
        self.peak_running = max(self.peak_running, running)
        self.peak_blocks_used = max(self.peak_blocks_used, blocks_used)
        self.peak_shared_blocks = max(self.peak_shared_blocks, shared_blocks)
        self.used_block_steps += blocks_used
        for part, seconds in times.seconds().items():
            self.time[part] += seconds


def wasted_slots(running: list[Sequence], block_size: int) -> int:
    """Internal fragmentation: slots of running sequences' last pages that hold no token yet
    (a page shared by forks counted once, as full as its fullest reader)."""
    filled = {}
    for seq in running:
        if seq.block_table and seq.num_computed_tokens % block_size:
            last = seq.block_table[(seq.num_computed_tokens - 1) // block_size]
            filled[last] = max(filled.get(last, 0), seq.num_computed_tokens % block_size)
        if len(seq.block_table) * block_size >= seq.num_computed_tokens + block_size:  # a page allocated ahead, empty
            filled.setdefault(seq.block_table[-1], 0)
    return sum(block_size - n for n in filled.values())


def gauges(scheduler, stats: EngineStats, speculating: bool) -> dict[str, float]:
    """What the server's /metrics reads now of an engine's Scheduler and stats: requests by queue (a
    request's samples count once), KV use, the token, preemption and prefix-cache counters and, when
    `speculating`, the proposals' counters."""
    bm, st = scheduler.block_manager, stats

    def requests(queue) -> int:
        return len({s.request_id for s in queue})

    spec = {}
    if speculating:
        spec = {
            "spec_drafts": st.spec.num_drafts,
            "spec_draft_tokens": st.spec.num_draft_tokens,
            "spec_accepted_tokens": st.spec.num_accepted_tokens,
        } | {f"spec_accepted_at_{j}": n for j, n in enumerate(st.spec.accepted_per_position)}
    return spec | {
        "running": requests(scheduler.running),
        "waiting": requests(scheduler.waiting),
        "swapped": requests(scheduler.swapped),
        "used_blocks": bm.num_used_blocks,
        "num_blocks": bm.num_blocks,
        "prompt_tokens": st.prompt_tokens,
        "generation_tokens": st.generation_tokens,
        "preemptions": st.preemptions,
        "prefix_queries": bm.prefix_cache.queries,
        "prefix_hits": bm.prefix_cache.hits,
    }


@dataclass(slots=True)
class SpecStats:
    """Speculative decoding as vLLM counts it: a draft is one sequence's proposal in one step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0  # tokens proposed and verified
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: drafts whose j-th token was accepted

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position += [0] * (proposed - len(self.accepted_per_position))
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verifying step of a sequence: the accepted ones plus the one the
        target adds (vLLM's 1 + accepted / drafts)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def per_position_rate(self) -> list[float]:
        return [n / self.num_drafts for n in self.accepted_per_position] if self.num_drafts else []

    def columns(self) -> dict:
        """What run/compare CSVs report (empty values without speculation)."""
        rate, length = self.acceptance_rate, self.mean_acceptance_length
        return {
            "spec_draft_tokens": self.num_draft_tokens,
            "spec_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": round(rate, 4) if rate is not None else None,
            "spec_mean_acceptance_length": round(length, 3) if length is not None else None,
            "spec_acceptance_per_position": " ".join(f"{r:.3f}" for r in self.per_position_rate()) or None,
        }


@dataclass(slots=True)
class RunCounters:
    """What a benchmark run reads of an engine since its reset_counters(): the stats, the device
    timer's spans, prefix-cache lookups and hits, and the backend's compile seconds."""

    stats: EngineStats
    device: dict[str, float]
    prefix_queries: int = 0
    prefix_hits: int = 0
    compile_seconds: float = 0.0
    model_compile_seconds: float = 0.0  # torch.compile of the model's layers (fused.py), this process's

    @classmethod
    def merge(cls, parts: list["RunCounters"]) -> "RunCounters":
        """Data-parallel replicas' counters as one engine's: sums, with the KV timeline (and its
        peaks) the replicas' pages in use at once."""
        merged = EngineStats()
        summed = ("steps", "preemptions", "block_copies", "prompt_tokens", "generation_tokens", "swap_outs")
        summed += ("used_block_steps", "wasted_slot_steps", "wasted_slot_samples", "in_flight_steps", "grammar_rows")
        summed += ("grammar_fill_s", "grammar_compile_s", "peak_running", "peak_shared_blocks")
        for name in summed:  # peaks of running sequences and shared pages: summed, an upper bound
            setattr(merged, name, sum(getattr(p.stats, name) for p in parts))
        merged.time = {part: sum(p.stats.time[part] for p in parts) for part in STEP_PARTS}
        merged.timeline = merged_timeline([p.stats.timeline for p in parts])
        merged.peak_blocks_used = max((used for _, used, _ in merged.timeline), default=0)
        merged.peak_wasted_slots = max((wasted for _, _, wasted in merged.timeline), default=0)
        for p in parts:
            spec = p.stats.spec
            merged.spec.num_drafts += spec.num_drafts
            merged.spec.num_draft_tokens += spec.num_draft_tokens
            merged.spec.num_accepted_tokens += spec.num_accepted_tokens
            for j, n in enumerate(spec.accepted_per_position):
                if j == len(merged.spec.accepted_per_position):
                    merged.spec.accepted_per_position.append(0)
                merged.spec.accepted_per_position[j] += n
        device = {}
        for p in parts:
            for name, seconds in p.device.items():
                device[name] = device.get(name, 0.0) + seconds
        return cls(
            merged,
            device,
            sum(p.prefix_queries for p in parts),
            sum(p.prefix_hits for p in parts),
            sum(p.compile_seconds for p in parts),
            sum(p.model_compile_seconds for p in parts),
        )


def merged_timeline(timelines: list[list[tuple[float, int, int]]]) -> list[tuple[float, int, int]]:
    """Several engines' (time, blocks used, empty slots) step records as one: at each step of any,
    the sum of every engine's latest record."""
    latest = [(0, 0)] * len(timelines)
    events = sorted((t, i, used, wasted) for i, timeline in enumerate(timelines) for t, used, wasted in timeline)
    merged = []
    for t, i, used, wasted in events:
        latest[i] = (used, wasted)
        merged.append((t, sum(u for u, _ in latest), sum(w for _, w in latest)))
    return merged
