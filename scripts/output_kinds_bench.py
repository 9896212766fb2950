"""Host time of OutputProcessor.process_outputs per decode step, per RequestOutputKind (issue 66).

B requests, each one sequence with L output tokens (text and a logprobs entry per token) that gains
one token per step, all progressing every step: what a decode step of a full batch hands the output
processor. Prints a markdown table of min / median ms per step over the repeats.

    OMP_NUM_THREADS=1 python scripts/output_kinds_bench.py [--repeats 30]
"""

import argparse
import os
import statistics
import time

from pagedbench.engine.output_processor import OutputProcessor
from pagedbench.engine.outputs import Logprob
from pagedbench.engine.request import SequenceGroup
from pagedbench.engine.sequence import Sequence, SequenceStatus
from pagedbench.engine.step_update import RequestProgress
from pagedbench.sample import sampling_params

KINDS = [k.name for k in sampling_params.RequestOutputKind] if hasattr(sampling_params, "RequestOutputKind") else []


def batch(num_requests: int, output_len: int, kind: str | None) -> list[RequestProgress]:
    """`num_requests` running requests with `output_len` output tokens each, logprobs=1."""
    extra = {} if kind is None else {"output_kind": sampling_params.RequestOutputKind[kind]}
    params = sampling_params.SamplingParams(max_tokens=10**6, logprobs=1, **extra)
    progressed = []
    for r in range(num_requests):
        seq = Sequence(str(r), None, list(range(1, 17)), params)
        seq.status = SequenceStatus.RUNNING
        seq.logprobs = []
        for _ in range(output_len):
            grow(seq)
        progressed.append(RequestProgress(SequenceGroup(str(r), None, seq.prompt_token_ids, params, [seq], 0.0), 1))
    return progressed


def grow(seq: Sequence) -> None:
    """One more output token, its text and its logprobs entry (what a step's update adds)."""
    token = 100 + seq.num_tokens % 1000
    seq.token_ids.append(token)
    seq.output_text += " tok"
    seq.logprobs.append({token: Logprob(-0.5, 1, " tok")})


def time_steps(num_requests: int, output_len: int, kind: str | None, repeats: int) -> tuple[float, float]:
    """(min, median) ms of process_outputs over `repeats` steps, each after every request grew a token."""
    processor, progressed = OutputProcessor(None), batch(num_requests, output_len, kind)
    processor.process_outputs(progressed, 0.0)  # a DELTA request's first output carries its whole past
    times = []
    for step in range(repeats):
        for p in progressed:
            grow(p.group.seqs[0])
        start = time.perf_counter()
        processor.process_outputs(progressed, float(step))
        times.append((time.perf_counter() - start) * 1e3)
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    kinds = KINDS or [None]  # before RequestOutputKind: today's (cumulative) outputs
    print("| B | output len | " + " | ".join(f"{k or 'today'} min / median ms" for k in kinds) + " |")
    print("|---|---|" + "---|" * len(kinds))
    for num_requests in (64, 256):
        for output_len in (8, 512, 2048):
            cells = [time_steps(num_requests, output_len, k, args.repeats) for k in kinds]
            print(f"| {num_requests} | {output_len} | " + " | ".join(f"{a:.3f} / {m:.3f}" for a, m in cells) + " |")


if __name__ == "__main__":
    main()
