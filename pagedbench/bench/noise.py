"""How sure a figure is: the spread of repeated runs (min-max), a bootstrap 95 % interval of their
median, and rankings that call backends "tied" when their intervals overlap the best's, not "0.93x".

A 2-core CPU shared with other work moves a run's throughput by tens of percent; one run per
backend ranks that noise. With fewer than MIN_RUNS_FOR_INTERVAL runs there is no interval and the
ranking says so.
"""

import numpy as np

MIN_RUNS_FOR_INTERVAL = 3
LEVEL = 0.95
RESAMPLES = 2000
NO_INTERVAL = f"no interval (< {MIN_RUNS_FOR_INTERVAL} runs)"


def median_interval(values, level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """A percentile-bootstrap interval of the median of `values` (NaN, NaN with fewer than
    MIN_RUNS_FOR_INTERVAL of them). Seeded: the same runs always give the same interval."""
    x = np.asarray([v for v in values if np.isfinite(v)], dtype=float)
    if len(x) < MIN_RUNS_FOR_INTERVAL:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(x, size=(resamples, len(x)), replace=True), axis=1)
    tail = (1 - level) / 2
    low, high = np.quantile(medians, [tail, 1 - tail])
    return float(low), float(high)


def spread(values) -> dict:
    """median, min, max and the median's interval of one backend's runs."""
    x = [float(v) for v in values if np.isfinite(v)]
    low, high = median_interval(x)
    return {
        "median": float(np.median(x)) if x else float("nan"),
        "min": min(x, default=float("nan")),
        "max": max(x, default=float("nan")),
        "ci_low": low,
        "ci_high": high,
        "runs": len(x),
    }


def rankings(spreads: dict) -> dict:
    """Per key, against the best median (higher is better): "best", "tied" where its interval
    overlaps the best's, else its median's ratio to the best ("0.93x"); NO_INTERVAL where either
    side has no interval (a ratio there would present noise as a gap)."""
    if not spreads:
        return {}
    best_key = max(spreads, key=lambda k: spreads[k]["median"])
    best = spreads[best_key]
    out = {}
    for key, s in spreads.items():
        if key == best_key:
            out[key] = "best" if np.isfinite(best["ci_low"]) or len(spreads) == 1 else NO_INTERVAL
        elif not (np.isfinite(s["ci_low"]) and np.isfinite(best["ci_low"])):
            out[key] = NO_INTERVAL
        elif s["ci_high"] >= best["ci_low"]:
            out[key] = "tied"
        else:
            out[key] = f"{s['median'] / best['median']:.2f}x"
    return out


def interval_text(low: float, high: float, digits: int = 1) -> str:
    """ "a-b" for the markdown, empty without an interval."""
    if not (np.isfinite(low) and np.isfinite(high)):
        return ""
    return f"{low:.{digits}f}–{high:.{digits}f}"
