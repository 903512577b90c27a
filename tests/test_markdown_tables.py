"""The benchmark tables share one markdown writer: templates per column, "—" for absent metrics."""

from __future__ import annotations

from lightning_dvi_benchmarks import classification, transformer


def test_classification_table_formats_mean_std_and_train_seconds() -> None:
    runs = {"dvi": [{"acc": 0.9, "train_s": 2.0}, {"acc": 0.8, "train_s": 4.0}]}
    lines = classification.markdown_table(runs, ("acc", "train_s", "ece")).splitlines()
    assert lines[0] == "| model | acc | train_s | ece |"
    assert lines[2] == "| dvi | 0.850 ± 0.050 | 3.0 | — |"


def test_transformer_table_labels_rows_and_keeps_its_cost_and_seconds_formats() -> None:
    runs = {"posthoc": [{"cost": 6.0, "train_s": 1.0, "nll": 0.4}, {"cost": 8.0, "train_s": 3.0}]}
    lines = transformer.markdown_table(runs, ("cost", "train_s", "nll", "ece")).splitlines()
    assert lines[0] == "| row | cost | train_s | nll | ece |"
    # nll is present in one run only: the mean over runs with NaN is NaN, printed as "—"
    assert lines[2] == "| posthoc | 7.00 ± 1.00 | 2.0 ± 1.0 | — | — |"
