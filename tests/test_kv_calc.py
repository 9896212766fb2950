"""KV memory accounting: `pagedbench kv-calc` equals figures computed by hand from the model
shapes, and the engine's internal-fragmentation count is exact."""

import torch

from pagedbench import LLM, SamplingParams
from pagedbench.bench.kv_calc import GIB, kv_bytes_per_token, kv_table
from pagedbench.engine.stats import wasted_slots
from pagedbench.entrypoints.cli.main import main
from pagedbench.model.loader import resolve_model_config


def test_qwen3_and_llama_figures_by_hand():
    qwen, _ = resolve_model_config("qwen3-0.6b")
    llama, _ = resolve_model_config("llama-3.2-1b")
    # Qwen3-0.6B: 28 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 114,688 B = 112 KiB per token.
    assert kv_bytes_per_token(qwen, torch.bfloat16) == 28 * 8 * 128 * 2 * 2 == 114_688
    # Llama-3.2-1B: 16 x 8 x 64 x 2 x 2 = 32,768 B per token; fp32 twice that.
    assert kv_bytes_per_token(llama, torch.bfloat16) == 32_768
    assert kv_bytes_per_token(llama, torch.float32) == 65_536
    row = kv_table(qwen, torch.bfloat16, 40 * GIB, [16], [1000]).iloc[0]
    # 40 GiB / (114,688 B x 16) = 23,405.7 -> 23,405 blocks; 1000 tokens = 63 blocks (8 slots empty).
    assert (row["blocks"], row["tokens"], row["blocks per seq"]) == (23_405, 374_480, 63)
    assert (row["concurrent seqs"], row["wasted slots per seq"]) == (371, 8)
    sweep = kv_table(llama, torch.bfloat16, 10 * GIB, [16, 128], [8192, 100])
    assert list(sweep["blocks"]) == [20_480, 20_480, 2_560, 2_560]
    assert list(sweep["concurrent seqs"]) == [40, 20_480 // 7, 40, 2_560]  # 100 tokens: 7 pages of 16, 1 of 128
    assert list(sweep["wasted slots per seq"]) == [0, 12, 0, 28]


def test_kv_calc_command(capsys):
    args = ["--memory", "40", "--block-size", "16,32", "--seq-len", "1000", "--dtype", "bf16"]
    assert main(["kv-calc", "qwen3-0.6b", *args]) == 0
    out = capsys.readouterr().out
    assert "114,688 B (112 KiB) per token" in out and "23405" in out and "11702" in out
    assert main(["kv-calc", "qwen3-0.6b", "--block-size", "0"]) == 2
    assert "--block-size takes positive integers" in capsys.readouterr().err
    # DeepSeek-V3: one latent plane per token and layer, 2 x (512 + 64) x 2 bytes, no separate V.
    assert main(["kv-calc", "deepseek-v3", "--memory", "1", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    latent = "2 layers x one latent of 512 + 64 rope dims (no separate V) x 2 B (bf16) = 2,304 B"
    assert latent in out
    # The cut preset says what it answers for, and what the real 61-layer model needs.
    assert "keeps 2 of the real model's 61 layers" in out and "(70,272 B)" in out
    assert main(["kv-calc", "qwen3-0.6b", "--memory", "1"]) == 0  # on a CPU: fp32, as run uses
    assert "x 4 B (fp32)" in capsys.readouterr().out


def test_wasted_slots_are_the_empty_part_of_last_pages(tiny_models):
    llm = LLM(tiny_models["llama"][0], dtype="float32", device="cpu", block_size=16)
    engine = llm.engine
    engine.add_request({"prompt_token_ids": list(range(5, 10))}, SamplingParams(n=3, temperature=1.0, max_tokens=3))
    engine.add_request({"prompt_token_ids": list(range(20, 52))}, SamplingParams(temperature=0, max_tokens=3))
    engine.step()
    # 5 computed tokens in one page shared by the 3 samples (11 empty slots, counted once);
    # 32 tokens fill two pages exactly (0 empty).
    assert wasted_slots(engine.scheduler.running, engine.config.block_size) == 11
    engine.step()  # each sample wrote its token into a private copy (6 tokens each); 33 tokens: 1 in page 3
    assert wasted_slots(engine.scheduler.running, engine.config.block_size) == 3 * 10 + 15
