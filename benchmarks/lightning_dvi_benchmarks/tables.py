"""Result tables of the UCI benchmark: per-(dataset, method) summaries and their markdown.

:func:`summarise` turns per-split results into one row (means and standard errors over splits,
standard error = std / sqrt(n) with ``ddof=0``, CPU seconds per split); :func:`markdown_table`
writes the rows beside the paper's figures.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["SPLIT_KEYS", "markdown_table", "summarise"]

SPLIT_KEYS = ("split", "test_ll", "rmse", "seconds", "cpu_seconds", "steps")


def summarise(dataset: str, method: str, splits: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One JSON result row: means and standard errors over splits, CPU seconds per split.

    Args:
        dataset: the dataset's name.
        method: the method's name.
        splits: per-split results with ``split``, ``test_ll``, ``rmse``, ``seconds`` (wall) and
            optionally ``cpu_seconds`` and ``steps``.

    Raises:
        ValueError: for an empty list of splits.
    """
    if not splits:
        raise ValueError(f"no splits to summarise for {dataset}/{method}")
    ordered = sorted(splits, key=lambda r: int(r["split"]))
    ll = np.array([float(r["test_ll"]) for r in ordered])
    rmse = np.array([float(r["rmse"]) for r in ordered])
    n = len(ordered)
    cpu = [float(r["cpu_seconds"]) for r in ordered if "cpu_seconds" in r]
    return {
        "dataset": dataset,
        "method": method,
        "test_ll_mean": float(ll.mean()),
        "test_ll_stderr": float(ll.std() / math.sqrt(n)),
        "rmse_mean": float(rmse.mean()),
        "rmse_stderr": float(rmse.std() / math.sqrt(n)),
        "seconds": float(sum(float(r["seconds"]) for r in ordered)),
        "cpu_seconds_per_split": float(np.mean(cpu)) if len(cpu) == n else None,
        "splits": [{k: r[k] for k in SPLIT_KEYS if k in r} for r in ordered],
    }


def markdown_table(
    results: Sequence[Mapping[str, Any]],
    paper: Mapping[str, Mapping[str, tuple[float, float]]] | None = None,
) -> str:
    """Ours beside the paper's figure, with CPU seconds per split, one row per result.

    Args:
        results: rows of :func:`summarise`.
        paper: ``{method: {dataset: (mean, stderr)}}``; a missing figure reads ``n/a``.
    """
    lines = [
        "| dataset | method | splits | test LL (ours) | test LL (paper) | RMSE (ours) "
        "| CPU s / split |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        figure = (paper or {}).get(r["method"], {}).get(r["dataset"])
        paper_text = "n/a" if figure is None else f"{figure[0]:.2f} ± {figure[1]:.2f}"
        cpu = r.get("cpu_seconds_per_split")
        cpu_text = "n/a" if cpu is None else f"{cpu:.2f}"
        lines.append(
            f"| {r['dataset']} | {r['method']} | {len(r['splits'])} | "
            f"{r['test_ll_mean']:.3f} ± {r['test_ll_stderr']:.3f} | {paper_text} | "
            f"{r['rmse_mean']:.3f} ± {r['rmse_stderr']:.3f} | {cpu_text} |"
        )
    return "\n".join(lines)
