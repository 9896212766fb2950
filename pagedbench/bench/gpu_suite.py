"""The GPU suite: one command that measures what matters on a CUDA machine within a time budget.

Steps run most valuable first, each as its own process under its own time limit (cut to what is
left of the budget). Results are written as each step ends: its log, its reports, a summary row,
and the one tarball everything is packed into, so a cut or a crash loses only the step it hit.
The summary table prints last. On a machine without CUDA the CUDA steps are skipped with the
reason; the rest (environment, packing, limits) runs the same, which is how the tests check it.
"""

import csv
import functools
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagedbench import envs
from pagedbench.bench.environment import git_sha
from pagedbench.bench.gpu_ledger import LedgerRow, code_hash, measured, today, write_ledger

STASH = Path(envs.get("PAGEDBENCH_GPU_STASH"))  # survives between calls while warm
MIN_STEP_SECONDS = 20  # a step with less time than this left is skipped, not started
KILL_GRACE_SECONDS = 5  # between SIGTERM to a step's process group and SIGKILL
TARBALL = "gpu-suite.tar.gz"
LAST_FAILED = ["tests/test_check.py", "tests/test_cuda_graphs.py"]  # files of the last draw's failures
EARLY_FAILURES = {"PAGEDBENCH_EARLY_FAILURES": "1"}  # tests/conftest.py prints each failure as it happens


# The source a step's result depends on (gpu_ledger.code_hash): a change there makes it due again.
ENGINE_CODE = ("pagedbench", "backends")
TEST_CODE = (*ENGINE_CODE, "tests")
KERNEL_CODE = ("backends", *(f"pagedbench/bench/{m}.py" for m in ("kernels", "problems", "timing", "replay")))
CHECK_CODE = ("backends", *(f"pagedbench/bench/{m}.py" for m in ("check", "check_determinism", "problems")))


@dataclass(slots=True)
class SuiteStep:
    name: str
    argv: list[str]
    limit_s: int
    needs_cuda: bool = True
    needs_fa4: bool = False
    env: dict[str, str] = field(default_factory=dict)
    code: tuple[str, ...] = ENGINE_CODE
    always: bool = False  # runs on every draw (the environment), whatever the ledger says
    # A glob under the suite's reports whose matches (comma-joined) replace "{inputs}" in argv: files an
    # earlier step of this draw wrote (a recording to replay); none there, the step is skipped.
    inputs: str | None = None


@dataclass(slots=True)
class StepResult:
    name: str
    status: str  # ok, failed, cut, skipped
    seconds: float
    limit_s: int
    detail: str = ""  # rc, or why it was skipped or cut
    command: str = ""


def pagedbench_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pagedbench", *args]


PYTEST = [sys.executable, "-m", "pytest", "-v", "-rfEs", "-n", "8", "--timeout", "150", "-p", "no:cacheprovider"]
PROFILE = ["profile", "--model", "qwen3-0.6b", "--backends", "triton,flex", "--batch-sizes", "64,256"]
# DeepSeek-V3.2's sparse decode against the dense latent one, at its shape (top-2048 of 16k-32k)
DSA = ["kernels", "--phases", "decode", "--batch-sizes", "16,64", "--context-lens", "16384,32768"]
DSA += ["--block-sizes", "64", "--heads", "128/1", "--head-dim", "576", "--variants", "latent-512,dsa"]
DSA += ["--warmup", "3", "--repeats", "20", "--max-kv-tokens", "2200000"]


def kernels_decode(block_sizes: str, backends: str, *more: str) -> list[str]:
    """kernels' decode grid: 32/8 heads of 128, batches of 16-256 at 2k-4k tokens."""
    grid = ["--phases", "decode", "--batch-sizes", "16,64,256", "--context-lens", "2048,4096", "--heads", "32/8"]
    timing = ["--warmup", "3", "--repeats", "20", "--max-kv-tokens", "1100000"]
    return ["kernels", *grid, *timing, "--block-sizes", block_sizes, "--backends", backends, *more]


def compare_mixed(model: str, scale: str, *more: str) -> list[str]:
    return ["compare", "--model", model, "--scenario", "mixed", "--scale", scale, *more, "--repeats", "1"]


def default_steps(reports: Path, scale: float = 1.0, num_blocks: int = 16384) -> list[SuiteStep]:
    """The suite's steps, most valuable first (issue 71's order: the end-to-end comparison and its
    async twin, the step profile, the replay of the comparison's recorded steps, determinism, the
    CUDA tests; FA4, which needs its wheels installed, last). The engine's flex tunes each decode
    batch bucket it captures (nine of them): the suite gives that search 6 s a shape
    (PAGEDBENCH_FLEX_TUNE_SECONDS, unless set) so that it fits a 15-minute draw."""

    bench = functools.partial(_bench, reports)
    compare = compare_mixed("qwen3-0.6b", str(scale), "--num-blocks", str(num_blocks))
    return [*_first_steps(bench, compare), *_later_steps(bench, compare)]


def _bench(reports: Path, name: str, limit: int, argv: list[str], out: str | None = None, **options) -> SuiteStep:
    """A pagedbench command writing its reports to reports/<out, else the step's name>."""
    return SuiteStep(name, pagedbench_cmd(*argv, "--out", f"{reports}/{out or name}"), limit, **options)


TORCH_AND_TRITON = "sdpa,flex,triton"  # the backends that need no extra wheels
QUARTER = compare_mixed("qwen3-0.6b", "0.25")


def _first_steps(bench, compare: list[str]) -> list[SuiteStep]:
    """The environment, the end-to-end comparison off/on async, profiles, replay, determinism, CUDA tests."""
    torch_and_triton = TORCH_AND_TRITON
    return [
        SuiteStep(
            "environment", [sys.executable, "-m", "pagedbench.bench.gpu_suite", "environment"], 60, False, always=True
        ),
        bench("compare-mixed", 200, [*compare, "--backends", "triton,flex", "--record-steps", "200"]),
        # Async scheduling (docs/async-scheduling.md): the same runs and decode steps with the host run ahead.
        bench("compare-mixed-async", 200, [*compare, "--backends", "triton,flex", "--async-scheduling"]),
        bench("profile-graphs", 150, [*PROFILE, "--compile"]),
        bench("profile-graphs-async", 150, [*PROFILE, "--compile", "--async-scheduling"]),
        # The served shapes (docs/benchmarks.md): compare-mixed's recorded steps through each backend.
        bench(
            "kernels-replay",
            150,
            ["kernels", "--replay", "{inputs}", "--backends", torch_and_triton],
            inputs="compare-mixed/*-steps.jsonl",
            code=KERNEL_CODE,
        ),
        bench("kernels-decode-graphs", 120, kernels_decode("16", torch_and_triton, "--cuda-graphs"), code=KERNEL_CODE),
        bench(
            "check-determinism",
            120,
            ["check", "--determinism", "--device", "cuda", "--dtypes", "bf16", "--backends", torch_and_triton],
            code=CHECK_CODE,
        ),
        # The cases that failed on the last draw, first, with their tracebacks; then the rest.
        SuiteStep(
            "pytest-cuda-failed-before",
            [*PYTEST, "--tb=long", "-k", "cuda and (MLA or graph)", *LAST_FAILED],
            120,
            env=EARLY_FAILURES,
            code=TEST_CODE,
        ),
        SuiteStep(
            "pytest-cuda", [*PYTEST, "-k", "cuda and not flash", "tests"], 240, env=EARLY_FAILURES, code=TEST_CODE
        ),
    ]


def _later_steps(bench, compare: list[str]) -> list[SuiteStep]:
    """Cascade, alone-check, DSA, hybrids, the untuned and wider kernel grids, sdpa at scale 1, the HF peer, FA4."""
    torch_and_triton, quarter = TORCH_AND_TRITON, QUARTER
    return [
        # Shared prefixes read once (docs/cascade.md), and outputs alone vs batched with batch_invariant off and on.
        bench(
            "kernels-cascade",
            120,
            ["kernels", "--variants", "cascade", "--backends", torch_and_triton],
            code=KERNEL_CODE,
        ),
        # triton alone: flex on CUDA refuses batch_invariant (its SPLIT_KV is tuned per batch)
        bench("compare-alone", 150, [*quarter, "--backends", "triton", "--alone-check", "16"]),
        bench(
            "compare-alone-invariant",
            150,
            [*quarter, "--backends", "triton", "--alone-check", "16", "--batch-invariant"],
        ),
        bench(
            "check-determinism-invariant",
            120,
            [
                "check",
                "--determinism",
                "--batch-invariant",
                "--device",
                "cuda",
                "--dtypes",
                "bf16",
                "--backends",
                "sdpa,triton",
            ],
            code=CHECK_CODE,
        ),  # fmt: skip
        bench("kernels-dsa", 100, [*DSA, "--backends", torch_and_triton], code=KERNEL_CODE),
        # Hybrids' gated delta rule on CUDA: the torch forms and fla's kernels against the float64 oracle.
        bench("check-gdn", 60, ["check", "--device", "cuda", "--backends", "gdn-torch,gdn-fla"], code=CHECK_CODE),
        bench("profile-eager", 90, [*PROFILE, "--enforce-eager"]),
        bench("kernels-decode", 180, kernels_decode("16,64,128", torch_and_triton), code=KERNEL_CODE),
        bench(
            "kernels-flex-untuned",
            90,
            kernels_decode("16,64,128", "flex"),
            "kernels-decode-flex-untuned",
            env={"PAGEDBENCH_FLEX_TUNE": "0"},
            code=KERNEL_CODE,
        ),
        # Hybrid (Qwen3.5's shape): what the DeltaNet layers' host loop costs beside attention on a GPU.
        bench("compare-hybrid", 150, [*compare_mixed("qwen3.5-0.8b", "0.25"), "--backends", "triton,flex"]),
        # sdpa runs mixed at scale 1 in minutes (a seventh of triton's rate at 0.25): after the rest.
        bench("compare-mixed-sdpa", 240, [*compare, "--backends", "sdpa"]),
        bench("compare-hf-peer", 150, [*quarter, "--backends", "triton", "--peer", "hf"]),
        bench(
            "fa4-kernels",
            120,
            kernels_decode("16,128", "flash-attn"),
            "kernels-decode-fa4",
            needs_fa4=True,
            code=KERNEL_CODE,
        ),
        bench("fa4-compare", 150, [*compare, "--backends", "flash-attn"], "compare-mixed-fa4", needs_fa4=True),
        SuiteStep(
            "fa4-pytest",
            [*PYTEST, "-k", "cuda and flash", "tests"],
            150,
            needs_fa4=True,
            env=EARLY_FAILURES,
            code=TEST_CODE,
        ),
    ]


def due_steps(steps: list[SuiteStep], ledger: list[LedgerRow]) -> tuple[list[SuiteStep], list[str]]:
    """`--next`: the steps without a result on the code as it is now (and those that always run), in
    the suite's order; with a line for each step left out (when and on which commit it was measured)."""
    due, done = [], []
    for step in steps:
        row = None if step.always else measured(ledger, step.name, code_hash(step.code))
        if row is None:
            due.append(step)
        else:
            done.append(f"{step.name}: {row.status} on this code already ({row.date}, {row.commit[:12]})")
    return due, done


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def fa4_available(env: dict[str, str]) -> bool:
    """FA4's entry point imports (in a fresh process with the suite's PYTHONPATH)."""
    probe = "from flash_attn.cute import flash_attn_varlen_func"
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, timeout=120).returncode == 0


def install_fa4(parts: list[Path], stash: Path = STASH) -> Path | None:
    """FA4's wheels travel as halves of one tar (../shared/gpu/pack.sh), one per call: each half
    present here is kept in `stash`; once every half is there they are joined and installed into
    stash/site, returned (None while a half is missing)."""
    stash.mkdir(parents=True, exist_ok=True)
    kept = []
    for i, part in enumerate(parts):
        copy = stash / f"fa4.{i}"
        if part.exists() and not copy.exists():
            shutil.copyfile(part, copy)
        kept.append(copy)
    site = stash / "site"
    if site.exists():
        return site
    if not all(p.exists() for p in kept):
        return None
    joined = stash / "fa4.tar"
    with joined.open("wb") as out:
        for p in kept:
            out.write(p.read_bytes())
    with tarfile.open(joined) as tar:
        tar.extractall(stash, filter="data")
    wheels = sorted(str(w) for w in stash.glob("**/*.whl"))
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target"]
    subprocess.run([*pip, str(site), *wheels], check=True, timeout=300)
    return site


def run_step(step: SuiteStep, limit: int, log: Path, env: dict[str, str]) -> tuple[str, str]:
    """(status, detail) of one step run under `limit` seconds, its output in `log`. A step past its
    limit gets SIGTERM, then SIGKILL, with every process it started (its own process group)."""
    with log.open("w") as f:
        f.write(f"$ {' '.join(step.argv)}\n")
        f.flush()
        proc = subprocess.Popen(step.argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            f.write(f"\n=== cut at its time limit ({limit} s)\n")
            return "cut", f"at its limit of {limit} s"
    return ("ok", "rc=0") if rc == 0 else ("failed", f"rc={rc}")


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_SECONDS), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def write_summary(results: list[StepResult], work: Path) -> str:
    """summary.csv and summary.md in `work`; returns the markdown table."""
    import pandas as pd

    from pagedbench.bench.report_tables import markdown

    columns = ["name", "status", "seconds", "limit_s", "detail", "command"]
    with (work / "summary.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for r in results:
            writer.writerow([getattr(r, c) for c in columns])
    df = pd.DataFrame([[r.name, r.status, round(r.seconds, 1), r.limit_s, r.detail] for r in results])
    table = markdown(df.set_axis(["step", "status", "seconds", "limit s", "detail"], axis=1)) if results else ""
    left = [r.name for r in results if r.status in ("cut", "skipped")]
    remains = f"\nNot measured in this draw (the next `--next` takes them): {', '.join(left)}\n" if left else ""
    (work / "summary.md").write_text(f"# GPU suite summary\n\n{table}\n{remains}")
    return table


def pack(work: Path, out: Path) -> Path:
    """Everything under `work` into out/gpu-suite.tar.gz (written aside, then renamed: never half a tarball)."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (TARBALL + ".partial")
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(work, arcname=work.name)
    return tmp.replace(out / TARBALL)


def run_suite(
    steps: list[SuiteStep],
    work: Path,
    out: Path,
    budget_s: float,
    cuda: bool | None = None,
    env: dict[str, str] | None = None,
    fa4: bool | None = None,
) -> list[StepResult]:
    """Run `steps` in order within `budget_s` seconds, writing each one's log, the summary and the
    tarball as it ends. `cuda`/`fa4`: whether CUDA steps / FA4 steps can run (probed when None)."""
    deadline = time.monotonic() + budget_s
    env = {"PAGEDBENCH_FLEX_TUNE_SECONDS": "6"} | dict(os.environ if env is None else env) | {"PYTHONUNBUFFERED": "1"}
    cuda = cuda_available() if cuda is None else cuda
    (work / "logs").mkdir(parents=True, exist_ok=True)
    results: list[StepResult] = []
    ledger: list[LedgerRow] = []
    fa4_ok = None if fa4 is None else fa4
    commit = git_sha()
    for i, step in enumerate(steps):
        left = int(deadline - time.monotonic())
        limit = min(step.limit_s, left)
        step, skip = with_inputs(step, work)
        command = " ".join(step.argv)
        if skip is None and step.needs_cuda and not cuda:
            skip = "no CUDA device"
        elif skip is None and step.needs_fa4:
            fa4_ok = fa4_available(env) if fa4_ok is None else fa4_ok
            skip = None if fa4_ok else "FA4 not importable (pass --fa4-parts with its wheel halves)"
        if skip is None and limit < min(step.limit_s, MIN_STEP_SECONDS):
            skip = f"{max(left, 0)} s of the budget left"
        print(f"=== {step.name}: " + (f"skipped ({skip})" if skip else f"limit {limit} s: {command}"), flush=True)
        if skip:
            results.append(StepResult(step.name, "skipped", 0.0, step.limit_s, skip, command))
        else:
            t0 = time.monotonic()
            status, detail = run_step(step, limit, work / "logs" / f"{i:02d}-{step.name}.log", env | step.env)
            results.append(StepResult(step.name, status, time.monotonic() - t0, limit, detail, command))
            ledger.append(
                LedgerRow(step.name, status, round(results[-1].seconds, 1), code_hash(step.code), commit, today())
            )
            print(f"=== {step.name}: {status} ({detail}) in {results[-1].seconds:.0f} s", flush=True)
        write_summary(results, work)
        write_ledger(ledger, work)
        pack(work, out)
    return results


def with_inputs(step: SuiteStep, work: Path) -> tuple[SuiteStep, str | None]:
    """`step` with "{inputs}" replaced by its input files under work/reports, or why it cannot run."""
    if step.inputs is None:
        return step, None
    found = sorted(str(p) for p in (work / "reports").glob(step.inputs))
    if not found:
        return step, f"no {step.inputs} under the reports (the step that writes it did not run in this draw)"
    argv = [",".join(found) if a == "{inputs}" else a for a in step.argv]
    return SuiteStep(step.name, argv, step.limit_s, step.needs_cuda, step.needs_fa4, step.env, step.code), None


def environment() -> None:
    """The facts every figure of the suite is read with, and the copy bandwidth that scales them."""
    import platform

    import torch

    from pagedbench.bench.environment import device_name, git_sha

    print("pagedbench", git_sha(), "| python", platform.python_version(), "| torch", torch.__version__)
    for mod in ("triton", "transformers", "flash_attn.cute", "flashinfer"):
        try:
            m = __import__(mod, fromlist=["_"])
            print(mod, getattr(m, "__version__", "?"))
        except Exception as e:  # an optional kernel library; FA4's half-namespace package fails oddly
            print(mod, "not importable:", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print("device", device_name(device))
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        gib = round(p.total_memory / 2**30, 1)
        print("SMs", p.multi_processor_count, "| memory GiB", gib, f"| cc {p.major}.{p.minor}")
        print("cuda", torch.version.cuda)
        smi = shutil.which("nvidia-smi")
        if smi:
            q = "--query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem"
            print(subprocess.run([smi, q, "--format=csv"], capture_output=True, text=True).stdout.strip())
    from pagedbench.bench.timing import copy_bandwidth

    print(f"copy bandwidth {copy_bandwidth(device):,.0f} GB/s (read + write)")


if __name__ == "__main__" and sys.argv[1:] == ["environment"]:
    environment()
