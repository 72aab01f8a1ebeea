"""The comparison as a PNG. matplotlib is the optional extra ``plot``, imported only here."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from sessionfleet.fleetsim._results import SimResult


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _pyplot() -> Any:
    try:
        # Imported by name: matplotlib is optional and has no type stubs here.
        matplotlib = importlib.import_module("matplotlib")
        matplotlib.use("Agg")  # files only: no display is needed or wanted
        plt = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        raise PlotUnavailable(
            "--plot needs matplotlib: pip install 'sessionfleet[plot]' (or pip install matplotlib)"
        ) from None
    return plt


def plot_results(results: Sequence[SimResult], path: str, title: str = "") -> None:
    """Write a PNG: hit rate and TTFT per strategy, and the hit rate over time."""
    plt = _pyplot()
    labels = [r.strategy for r in results]
    figure, axes = plt.subplots(1, 3, figsize=(17, 5.5))
    hit, ttft, series = axes

    positions = range(len(results))
    hit.barh(positions, [r.hit_rate * 100 for r in results], color="tab:blue")
    hit.set_yticks(list(positions), labels)
    hit.invert_yaxis()
    hit.set_xlim(0, 100)
    hit.set_xlabel("prefix cache hit rate (%)")
    for index, result in enumerate(results):
        # Inside long bars, so that the label never runs into the next panel.
        inside = result.hit_rate > 0.8
        hit.text(
            result.hit_rate * 100 + (-2 if inside else 1),
            index,
            f"{result.hit_rate:.1%}",
            va="center",
            ha="right" if inside else "left",
            color="white" if inside else "black",
        )

    height = 0.4
    ttft.barh(
        [p - height / 2 for p in positions],
        [r.ttft_mean for r in results],
        height,
        label="mean",
        color="tab:orange",
    )
    ttft.barh(
        [p + height / 2 for p in positions],
        [r.ttft_p95 for r in results],
        height,
        label="p95",
        color="tab:red",
    )
    ttft.set_yticks(list(positions), [""] * len(results))
    ttft.invert_yaxis()
    ttft.set_xlabel("time to first token (s)")
    ttft.legend(loc="lower right")

    for result in results:
        minutes = []
        rates = []
        for index, (total, cached) in enumerate(
            zip(result.bin_input, result.bin_cached, strict=True)
        ):
            if total:
                minutes.append(index * result.bin_seconds / 60)
                rates.append(100 * cached / total)
        series.plot(minutes, rates, label=result.strategy, linewidth=1)
    for result in results[:1]:
        for drain in result.drains:
            series.axvline(drain.started / 60, color="grey", linestyle="--", linewidth=0.8)
        for failure in result.failures:
            series.axvline(failure.failed / 60, color="black", linestyle=":", linewidth=0.8)
    series.set_ylim(0, 100)
    series.set_xlabel("time (min); dashed: drains, dotted: failures")
    series.set_ylabel("hit rate per minute (%)")
    series.legend(fontsize="small", loc="lower left")

    if title:
        figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
