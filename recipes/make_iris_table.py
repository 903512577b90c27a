"""Write scikit-learn's iris data as a table with text class labels and an id column.

150 flowers, 4 measurements in cm, the species as text (``setosa``, ``versicolor``,
``virginica``) and a ``flower_id`` (``iris-001`` ...): a small real table to try
:class:`lightning_dvi.data.CSVDataModule` classification on, with labels and ids as written:

    python recipes/make_iris_table.py iris.parquet         # or iris.csv
    lightning-dvi fit --config recipes/csv_classification.yaml --data.path iris.parquet

The suffix picks the format: ``.csv`` (a header row, then one row per flower) or ``.parquet``.
The data ship with scikit-learn, so no download happens.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from sklearn.datasets import load_iris

COLUMNS = ["flower_id", "sepal_length", "sepal_width", "petal_length", "petal_width", "species"]


def write_iris_table(path: str | Path) -> Path:
    """Write the iris table to ``path`` (``.csv`` or ``.parquet``; folders are created)."""
    data = load_iris()
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    species = [str(data.target_names[k]) for k in data.target]
    ids = [f"iris-{i + 1:03d}" for i in range(len(species))]
    measurements = [[float(v) for v in row] for row in data.data]
    if path.suffix.lower() in (".parquet", ".pq"):
        columns = {"flower_id": ids}
        for j, name in enumerate(COLUMNS[1:5]):
            columns[name] = [row[j] for row in measurements]
        pq.write_table(pa.table(columns | {"species": species}), path)
        return path
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        for flower, row, label in zip(ids, measurements, species, strict=True):
            writer.writerow([flower, *(f"{v:g}" for v in row), label])
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="where to write the table: iris.csv or iris.parquet")
    args = parser.parse_args(argv)
    path = write_iris_table(args.path)
    print(f"wrote {path} (150 rows: flower_id, 4 measurements, species)")


if __name__ == "__main__":
    main()
