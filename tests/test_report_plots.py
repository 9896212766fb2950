"""The kernel report's plots: what panels, axes and legend entries a reader gets (figures captured
before they are saved)."""

import pandas as pd
import pytest

from pagedbench.bench import report_plots


def kernel_rows(block_sizes=(16, 64), batches=(16, 64), contexts=(2048, 4096)) -> pd.DataFrame:
    rows = []
    for backend in ("flex", "triton"):
        for bs in block_sizes:
            for batch in batches:
                for ctx in contexts:
                    pct = 40.0 + bs / 4 + (10 if backend == "triton" else 0)
                    rows.append(
                        dict(kind="kernels", backend=backend, status="ok", phase="decode", batch_size=batch,
                             context_len=ctx, block_size=bs, num_heads=32, num_kv_heads=8, bandwidth_gbps=pct * 40,
                             pct_of_copy_bandwidth=pct, device_name="NVIDIA H200", dtype="bfloat16")
                    )  # fmt: skip
    return pd.DataFrame(rows)


@pytest.fixture
def figures(monkeypatch):
    saved = []

    def keep(fig, path):
        saved.append(fig)
        return path

    monkeypatch.setattr(report_plots, "_save", keep)
    return saved


def visible_axes(fig):
    return [ax for ax in fig.axes if ax.get_visible()]


def test_bandwidth_plot_has_a_panel_per_phase_and_batch_with_every_backend_and_page(figures, tmp_path):
    report_plots.plot_kernel_bandwidth(kernel_rows(), tmp_path / "k.png")
    axes = visible_axes(figures[0])
    assert [ax.get_title() for ax in axes] == ["decode, batch 16", "decode, batch 64"]
    for ax in axes:
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert labels == ["flex · page 16", "flex · page 64", "triton · page 16", "triton · page 64"]
        assert ax.get_ylabel().startswith("% of copy") and ax.get_xscale() == "log"
    assert "NVIDIA H200" in figures[0]._suptitle.get_text()


def test_bandwidth_plot_gives_each_variant_its_own_line(figures, tmp_path):
    """Dense latent and sparse (dsa) rows of one backend are two lines, not one zigzag between them."""
    rows = kernel_rows(block_sizes=(64,))
    both = pd.concat([rows.assign(variant="latent-512"), rows.assign(variant="dsa")])
    report_plots.plot_kernel_bandwidth(both, tmp_path / "k.png")
    labels = [t.get_text() for t in visible_axes(figures[0])[0].get_legend().get_texts()]
    assert labels == ["flex · latent-512", "triton · latent-512", "flex · dsa", "triton · dsa"]
    assert all(len(line.get_xdata()) == 2 for line in visible_axes(figures[0])[0].get_lines())


def test_bandwidth_plot_falls_back_to_gbps_without_a_copy_yardstick(figures, tmp_path):
    rows = kernel_rows(block_sizes=(16,))
    rows.loc[0, "pct_of_copy_bandwidth"] = float("nan")
    report_plots.plot_kernel_bandwidth(rows, tmp_path / "k.png")
    ax = visible_axes(figures[0])[0]
    assert ax.get_ylabel().startswith("KV bytes read")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["flex", "triton"]  # one page: not in the label


def test_page_size_plot_reads_each_batch_at_its_longest_context(figures, tmp_path):
    report_plots.plot_kernel_page_sizes(kernel_rows(block_sizes=(16, 32, 64, 128)), tmp_path / "p.png")
    axes = visible_axes(figures[0])
    assert [ax.get_title() for ax in axes] == ["decode, batch 16 x 4096 tokens", "decode, batch 64 x 4096 tokens"]
    line = axes[0].get_lines()[0]
    assert list(line.get_xdata()) == [16, 32, 64, 128] and list(line.get_ydata()) == [44.0, 48.0, 56.0, 72.0]
    assert axes[0].get_xlabel() == "page size (tokens)"


def test_report_adds_the_page_size_plot_only_for_several_page_sizes(tmp_path):
    from pagedbench.bench.report import render

    one = [p.name for p in render(kernel_rows(block_sizes=(16,)), tmp_path, "one")]
    two = [p.name for p in render(kernel_rows(), tmp_path, "two")]
    assert "one-bandwidth.png" in one and "one-page-size.png" not in one
    assert "two-bandwidth.png" in two and "two-page-size.png" in two


def serving_rows(device, model, backends_tok_s):
    return [
        dict(kind="serving", status="ok", backend=b, output_throughput=v, device_name=device, model=model,
             scenario="mixed", scale=1.0, dtype="bfloat16")
        for b, values in backends_tok_s.items() for v in values
    ]  # fmt: skip


def test_throughput_plot_gives_each_device_and_model_its_own_panel(figures, tmp_path):
    rows = serving_rows("NVIDIA H200", "qwen3-0.6b", {"triton": [13353.0], "flex": [8211.0]})
    rows += serving_rows("cpu", "tiny-llama", {"sdpa": [990.0, 950.0, 1040.0], "flex": [870.0, 869.0, 897.0]})
    report_plots.plot_throughput(pd.DataFrame(rows), tmp_path / "t.png")
    axes = visible_axes(figures[0])
    assert [ax.get_title() for ax in axes] == ["NVIDIA H200, qwen3-0.6b", "cpu, tiny-llama"]
    assert [t.get_text() for t in axes[0].get_yticklabels()] == ["flex", "triton"]  # short labels, not "· device"
    assert axes[0].get_xlim()[1] > 13353 > axes[1].get_xlim()[1]  # each panel its own axis


def test_throughput_bars_decades_apart_get_a_log_axis_and_small_values_keep_their_digits(figures, tmp_path):
    rows = serving_rows("cpu", "tiny-llama", {"triton": [1000.0], "hf": [0.79]})
    report_plots.plot_throughput(pd.DataFrame(rows), tmp_path / "t.png")
    ax = visible_axes(figures[0])[0]
    assert ax.get_xscale() == "log" and " 0.79" in [t.get_text() for t in ax.texts]
