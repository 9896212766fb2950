"""Bad input: a clear one-line error, and nothing else is lost."""

import shutil
import subprocess
import sys

import pytest

from pagedbench import LLM, LLMEngine, SamplingParams
from pagedbench.config import EngineConfig


@pytest.fixture(scope="module")
def engine(tiny_models):
    return LLMEngine(EngineConfig(model=tiny_models["llama"][0], dtype="float32", device="cpu", max_model_len=64))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(max_tokens=5.5), TypeError, "max_tokens must be an int, got 5.5"),
        (dict(max_tokens=True), TypeError, "max_tokens must be an int"),
        (dict(temperature=float("nan")), ValueError, "temperature must be finite"),
        (dict(top_p=float("inf")), ValueError, "top_p must be finite"),
        (dict(temperature="0.5"), TypeError, "temperature must be a number"),
        (dict(stop=123), TypeError, "stop must be a str or a list of str"),
        (dict(stop=["ok", 5]), TypeError, "stop must be a str or a list of str"),
        (dict(stop_token_ids=[1, 2.0]), TypeError, "stop_token_ids must be ints"),
        (dict(seed=2**70), ValueError, r"seed must be in \[0, 2\*\*63 - 1\]"),
        (dict(seed=-1), ValueError, "seed must be in"),
        (dict(seed=1.5), TypeError, "seed must be an int"),
        (dict(top_k=2.0), TypeError, "top_k must be an int"),
        (dict(ignore_eos="yes"), TypeError, "ignore_eos must be a bool"),
    ],
)
def test_bad_sampling_param_types_name_the_field(kwargs, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)


def test_max_tokens_none_generates_up_to_max_model_len(engine):
    """vLLM's max_tokens=None: no output limit but the model's length (max_model_len=64 here)."""
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True, min_tokens=5)
    rid = engine.add_request({"prompt_token_ids": [5, 6, 7, 8]}, params)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == [rid]
    assert len(done[0].outputs[0].token_ids) == 64 - 4 and done[0].outputs[0].finish_reason == "length"


def test_a_bad_request_mid_run_loses_nothing(engine):
    """Params made valid, then broken after construction, are refused at add_request: others finish."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    keep = engine.add_request({"prompt_token_ids": [5, 6, 7]}, params)
    engine.step()
    broken = SamplingParams(max_tokens=3)
    broken.max_tokens = 2.5
    with pytest.raises(TypeError, match="max_tokens must be an int"):
        engine.add_request({"prompt_token_ids": [5, 6]}, broken)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == [keep] and len(done[0].outputs[0].token_ids) == 4


def test_generate_keeps_outputs_of_requests_added_elsewhere(tiny_models):
    llm = LLM(tiny_models["llama"][0], dtype="float32", device="cpu")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    other = llm.engine.add_request({"prompt_token_ids": [5, 6, 7]}, params)
    mine = llm.generate([{"prompt_token_ids": [8, 9]}], params, use_tqdm=False)
    assert len(mine) == 1 and mine[0].request_id != other
    kept = llm.take_other_outputs()
    assert [o.request_id for o in kept] == [other] and len(kept[0].outputs[0].token_ids) == 3
    assert llm.take_other_outputs() == []


@pytest.mark.parametrize(
    "prompt,message",
    [
        ({"prompt_token_ids": []}, "empty"),
        ("", "empty"),
        ({"prompt_token_ids": list(range(3, 3 + 65))}, "max_model_len"),
        ({"prompt_token_ids": [1, 10**6]}, "vocabulary"),
        ({"prompt_token_ids": [1, "x"]}, "ints"),
        (42, "prompt"),
    ],
)
def test_bad_prompts(engine, prompt, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, SamplingParams())


def test_rejected_request_does_not_disturb_others(engine):
    good = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 30)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(inject_bad):
        ids = [engine.add_request(p, params) for p in good]
        engine.step()
        if inject_bad:  # requests in flight, then bad ones arrive
            for bad in ({"prompt_token_ids": []}, {"prompt_token_ids": list(range(100))}):
                with pytest.raises(ValueError):
                    engine.add_request(bad, params)
            with pytest.raises(ValueError):
                engine.add_request(good[0], params, request_id=ids[0])  # id in use
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        return [done[i] for i in ids]

    assert run(inject_bad=True) == run(inject_bad=False)
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_abort_frees_blocks_and_others_finish(engine):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    keep = engine.add_request({"prompt_token_ids": [5, 6, 7]}, params)
    drop = engine.add_request({"prompt_token_ids": list(range(5, 40))}, params)
    engine.step()
    engine.abort_request(drop)
    done = []
    while engine.has_unfinished_requests():
        done += [o.request_id for o in engine.step() if o.finished]
    assert done == [keep]
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_generate_validates_every_prompt_before_starting(tiny_models):
    llm = LLM(tiny_models["llama"][0], dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": []}], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_bad_engine_settings(tiny_models, tmp_path, tokenizerless_model):
    path = tiny_models["llama"][0]
    with pytest.raises(ValueError, match="unknown backend 'nope'; available: .*reference.*sdpa"):
        LLM(path, backend="nope")
    with pytest.raises(FileNotFoundError, match="neither a directory nor a preset"):
        LLM(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(empty))
    shutil.copy(f"{path}/config.json", empty / "config.json")
    with pytest.raises(ValueError, match="no .*safetensors"):
        LLM(str(empty))
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len=128"):
        LLM(path, num_blocks=4, block_size=16, max_model_len=128)
    with pytest.raises(ValueError, match="exceeds the model's limit"):
        LLM(path, max_model_len=10**6)
    with pytest.raises(ValueError, match="has no tokenizer"):
        LLM(tokenizerless_model, max_model_len=64).generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="unknown dtype"):
        LLM(path, dtype="float8")
    with pytest.raises(ValueError, match="block_size"):
        LLM(path, block_size=0)


def test_a_model_specific_setting_on_a_model_without_it_is_refused():
    """index_cache_dtype (DeepSeek-V3.2's indexer) and mamba_block_size (hybrids' DeltaNet) on a
    plain model: refused in one line, as the CLI refuses them."""
    with pytest.raises(ValueError, match=r"^index_cache_dtype fp8: model tiny-llama has no sparse-attention indexer"):
        LLM("tiny-llama", device="cpu", index_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"^mamba_block_size 32: model tiny-llama has no DeltaNet layers \(the"):
        LLM("tiny-llama", device="cpu", mamba_block_size=32)


def test_a_mistyped_model_gets_its_nearest_preset():
    with pytest.raises(FileNotFoundError, match=r"\(tiny-llama, .*\); did you mean 'deepseek-v3.2'\?$"):
        LLM("deepseek-v3.3")
    with pytest.raises(FileNotFoundError, match=r"smollm2-135m-instruct\)$"):  # nothing near: no guess
        LLM("no-such-model")


def test_unavailable_backend_is_refused_with_its_reason(tiny_models, monkeypatch):
    from pagedbench.backends.sdpa import SDPABackend

    monkeypatch.setattr(SDPABackend, "unavailable_reason", classmethod(lambda cls, *a, **k: "needs a teapot"))
    with pytest.raises(ValueError, match="backend 'sdpa' is unavailable here: needs a teapot"):
        LLM(tiny_models["llama"][0], backend="sdpa")


def run_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "pagedbench", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["run", "--backend", "nope"], "unknown backend 'nope'"),
        (["run", "--model", "/no/such/model"], "neither a directory nor a preset"),
        (["run", "--num-prompts", "0"], "num_prompts"),
        (["run", "--dtype", "float8"], "unknown dtype"),
        (["run", "--scale", "1e9"], "num_prompts must be <= 1,000,000"),
        (["run", "--num-prompts", str(10**12)], "num_prompts must be <= 1,000,000, got 1,000,000,000,000"),
        (["run", "--input-len", str(10**9)], "input_len + output_len must be <= 4,194,304 tokens per request"),
        (["run", "--num-prompts", "900000", "--input-len", "5000"], "num_prompts x lengths must be <= 2,147,483,648"),
        (["serve", "tiny-llama", "--port", "99999"], "--port must be in 1..65535, got 99999"),
        (["serve", "tiny-llama", "--port", "-1"], "--port must be in 1..65535, got -1"),
        (["serve", "tiny-llama", "--host", "no.such.host.invalid"], "--host 'no.such.host.invalid' cannot be resolved"),
        (["kv-calc", "tiny-llama", "--memory", "1e30"], "--memory must be in (0, 1048576] GiB"),
    ],
)
def test_cli_errors_are_one_line(args, message, tmp_path, monkeypatch, capsys):
    """In process, through the CLI's main (test_harness_cli runs three such errors as real processes:
    stderr one line, no traceback, a non-zero exit)."""
    from pagedbench.entrypoints.cli.main import main

    monkeypatch.chdir(tmp_path)  # nothing a failing command might write lands in the checkout
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # threads chosen: no notice beside the error on a busy machine
    assert main(args) != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


@pytest.mark.slow
def test_broken_model_directories_are_one_line_errors(tiny_models, tmp_path):
    import json

    source = tiny_models["llama"][0]
    truncated = tmp_path / "truncated"
    shutil.copytree(source, truncated)
    weights = next(truncated.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=f"cannot read weights from {weights}"):
        LLM(str(truncated), device="cpu")
    no_key = tmp_path / "no-key"
    shutil.copytree(source, no_key)
    config = json.loads((no_key / "config.json").read_text())
    del config["hidden_size"]
    (no_key / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json has no 'hidden_size', which a LlamaForCausalLM needs"):
        LLM(str(no_key), device="cpu")
    (no_key / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        LLM(str(no_key), device="cpu")
    proc = run_cli("run", "--model", str(truncated), "--num-prompts", "1", "--out", str(tmp_path / "reports"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedbench: error: cannot read weights from"), proc.stderr


def test_serve_refuses_an_address_in_use_before_building_the_engine(capsys):
    import socket

    from pagedbench.entrypoints.cli.main import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "tiny-llama", "--port", str(port)]) == 2
    err = capsys.readouterr()
    assert err.err == f"pagedbench: error: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    assert "serving" not in err.out  # never announced
