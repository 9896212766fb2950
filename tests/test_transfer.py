"""Host<->device copies per step: every one goes through pagedbench.device.transfer, so they can be counted."""

import numpy as np
import pytest
import torch

from pagedbench import LLM, SamplingParams
from pagedbench.device.transfer import counting, to_device, to_device_packed, to_list

CPU = torch.device("cpu")


def test_packed_copy_is_one_transfer_per_dtype_and_keeps_shapes():
    arrays = [np.arange(5, dtype=np.int32), np.arange(6, dtype=np.int64).reshape(2, 3), np.ones((2, 2), np.int32)]
    with counting() as copies:
        out = to_device_packed(arrays, CPU)
    assert copies == {"h2d": 2}
    for a, t in zip(arrays, out):
        assert t.shape == a.shape and t.dtype == torch.from_numpy(a).dtype
        assert np.array_equal(t.numpy(), a)


def test_pack_and_unpack_round_trip_through_one_buffer_per_dtype():
    """The CUDA path (and the graphs' static inputs): one flat buffer per dtype, views back."""
    from pagedbench.device.transfer import copy_to_device_, pack, unpack

    arrays = [np.arange(3, dtype=np.int32), np.arange(8, dtype=np.int64).reshape(2, 4), np.full((3, 2), 7, np.int32)]
    packed = pack(arrays)
    assert [(d, len(h)) for d, h in packed.items()] == [(np.dtype(np.int32), 9), (np.dtype(np.int64), 8)]
    buffers = {d: torch.zeros(len(h), dtype=torch.from_numpy(h).dtype) for d, h in packed.items()}
    with counting() as copies:
        for d, h in packed.items():
            copy_to_device_(buffers[d], h)
    assert copies == {"h2d": 2}
    for a, view in zip(arrays, unpack(buffers, arrays)):
        assert np.array_equal(view.numpy(), a)


def test_counters_nest_and_close():
    with counting() as outer:
        to_device(np.zeros(3), CPU)
        with counting() as inner:
            to_list(torch.zeros(2))
    to_device(np.zeros(3), CPU)
    assert outer == {"h2d": 1, "d2h": 1} and inner == {"d2h": 1}


def _decode_step_copies(engine, steps=3):
    counts = []
    for _ in range(steps):
        with counting() as copies:
            engine.step()
        counts.append(dict(copies))
    return counts


# Each backend's own host-to-device copies per step, beside the model runner's two (one per dtype).
BACKEND_COPIES = {"sdpa": 0, "reference": 0, "flex": 1}


@pytest.mark.parametrize("backend", ["sdpa", "reference", "flex"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_steady_decode_step_copies_its_inputs_once_and_reads_back_once(backend, temperature):
    llm = LLM("tiny-llama", backend=backend, device="cpu", num_blocks=64, max_num_seqs=4)
    engine = llm.engine
    params = SamplingParams(temperature=temperature, top_p=0.9, top_k=20, max_tokens=8, ignore_eos=True)
    for i in range(4):
        engine.add_request({"prompt_token_ids": list(range(10 + i, 20 + i))}, params)
    engine.step()  # the prefill: it builds the sampling tensors
    expected = {"h2d": 2 + BACKEND_COPIES[backend], "d2h": 1}
    assert _decode_step_copies(engine) == [expected] * 3


def test_logprobs_come_back_in_the_same_single_read():
    """Sampled ids, their logprobs, ranks and top logprobs: one device-to-host copy per step."""
    llm = LLM("tiny-llama", device="cpu", num_blocks=64, max_num_seqs=4)
    engine = llm.engine
    for i, logprobs in enumerate([None, 3, 0]):
        engine.add_request(
            {"prompt_token_ids": [5 + i, 6, 7]}, SamplingParams(max_tokens=6, logprobs=logprobs, ignore_eos=True)
        )
    engine.step()
    assert _decode_step_copies(engine, 2) == [{"h2d": 2, "d2h": 1}] * 2
    outs = {o.request_id: o for o in engine.step()}
    entry = outs["1"].outputs[0].logprobs[-1]
    assert len(entry) in (3, 4) and all(isinstance(t, int) for t in entry)  # the top 3 and the sampled token
    assert entry[outs["1"].outputs[0].token_ids[-1]].rank >= 1


def test_sampling_tensors_are_rebuilt_when_the_batch_changes():
    llm = LLM("tiny-llama", device="cpu", num_blocks=64, max_num_seqs=4)
    engine = llm.engine
    engine.add_request({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0.7, max_tokens=2, ignore_eos=True))
    engine.add_request({"prompt_token_ids": [8, 9]}, SamplingParams(temperature=0.7, max_tokens=6, ignore_eos=True))
    engine.step()
    first = engine.token_picker.sampling_batch
    engine.step()
    assert engine.token_picker.sampling_batch.temperature is first.temperature  # same sequences: nothing copied
    (steady,) = _decode_step_copies(engine, 1)  # the first request finished last step: one row left
    assert steady["h2d"] > 2 and steady["d2h"] == 1
    assert [s.request_id for s in engine.token_picker.sampling_batch.seqs] == ["1"]
