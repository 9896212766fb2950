"""The backend contract seen from outside: a third-party backend registered through the
`pagedbench.backends` entry-point group, planned once per step and called once per layer."""

from importlib.metadata import EntryPoint

import pytest
from pagedbench.backends import registry
from pagedbench.backends.sdpa import SDPABackend

from pagedbench import LLM, SamplingParams


class CountingBackend(SDPABackend):
    name = "counting"
    plans = 0
    forwards = 0

    def plan(self, meta):
        CountingBackend.plans += 1
        return super().plan(meta)

    def forward(self, q, k_cache, v_cache, state):
        CountingBackend.forwards += 1
        return super().forward(q, k_cache, v_cache, state)


@pytest.fixture
def counting_entry_point(monkeypatch):
    ep = EntryPoint("counting", "tests.test_registry:CountingBackend", "pagedbench.backends")
    monkeypatch.setattr(registry, "entry_points", lambda group: [ep] if group == "pagedbench.backends" else [])
    yield
    registry._loaded.pop("counting", None)


def test_entry_point_backend_runs_once_per_step_and_layer(tiny_models, counting_entry_point):
    assert "counting" in registry.list_backends()
    path = tiny_models["llama"][0]
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (1, 9, 40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(path, backend="counting", dtype="float32", device="cpu", max_num_batched_tokens=16)
    CountingBackend.plans = CountingBackend.forwards = 0
    outs = llm.generate(prompts, params, use_tqdm=False)
    steps, layers = llm.engine.stats.steps, llm.engine.model_config.num_layers
    assert CountingBackend.plans == steps and CountingBackend.forwards == steps * layers
    expected = LLM(path, backend="sdpa", dtype="float32", device="cpu").generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]


def test_resolve_is_one_call_for_class_provider_and_reason():
    import torch
    from pagedbench.backends.registry import resolve

    found = resolve("sdpa", torch.device("cpu"), torch.float32, 64, 16)
    assert found.runnable and found.reason is None and found.name == "sdpa" and found.provider
    gpu_only = resolve("flash-attn", torch.device("cpu"), torch.float32, 64, 16)
    assert not gpu_only.runnable and "CUDA" in gpu_only.reason
    import pytest

    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        resolve("nope", torch.device("cpu"), torch.float32, 64, 16)


def test_a_backend_written_to_the_old_contract_plans_through_its_prepare(caplog):
    """prepare() was plan()'s name: a backend that still overrides it (calling super().prepare) plans
    through it, with a one-line note, and prepare() stays callable on every backend."""
    import torch

    from pagedbench.bench.problems import random_attention_batch

    with caplog.at_level("WARNING", logger="pagedbench.backends.base"):

        class OldStyle(SDPABackend):
            calls = 0

            def prepare(self, meta):
                OldStyle.calls += 1
                return super().prepare(meta)

    assert [r.getMessage() for r in caplog.records] == [
        "OldStyle.prepare() is now plan(), the backend contract's name: planning with it"
    ]
    batch = random_attention_batch([(7, 1), (0, 5)], 4, 2, 16, 16)
    args = (4, 2, 16, 16**-0.5, 16, torch.device("cpu"), torch.float32)
    old, new = OldStyle(*args), SDPABackend(*args)
    got = old.forward(batch.q, batch.k_cache, batch.v_cache, old.plan(batch.metadata))
    assert OldStyle.calls == 1
    want = new.forward(batch.q, batch.k_cache, batch.v_cache, new.prepare(batch.metadata))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
