"""The step profile's CUDA accounting on events shaped as torch 2.11's profiler gives them on a GPU
(there is none here): which device events are kernels, which the forward and attention ran."""

from types import SimpleNamespace

from torch.autograd import DeviceType

from pagedbench.bench.step_profile import BACKEND_SPAN, FORWARD_SPAN, cuda_kernels


def event(name, device=DeviceType.CPU, parent=None, launches=(), annotation=False):
    kernels = [SimpleNamespace(name=k) for k in launches]
    return SimpleNamespace(name=name, device_type=device, cpu_parent=parent, kernels=kernels,
                           is_user_annotation=annotation)  # fmt: skip


def kernel(name):
    return event(name, DeviceType.CUDA)


def eager_step():
    """One eager layer: an aten GEMM under the forward span, a Triton attention kernel launched straight
    from the backend span (no aten op between), the sampler's op outside the forward, and the GPU-timeline
    copies (annotations) of both spans, which the profiler also lists as kernels of their span."""
    forward = event(FORWARD_SPAN, launches=[FORWARD_SPAN])
    backend = event(BACKEND_SPAN, parent=forward, launches=["paged_attention", BACKEND_SPAN])
    ops = [forward, backend, event("aten::mm", parent=forward, launches=["nvjet_gemm"])]
    ops.append(event("aten::argmax", launches=["argmax_kernel"]))
    device = [kernel("nvjet_gemm"), kernel("paged_attention"), kernel("argmax_kernel")]
    device += [
        event(FORWARD_SPAN, DeviceType.CUDA, annotation=True),
        event(BACKEND_SPAN, DeviceType.CUDA, annotation=True),
    ]
    return ops + device


def test_eager_counts_kernels_not_the_spans_copies_and_finds_attention_launched_by_its_span():
    counted, forward, attention = cuda_kernels(eager_step())
    assert sorted(e.name for e in counted) == ["argmax_kernel", "nvjet_gemm", "paged_attention"]
    assert (forward, attention) == (2, 1)


def test_a_replayed_graph_hides_attention_and_its_unlinked_kernels_are_the_forward():
    graph_launch = event("cudaGraphLaunch")
    sampler = event("aten::argmax", launches=["argmax_kernel"])
    device = [kernel("nvjet_gemm"), kernel("paged_attention"), kernel("triton_poi_fused_0"), kernel("argmax_kernel")]
    counted, forward, attention = cuda_kernels([graph_launch, sampler, *device])
    assert len(counted) == 4 and forward == 3 and attention is None
