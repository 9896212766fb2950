"""How sure a figure is: the spread of repeated runs (min-max), an interval of their median, and
rankings that call backends "tied" when their intervals overlap the best's, not "0.93x".

A 2-core CPU shared with other work moves a run's throughput by tens of percent; one run per
backend ranks that noise. With fewer than MIN_RUNS_FOR_INTERVAL runs there is no interval and the
ranking says so.

The interval is the distribution-free one of the median from order statistics: with n sorted
runs, [x(k), x(n+1-k)] holds the true median with probability 1 - 2 P(Binomial(n, 1/2) < k),
whatever the runs' distribution (independent runs assumed). It takes the largest k that still
reaches LEVEL, so it narrows as runs grow (x(2)..x(8) of 9, x(3)..x(10) of 12). Under
RUNS_FOR_LEVEL runs no k reaches 95 %: the interval is min-max and its confidence is what it is
(75 % at 3 runs, 94 % at 5), which `median_interval_level` gives and the reports print. (A
percentile bootstrap of the median also gives min-max at 3-6 runs, but calls it 95 %.)
"""

import math

import numpy as np

MIN_RUNS_FOR_INTERVAL = 3
LEVEL = 0.95
NO_INTERVAL = f"no interval (< {MIN_RUNS_FOR_INTERVAL} runs)"


def _coverage(n: int, k: int) -> float:
    """P(x(k) <= true median <= x(n+1-k)) for n independent runs of a continuous distribution."""
    return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n


def _order_k(n: int, level: float) -> int:
    """The largest k whose [x(k), x(n+1-k)] reaches `level` (1, min-max, when none does)."""
    k = 1
    while k + 1 <= (n + 1) // 2 and _coverage(n, k + 1) >= level:
        k += 1
    return k


def median_interval_level(n: int, level: float = LEVEL) -> float:
    """The confidence of `median_interval` over n runs: `level` or more from RUNS_FOR_LEVEL runs,
    less below (min-max's own: 1 - 2 / 2^n); NaN under MIN_RUNS_FOR_INTERVAL."""
    return _coverage(n, _order_k(n, level)) if n >= MIN_RUNS_FOR_INTERVAL else float("nan")


RUNS_FOR_LEVEL = next(n for n in range(1, 64) if _coverage(n, 1) >= LEVEL)  # 6 for 95 %


def median_interval(values, level: float = LEVEL) -> tuple[float, float]:
    """The order-statistic interval of the median of `values` (module doc), NaN, NaN with fewer
    than MIN_RUNS_FOR_INTERVAL of them. Deterministic: the same runs, the same interval."""
    x = np.sort(np.asarray([v for v in values if np.isfinite(v)], dtype=float))
    if len(x) < MIN_RUNS_FOR_INTERVAL:
        return float("nan"), float("nan")
    k = _order_k(len(x), level)
    return float(x[k - 1]), float(x[len(x) - k])


def spread(values) -> dict:
    """median, min, max, the median's interval and its confidence (`level`) of one backend's runs."""
    x = [float(v) for v in values if np.isfinite(v)]
    low, high = median_interval(x)
    return {
        "median": float(np.median(x)) if x else float("nan"),
        "min": min(x, default=float("nan")),
        "max": max(x, default=float("nan")),
        "ci_low": low,
        "ci_high": high,
        "level": median_interval_level(len(x)),
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


def interval_text(low: float, high: float, digits: int = 1, level: float = LEVEL) -> str:
    """ "a–b" for the markdown, "a–b (75%)" where the interval's confidence is under LEVEL (too few
    runs), empty without an interval."""
    if not (np.isfinite(low) and np.isfinite(high)):
        return ""
    text = f"{low:.{digits}f}–{high:.{digits}f}"
    return text if not level < LEVEL else f"{text} ({100 * level:.0f}%)"
