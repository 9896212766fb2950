"""Which FlexAttention kernels run a flex call, and the one compiled function they run in.

One `torch.compile(dynamic=True)` function; the BlockMasks' buffers have static power-of-two
capacities (`flex_masks`), so a graph is compiled per (call kind, heads, head_dim, dtype, page size,
capacity bucket); on CUDA the decode batch is a static power of two, as flex's decoding kernel
needs. The decode tuner's candidates compile in a wrapper of their own (`attend_candidate`), never
among the serving graphs; `compile_stats` counts both. `compile=False` or PAGEDBENCH_FLEX_COMPILE=0
runs flex eager (it materializes all scores). PAGEDBENCH_FLEX_KERNEL=flash runs the prefill call on FlexAttention's
FA4-based kernels (CUDA, with flash-attn-4 installed, a torch whose flex has BACKEND='FLASH')
instead of Triton; decodes stay on flex's Triton decoding kernel (FLASH wants K/V batch == query batch).
`kernels_unavailable_reason` says why the chosen kernels cannot run somewhere; `kernel_options` and
`triton_options` give each call its tiles.
"""

import logging
import time
import warnings
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from pagedbench import envs

logger = logging.getLogger(__name__)
# Eager flex runs only where chosen (compile=False, PAGEDBENCH_FLEX_COMPILE=0, sinks on a CPU) and
# the provider says so; torch's warning about it would repeat that on every run.
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile", category=UserWarning)

# KV blocks under 16 slots miscompute on CPU (torch 2.13's micro-GEMM N tail) and are below Triton's least tile.
MIN_KV_BLOCK = 16
compile_stats = {"graphs": 0, "candidates": 0}  # graphs compiled by this process: serving ones, tuning candidates
_announced: set[str] = set()  # call kinds whose first compile this process has announced


def compile_enabled() -> bool:
    return envs.enabled("PAGEDBENCH_FLEX_COMPILE")


def kernel_choice() -> str:
    """PAGEDBENCH_FLEX_KERNEL: `triton` (default) or `flash`, FlexAttention's FA4-based kernels."""
    return envs.get("PAGEDBENCH_FLEX_KERNEL")


def flash_kernel_reason(device: torch.device) -> str | None:
    """Why flex's BACKEND='FLASH' (FA4, CuTe DSL) cannot run here, or None."""
    import importlib.util
    import typing

    from torch.nn.attention import flex_attention as flex_module

    if device.type != "cuda":
        return f"FA4 kernels need CUDA (device is {device})"
    if "FLASH" not in typing.get_args(getattr(flex_module, "_Backend", None)):
        return f"torch {torch.__version__}'s flex has no BACKEND='FLASH'"
    if not compile_enabled():
        return "BACKEND='FLASH' needs compiled flex (PAGEDBENCH_FLEX_COMPILE=0 is set)"
    try:
        found = importlib.util.find_spec("flash_attn.cute") is not None
    except Exception:
        found = False
    return None if found else "flash_attn.cute (FA4) is not installed (pip install 'pagedbench[fa4]')"


def kernels_unavailable_reason(device: torch.device, block_size: int) -> str | None:
    """Why the kernels PAGEDBENCH_FLEX_KERNEL and PAGEDBENCH_FLEX_COMPILE choose cannot run on `device`
    over pages of `block_size`, or None."""
    try:
        kernel = kernel_choice()
    except ValueError as e:
        return str(e)
    if kernel == "flash":
        reason = flash_kernel_reason(device)
        if not reason and block_size < MIN_KV_BLOCK:
            reason = f"pages of {block_size} share KV blocks, leaving no full blocks, which FLASH needs"
        if reason:
            return f"PAGEDBENCH_FLEX_KERNEL=flash: {reason}"
    if device.type == "cpu" and compile_enabled():
        from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported

        if not check_cpu_supported():
            return "compiled flex on CPU needs x86 with AVX2 (PAGEDBENCH_FLEX_COMPILE=0 runs it eager)"
    return None


HOPPER_SHARED_MEMORY = 232448  # bytes a thread block may opt into on an H100/H200 (227 KiB)
WIDE_HEAD_DIM = 256  # wider heads (MLA's 576) also narrow the decoding kernel's tiles


def prefill_tiles(q_block_size: int, kv_block_size: int, head_dim: int, itemsize: int, shared_bytes: int) -> dict:
    """flex's Triton prefill tiles, the widest that fit `shared_bytes`: the query tile once and a K tile
    per pipeline stage, each as wide as the head padded to a power of two (the H200 reported 262,144 bytes
    for 32 x 32 fp32 tiles of a 576-wide head at one stage). Fewer stages first, then halved tiles;
    the template's own stage count (3) where it fits; the larger tile halved first, each down to 16
    rows. Tiles divide the mask's blocks."""
    width = 1 << (head_dim - 1).bit_length()
    m, n = min(64, q_block_size), min(64, kv_block_size)
    for stages in (3, 2):
        if (m + n * stages) * width * itemsize <= shared_bytes:
            return {"BLOCK_M": m, "BLOCK_N": n} | ({} if stages == 3 else {"num_stages": stages})
    while (m + n) * width * itemsize > shared_bytes and max(m, n) > 16:
        if m >= n:
            m //= 2
        else:
            n //= 2
    return {"BLOCK_M": m, "BLOCK_N": n, "num_stages": 1}


def shared_memory_bytes(device: torch.device) -> int:
    """The opt-in shared memory per thread block of `device` (an H100/H200's where torch cannot say)."""
    try:
        return torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    except (AssertionError, RuntimeError, AttributeError):  # no CUDA here (tests of the CUDA options)
        return HOPPER_SHARED_MEMORY


def triton_options(
    device: torch.device, q_block_size: int, kv_block_size: int, head_dim: int, dtype: torch.dtype
) -> dict | None:
    """flex's Triton prefill template with the widest tiles that fit; None on CPU (the template's own)."""
    if device.type != "cuda":
        return None
    tiles = prefill_tiles(q_block_size, kv_block_size, head_dim, dtype.itemsize, shared_memory_bytes(device))
    return {"BACKEND": "TRITON"} | tiles


def kernel_options(
    device: torch.device, q_block_size: int, kv_block_size: int, head_dim: int, dtype: torch.dtype
) -> dict[str, dict]:
    """flex's kernel_options per call kind ("decode", "prefill"); None on CPU."""
    if device.type != "cuda":
        return {"decode": None, "prefill": None}
    triton_prefill = triton_options(device, q_block_size, kv_block_size, head_dim, dtype)
    if head_dim > WIDE_HEAD_DIM:
        # The decoding kernel's query tile would hold a KV head's whole query group (MLA: 16-128 rows of
        # 1024 padded dims): 16 rows, the prefill's K tile, one stage.
        decode = {"BLOCK_M": 16, "BLOCK_N": triton_prefill["BLOCK_N"], "num_stages": 1}
        return {"decode": decode, "prefill": triton_prefill}
    # FlexAttention's FA4 kernels (BACKEND=FLASH) take only the prefill call: they need K/V batch ==
    # query batch, and the decode call broadcasts a batch-1 cache to B query rows.
    return {
        "decode": {"BLOCK_N": min(64, kv_block_size)},
        "prefill": {"BACKEND": "FLASH"} if kernel_choice() == "flash" else triton_prefill,
    }


def attend(
    q,
    k,
    v,
    block_mask: BlockMask,
    scale: float,
    kernel_options: dict | None,
    score_mod: Callable | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eager flex: q [B, H, Q, D] over k, v [1, H_kv, N, D] (broadcast, GQA) -> [B, H, Q, D].
    Sinks (a logit per query head in the denominator, no value), shaped to broadcast with the
    log-sum-exp [B, H, Q], rescale flex's output: out * e^lse / (e^lse + e^sink) = out * sigmoid(lse - sink)."""
    kwargs = dict(block_mask=block_mask, scale=scale, enable_gqa=True, kernel_options=kernel_options)
    if sinks is None:
        return flex_attention(q, k, v, score_mod, **kwargs)
    out, aux = flex_attention(q, k, v, score_mod, return_aux=AuxRequest(lse=True), **kwargs)
    return out * torch.sigmoid(aux.lse - sinks).unsqueeze(-1).to(out.dtype)


def softcap_score_mod(softcap: float, device: torch.device) -> Callable:
    """Gemma 2's logit soft-capping as a flex score_mod (applied to the scaled score). The cap is a
    tensor, not a constant: one compiled graph serves every cap value (Gemma 2's 50 and 30)."""
    cap = torch.tensor(softcap, dtype=torch.float32, device=device)

    def capped(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return capped


def _inductor_counting(gm, example_inputs):
    from torch._inductor.compile_fx import compile_fx

    compile_stats["graphs"] += 1
    return compile_fx(gm, example_inputs)


attend_compiled = torch.compile(attend, backend=_inductor_counting, fullgraph=True, dynamic=True)


def _candidate(q, k, v, block_mask, scale, kernel_options, score_mod=None, sinks=None) -> torch.Tensor:
    """`attend` under a code object of its own: dynamo keeps compiled graphs per code object, so the
    decode tuner's candidates (a graph each) never join the serving function's graphs, whose guards
    every call walks (the engine's eager mixed steps once walked about 50)."""
    return attend(q, k, v, block_mask, scale, kernel_options, score_mod, sinks)


def _inductor_candidate(gm, example_inputs):
    from torch._inductor.compile_fx import compile_fx

    compile_stats["candidates"] += 1
    return compile_fx(gm, example_inputs)


attend_candidate = torch.compile(_candidate, backend=_inductor_candidate, fullgraph=True, dynamic=True)


def forget_candidates() -> None:
    """Drop the candidates' compiled graphs (after a search: its winner is compiled again by the serving
    function, and the candidate wrapper's graphs never reach the recompile limit)."""
    torch._dynamo.reset_code(_candidate.__code__)


def attend_compiling(
    kind: str, args: tuple, recompile_limit: int, compiled: Callable = attend_compiled
) -> tuple[torch.Tensor, float]:
    """`compiled(*args)` (the serving `attend_compiled`, or the tuner's `attend_candidate`) where its
    graph may not exist yet (a step's first layer): returns the output and the seconds spent compiling.
    Past `recompile_limit` graphs dynamo would silently run flex's unfused eager path instead; here that
    raises. Sizes equal by chance must not become guards (duck shapes)."""
    if kind not in _announced:
        logger.info("flex: the first %s call compiles its kernel (tens of seconds on a CPU)", kind)
        _announced.add(kind)
    counter = "graphs" if compiled is attend_compiled else "candidates"
    graphs, start = compile_stats[counter], time.perf_counter()
    with (
        torch._dynamo.config.patch(
            recompile_limit=recompile_limit, fail_on_recompile_limit_hit=True, specialize_float=True
        ),
        torch.fx.experimental._config.patch(use_duck_shape=False),
    ):
        y = compiled(*args)
    if compile_stats[counter] == graphs:
        return y, 0.0
    seconds = time.perf_counter() - start
    logger.info("flex: compiled a %s graph in %.1f s", kind, seconds)
    return y, seconds
