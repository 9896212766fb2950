"""A small trained model pair that predicts something: a byte-level Llama target (3 layers, hidden
192) and a draft (1 layer, hidden 128), trained on Python's own standard-library sources (which ship
with every Python, so no download). Speculative decoding needs it: a draft agrees with a
random-weight target only by chance. Random presets stay for speed; this pair is for acceptance
and quality numbers.

`python -m pagedbench.model.trained_pair` rebuilds them (about four minutes on 2 cores) into
pagedbench/model/weights/ as Hugging Face model directories (config.json, bf16 safetensors, the
byte-level tokenizer, training.json with the held-out bits per byte). `LLM("py-byte-target")`
and `LLM("py-byte-draft")` load the committed ones by name.
"""

import argparse
import json
import math
import pathlib
import sys
import sysconfig
import time

import torch

WEIGHTS = pathlib.Path(__file__).parent / "weights"
VOCAB, EOS = 260, 256  # bytes 0..255 are their own ids; 256 ends a text; 257..259 unused
SEQ, BATCH = 256, 16
SHAPES = {
    "py-byte-target": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=3, num_attention_heads=6),
    "py-byte-draft": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=1, num_attention_heads=4),
}
STEPS = {"py-byte-target": 500, "py-byte-draft": 300}
LR = 6e-3
HELD_OUT_EVERY = 8  # every 8th stdlib module (sorted by name) is held out for bits per byte


def trained_models() -> dict[str, pathlib.Path]:
    """Name -> directory of the committed pair (empty where it is not there)."""
    return {name: WEIGHTS / name for name in SHAPES if (WEIGHTS / name / "config.json").is_file()}


def corpus() -> tuple[bytes, bytes, list[str]]:
    """(training bytes, held-out bytes, the files): the standard library's top-level modules."""
    files = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    train = b"".join(f.read_bytes() for i, f in enumerate(files) if i % HELD_OUT_EVERY)
    held_out = b"".join(f.read_bytes() for i, f in enumerate(files) if not i % HELD_OUT_EVERY)
    return train, held_out, [f.name for f in files]


def held_out_tokens(tokenizer, starts, lengths) -> list[list[int]]:
    """A real tokenizer's ids of held-out source (corpus()[1]): for each byte offset in `starts`,
    up to `lengths` tokens of the text from the start of its line (the pair reads bytes as ids)."""
    text = corpus()[1]
    windows = []
    for start, n in zip(starts, lengths):
        start = text.rfind(b"\n", 0, int(start)) + 1
        chunk = text[start : start + 16 * int(n)].decode("utf-8", "replace")  # >= n tokens of source
        windows.append(tokenizer.encode(chunk, add_special_tokens=False)[: int(n)])
    return windows


def _config(name: str):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None,
        eos_token_id=EOS,
        architectures=["LlamaForCausalLM"],
        **SHAPES[name],
    )


def train(name: str, data: bytes, steps: int, seed: int = 0):
    """The model trained on random SEQ-byte windows of `data` (AdamW, cosine decay), in fp32."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(_config(name))
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    warmup = steps // 10

    def lr_factor(step: int) -> float:  # linear warm-up, then cosine decay to 0
        return (
            (step + 1) / warmup if step < warmup else 0.5 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup)))
        )

    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(tokens) - SEQ, (BATCH,), generator=gen)
        batch = torch.stack([tokens[s : s + SEQ] for s in starts.tolist()])
        model(input_ids=batch, labels=batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad()
    return model.eval()


@torch.no_grad()
def bits_per_byte(model, data: bytes, windows: int = 64) -> float:
    """Mean next-byte cross-entropy in bits over `windows` evenly spaced SEQ-byte windows of `data`."""
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    starts = torch.linspace(0, len(tokens) - SEQ - 1, windows).long().tolist()
    batch = torch.stack([tokens[s : s + SEQ] for s in starts])
    return model(input_ids=batch, labels=batch).loss.item() / math.log(2)


def build_pair(out: pathlib.Path = WEIGHTS) -> dict[str, dict]:
    """Train, evaluate and save both models; returns each one's training record."""
    from pagedbench.model.tokenizer import preset_tokenizer

    torch.set_num_threads(min(torch.get_num_threads(), 2) if torch.get_num_threads() else 2)
    train_bytes, held_out, files = corpus()
    records = {}
    for name in SHAPES:
        start = time.perf_counter()
        model = train(name, train_bytes, STEPS[name])
        record = {
            "corpus": f"Python {sys.version.split()[0]} stdlib top-level modules ({len(files)} files)",
            "held_out": f"every {HELD_OUT_EVERY}th module, {len(held_out)} bytes",
            "train_bytes": len(train_bytes),
            "steps": STEPS[name],
            "batch": f"{BATCH} x {SEQ} bytes",
            "parameters": sum(p.numel() for p in model.parameters()),
            "held_out_bits_per_byte": round(bits_per_byte(model, held_out), 4),
            "train_seconds": round(time.perf_counter() - start, 1),
        }
        path = out / name
        model.to(torch.bfloat16).save_pretrained(str(path))
        preset_tokenizer(VOCAB, [EOS]).save_pretrained(str(path))
        (path / "training.json").write_text(json.dumps(record, indent=2) + "\n")
        records[name] = record
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=WEIGHTS, help="where the two model directories go")
    args = parser.parse_args(argv)
    for name, record in build_pair(args.out).items():
        print(f"{name}: {json.dumps(record)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
