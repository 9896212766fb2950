"""Sampling: SamplingParams (what a request asks for) and the batched sampler that applies them on the device."""
