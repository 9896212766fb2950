"""docs/cascade.md's figure: forward ms of each backend, flat and cascaded, per group size, from a
`kernels --variants cascade` CSV (default reports/cpu/cascade/kernels.csv) -> a PNG beside it."""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

path = Path(sys.argv[1] if len(sys.argv) > 1 else "reports/cpu/cascade/kernels.csv")
df = pd.read_csv(path)
df = df[(df["variant"] == "cascade") & (df["status"] == "ok")]
backends = list(dict.fromkeys(df["backend"]))
fig, axes = plt.subplots(1, len(backends), figsize=(5 * len(backends), 4), squeeze=False)
for ax, backend in zip(axes[0], backends):
    rows = df[df["backend"] == backend]
    for mode, marker in (("off", "o"), ("on", "s")):
        part = rows[rows["cascade"] == mode].sort_values("batch_size")
        label = "flat" if mode == "off" else "cascade"
        ax.errorbar(part["batch_size"], part["forward_median_ms"],
                    yerr=[part["forward_median_ms"] - part["forward_min_ms"], [0] * len(part)],
                    marker=marker, label=label, capsize=3)  # fmt: skip
    prefix, suffix = int(rows["prefix_len"].iloc[0]), int(rows["suffix_len"].iloc[0])
    ax.set(xscale="log", yscale="log", xlabel="group size (sequences sharing the prefix)", ylabel="forward ms")
    ax.set_title(f"{backend}: {prefix}-token prefix, +{suffix} each")
    ax.legend()
fig.suptitle(f"decode, median (bar down to min), {rows['device_name'].iloc[0]}, load {rows['load_average'].iloc[0]}")
fig.tight_layout()
out = path.with_name("cascade-vs-flat.png")
fig.savefig(out, dpi=110)
print(out)
