"""Structured outputs on the real model (SmolLM2-135M-Instruct, greedy, sdpa, CPU fp32): a JSON
schema and choices, each under the chat template. Run from the repository root:
    python scripts/structured_outputs_demo.py > reports/cpu/smollm2/structured/outputs.jsonl
"""

import json

from pagedbench import LLM, SamplingParams
from pagedbench.sample.sampling_params import StructuredOutputsParams as S

llm = LLM("smollm2-135m-instruct", backend="sdpa", device="cpu")
book = {
    "type": "object",
    "required": ["title", "author", "year"],
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "author": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
    },
}
cases = [
    (
        "Give me a JSON object describing the novel Pride and Prejudice: its title, author and publication year.",
        S(json=book, disable_any_whitespace=True),
    ),
    (
        "Give me a JSON object describing the book The Hobbit: its title, author and publication year.",
        S(json=book, disable_any_whitespace=True),
    ),
    ("Is Paris the capital of France? Answer yes or no.", S(choice=["yes", "no"])),
    ("Is the Moon bigger than the Earth? Answer yes or no.", S(choice=["yes", "no"])),
    ("Which of these is a fruit: apple, carrot or potato?", S(choice=["apple", "carrot", "potato"])),
    (
        "What is the sentiment of this review: 'The food was cold and the waiter was rude.' "
        "Answer positive or negative.",
        S(choice=["positive", "negative"]),
    ),
]
outs = llm.chat(
    [[{"role": "user", "content": q}] for q, _ in cases],
    [SamplingParams(temperature=0, max_tokens=80, structured_outputs=s) for _, s in cases],
    use_tqdm=False,
)
for (q, s), o in zip(cases, outs):
    print(
        json.dumps({"prompt": q, "constraint": "json" if s.json else f"choice {s.choice}", "output": o.outputs[0].text})
    )
