"""Write scikit-learn's diabetes data as a CSV file with a header.

442 patients, 10 inputs, a disease-progression target: a real table to try
:class:`lightning_dvi.data.CSVDataModule` on:

    python recipes/make_diabetes_csv.py diabetes.csv
    lightning-dvi fit --config recipes/csv_regression.yaml --data.path diabetes.csv

The values are in their original units (``load_diabetes(scaled=False)``): age in years, sex
coded 1/2, body-mass index, mean blood pressure, six blood serum measurements ``s1``..``s6``,
and ``target``, a measure of disease progression one year after baseline. The data ship with
scikit-learn, so no download happens.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from sklearn.datasets import load_diabetes


def write_diabetes_csv(path: str | Path) -> Path:
    """Write the diabetes table to ``path`` (parent folders are created); returns the path."""
    data = load_diabetes(scaled=False)
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([*data.feature_names, "target"])
        for row, target in zip(data.data, data.target, strict=True):
            writer.writerow([f"{v:.10g}" for v in row] + [f"{target:.10g}"])
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="where to write the CSV file, e.g. diabetes.csv")
    args = parser.parse_args(argv)
    path = write_diabetes_csv(args.path)
    print(f"wrote {path} (442 rows: 10 input columns and `target`)")


if __name__ == "__main__":
    main()
