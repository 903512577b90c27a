"""Reading the user's tables as written: pyarrow for CSV/TSV and Parquet, numpy for arrays.

A file is read into two kinds of columns. **Number columns** (inputs, regression targets) become
float64 arrays by pyarrow's strict parser: decimal or scientific notation with optional sign and
surrounding spaces or tabs (``-2.5``, ``1e-3``, ``.5``); nothing else, so ``1_000``, ``0x10``,
``1,5`` and ``١`` are refused, as pandas and other CSV readers refuse them. Empty cells and
values that are not finite (``NaN``, ``inf``, ``1e400``) are refused too. **Value columns**
(class labels, ids) are kept as written: the text of a text file, the stored type of a Parquet
or NumPy column.

The fast path is one typed ``pyarrow.csv.read_csv`` call. Only when it fails does a slower
pass find the first bad line or cell, so that every error names the file, the 1-based line of a
text file (or 0-based row of an array) and the column.
"""

from __future__ import annotations

import codecs
import csv
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

__all__ = [
    "SUPPORTED_SUFFIXES",
    "Table",
    "column_names",
    "delimiter_hint",
    "fail",
    "missing_column",
    "read_columns",
    "read_tabular",
]

TEXT_SUFFIXES = (".csv", ".tsv", ".txt")
NUMPY_SUFFIXES = (".npy", ".npz")
PARQUET_SUFFIXES = (".parquet", ".pq")
SUPPORTED_SUFFIXES = (*TEXT_SUFFIXES, *NUMPY_SUFFIXES, *PARQUET_SUFFIXES)

# What pyarrow's CSV number conversion trims around a value (its compute cast trims nothing).
_CSV_BLANKS = " \t"
# Separators a header that reads as one column may hold: it is likely separated by one of them.
_LIKELY_DELIMITERS = (";", "\t", "|", ",")


def fail(path: Path, row: str, column: str, problem: str) -> ValueError:
    """The error for one bad cell: ``"FILE, line 3, column 'b': PROBLEM"``."""
    return ValueError(f"{path}, {row}, column {column!r}: {problem}")


@dataclass(frozen=True)
class Table:
    """Columns read from one file.

    Attributes:
        path: the file.
        num_rows: its number of data rows.
        numbers: float64 columns, every value finite.
        values: the value columns as written (pyarrow arrays; text for text files).
        row_name: names row ``i`` in messages: ``"line 7"`` (text) or ``"row 5"`` (arrays).
    """

    path: Path
    num_rows: int
    numbers: dict[str, np.ndarray]
    values: dict[str, pa.Array]
    row_name: Callable[[int], str]


def delimiter_hint(path: Path, names: Sequence[str], delimiter: str | None = None) -> str:
    """A hint when a text file's header reads as one column holding a likely delimiter.

    A ``;``-separated file read with the default ``,`` has a single column named
    ``"x0;x1;target"``; the hint names the delimiter it looks separated by (the most frequent
    of ``;``, tab, ``|`` and ``,`` in that name, other than the one used) and the option.

    Returns:
        ``"; the header looks ';'-separated: pass --data.delimiter ';' ..."``, or ``""``.
    """
    if path.suffix.lower() not in TEXT_SUFFIXES or len(names) != 1:
        return ""
    used = delimiter or ("\t" if path.suffix.lower() == ".tsv" else ",")
    counts = {c: names[0].count(c) for c in _LIKELY_DELIMITERS if c != used}
    likely = max(counts, key=lambda c: counts[c])
    if not counts[likely]:
        return ""
    if likely == "\t":
        return (
            "; the header looks tab-separated: name the file .tsv, or pass --data.delimiter "
            "$'\\t' (bash; delimiter='\\t' in Python, delimiter: \"\\t\" in YAML)"
        )
    return (
        f"; the header looks {likely!r}-separated: pass --data.delimiter {likely!r} "
        f"(delimiter={likely!r} in Python)"
    )


def missing_column(
    path: Path, available: Sequence[str], column: str, delimiter: str | None = None
) -> ValueError:
    """The error for a column not in the file, naming the file's columns (and a delimiter hint)."""
    return ValueError(
        f"{path}: no column {column!r} (columns in the file: {', '.join(available)})"
        + delimiter_hint(path, available, delimiter)
    )


def _check_present(
    path: Path, available: Sequence[str], wanted: Sequence[str], delimiter: str | None = None
) -> None:
    missing = [c for c in wanted if c not in available]
    if missing:
        raise missing_column(path, available, missing[0], delimiter)


def _first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


def _parses(array: pa.Array) -> bool:
    try:
        pc.cast(array, pa.float64())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return False
    return True


def _first_unparsable(text: pa.Array) -> int | None:
    """Index of the first text that pyarrow does not parse as a number (bisection), or None."""
    if _parses(text):
        return None
    lo, hi = 0, len(text)  # [lo, hi) holds the first failure
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _parses(text.slice(lo, mid - lo)):
            lo = mid
        else:
            hi = mid
    return lo


def _to_float64(
    table_path: Path,
    name: str,
    array: pa.Array | pa.ChunkedArray,
    row_name: Callable[[int], str],
    text_of: Callable[[int], str],
    missing: str,
) -> np.ndarray:
    """A column as float64, refusing missing, non-numeric and non-finite values by row."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    kind = array.type
    if array.null_count:
        i = _first(~np.asarray(array.is_valid().to_numpy(zero_copy_only=False)))
        assert i is not None
        raise fail(table_path, row_name(i), name, missing)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        array = pc.utf8_trim(array, characters=_CSV_BLANKS)
        i = _first_unparsable(array)
        if i is not None:
            text = str(array[i].as_py())
            problem = "empty cell" if not text else f"non-numeric value {text!r}"
            raise fail(table_path, row_name(i), name, problem)
    elif not (
        pa.types.is_integer(kind)
        or pa.types.is_floating(kind)
        or pa.types.is_boolean(kind)
        or pa.types.is_decimal(kind)
    ):
        raise ValueError(
            f"{table_path}, column {name!r}: holds {kind} values, not numbers (list the input "
            "columns in `features` to leave it out)"
        )
    values = np.asarray(
        pc.cast(array, pa.float64(), safe=False).to_numpy(zero_copy_only=False), dtype=np.float64
    )
    i = _first(~np.isfinite(values))
    if i is not None:
        raise fail(table_path, row_name(i), name, f"{text_of(i)} (not a finite number)")
    return values


# ---------------------------------------------------------------------------------- text files
class _TextFile:
    """A delimited text file: its header, a fast typed read, and a slow pass that names lines."""

    def __init__(self, path: Path, delimiter: str | None, encoding: str) -> None:
        self.path = path
        self.delimiter = delimiter or ("\t" if path.suffix.lower() == ".tsv" else ",")
        self.encoding = encoding
        utf8 = codecs.lookup(encoding).name in ("utf-8", "utf-8-sig")
        self._python_encoding = "utf-8-sig" if utf8 else encoding
        self._arrow_encoding = "utf8" if utf8 else encoding
        self.header_line, self.names = self._header()

    def _lines(self) -> Iterator[tuple[int, str]]:
        """``(1-based line number, text without the line break)`` of every line."""
        decoder = codecs.getincrementaldecoder(self._python_encoding)()
        with self.path.open("rb") as handle:
            for number, raw in enumerate(handle, start=1):
                try:
                    text = decoder.decode(raw)
                except UnicodeDecodeError as err:
                    bad = err.object[err.start : err.end]
                    raise ValueError(
                        f"{self.path}, line {number}: not valid {self.encoding} text ({err.reason}: "
                        f"byte {bad!r}); if the file was saved in another encoding, name it with "
                        "the `encoding` option (e.g. encoding='latin-1', or --data.encoding "
                        "latin-1 on the command line)"
                    ) from None
                yield number, text.rstrip("\r\n")

    def _cells(self, text: str) -> list[str]:
        return next(csv.reader([text], delimiter=self.delimiter), [])

    def _header(self) -> tuple[int, list[str]]:
        for number, text in self._lines():
            if text.strip():
                names = [c.strip() for c in self._cells(text)]
                blank = [i + 1 for i, name in enumerate(names) if not name]
                if blank:
                    raise ValueError(f"{self.path}, line {number}: header cell {blank[0]} is empty")
                seen: set[str] = set()
                for name in names:
                    if name in seen:
                        raise ValueError(
                            f"{self.path}, line {number}: column {name!r} appears twice"
                        )
                    seen.add(name)
                return number, names
        raise ValueError(f"{self.path} is empty: expected a header row of column names")

    def _rows(self) -> Iterator[tuple[int, str]]:
        """``(line number, text)`` of the data rows, as pyarrow counts them (empty lines skipped)."""
        for number, text in self._lines():
            if number > self.header_line and text:
                yield number, text

    def line_of(self, row: int) -> int:
        """The 1-based line of data row ``row``."""
        for i, (number, _) in enumerate(self._rows()):
            if i == row:
                return number
        raise IndexError(row)

    def cell(self, row: int, column: str) -> str:
        """The text of one cell, stripped."""
        for i, (_, text) in enumerate(self._rows()):
            if i == row:
                return self._cells(text)[self.names.index(column)].strip()
        raise IndexError(row)

    def row_name(self, row: int) -> str:
        return f"line {self.line_of(row)}"

    def _read(self, types: dict[str, pa.DataType]) -> pa.Table:
        return pacsv.read_csv(
            self.path,
            read_options=pacsv.ReadOptions(
                column_names=self.names, skip_rows=self.header_line, encoding=self._arrow_encoding
            ),
            parse_options=pacsv.ParseOptions(delimiter=self.delimiter),
            convert_options=pacsv.ConvertOptions(
                include_columns=list(types),
                column_types=types,
                null_values=[""],
                strings_can_be_null=False,
                quoted_strings_can_be_null=True,
            ),
        )

    def _diagnose(self, numbers: Sequence[str], values: Sequence[str], err: Exception) -> Exception:
        """The first bad line or cell, named, after the fast read failed with ``err``."""
        try:
            for number, text in self._rows():  # decodes every line: names an encoding error
                cells = self._cells(text)
                if len(cells) != len(self.names):
                    return ValueError(
                        f"{self.path}, line {number}: {len(cells)} cells, but the header has "
                        f"{len(self.names)} columns"
                    )
            as_text = self._read(dict.fromkeys([*numbers, *values], pa.string()))
            for name in numbers:
                column = as_text[name].combine_chunks()
                _to_float64(
                    self.path,
                    name,
                    column,
                    self.row_name,
                    lambda i, column=column: str(column[i].as_py()).strip(),  # type: ignore[misc]  # binds the loop's column
                    "empty cell",
                )
        except ValueError as named:
            return named
        return ValueError(f"{self.path}: cannot be read as a table: {err}")

    def read(self, numbers: Sequence[str], values: Sequence[str]) -> Table:
        _check_present(self.path, self.names, [*numbers, *values], self.delimiter)
        types = {name: pa.float64() for name in numbers} | {name: pa.string() for name in values}
        try:
            table = self._read(types)
        except (pa.ArrowInvalid, UnicodeDecodeError) as err:
            raise self._diagnose(numbers, values, err) from None
        if table.num_rows == 0:
            raise ValueError(f"{self.path} has a header but no data rows")
        return Table(
            path=self.path,
            num_rows=table.num_rows,
            numbers={
                name: _to_float64(
                    self.path,
                    name,
                    table[name],
                    self.row_name,
                    lambda i, name=name: self.cell(i, name),  # type: ignore[misc]  # binds the loop's name
                    "empty cell",
                )
                for name in numbers
            },
            values={name: table[name].combine_chunks() for name in values},
            row_name=self.row_name,
        )


# ---------------------------------------------------------------------------- arrays and Parquet
def _row_name(i: int) -> str:
    return f"row {i}"


def _numpy_columns(path: Path) -> dict[str, np.ndarray]:
    if path.suffix.lower() == ".npy":
        array = np.load(path, allow_pickle=False)
        if array.ndim != 2:
            raise ValueError(
                f"{path}: expected a 2-D array [rows, columns], got shape {array.shape}"
            )
        return {str(j): np.ascontiguousarray(array[:, j]) for j in range(array.shape[1])}
    with np.load(path, allow_pickle=False) as archive:
        arrays = {key: archive[key] for key in archive.files}
    if not arrays:
        raise ValueError(f"{path} is empty: no arrays")
    if len(arrays) == 1 and next(iter(arrays.values())).ndim == 2:
        array = next(iter(arrays.values()))
        return {str(j): np.ascontiguousarray(array[:, j]) for j in range(array.shape[1])}
    shapes = {key: a.shape for key, a in arrays.items() if a.ndim != 1}
    if shapes:
        raise ValueError(
            f"{path}: expected one 2-D array or 1-D arrays (one per column), got shapes {shapes}"
        )
    return arrays


def _parquet_names(path: Path) -> list[str]:
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise ValueError(f"{path} is not a readable Parquet file: {err}") from None
    # pandas stores a non-default index as a column; it is not data
    index = (schema.pandas_metadata or {}).get("index_columns", [])
    return [name for name in schema.names if name not in index]


def _read_arrays(
    path: Path, columns: dict[str, pa.Array], numbers: Sequence[str], values: Sequence[str]
) -> Table:
    lengths = {name: len(a) for name, a in columns.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{path}: columns of different lengths {lengths}")
    num_rows = next(iter(lengths.values()), 0)
    if num_rows == 0:
        raise ValueError(f"{path} holds no rows")

    def text_of(name: str) -> Callable[[int], str]:
        return lambda i: str(columns[name][i].as_py())

    return Table(
        path=path,
        num_rows=num_rows,
        numbers={
            name: _to_float64(path, name, columns[name], _row_name, text_of(name), "missing value")
            for name in numbers
        },
        values={name: columns[name] for name in values},
        row_name=_row_name,
    )


# ------------------------------------------------------------------------------------ public
def _checked_path(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    suffix = path.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise ValueError(
            f"{path}: unsupported file type {suffix or '(no suffix)'!r}; expected one of "
            f"{', '.join(SUPPORTED_SUFFIXES)}"
        )
    return path


def column_names(
    path: str | Path, delimiter: str | None = None, encoding: str = "utf-8"
) -> list[str]:
    """The column names of a file (the header of a text file), without reading its values."""
    path = _checked_path(path)
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return list(_TextFile(path, delimiter, encoding).names)
    if suffix in PARQUET_SUFFIXES:
        return _parquet_names(path)
    return list(_numpy_columns(path))


def read_columns(
    path: str | Path,
    numbers: Sequence[str],
    values: Sequence[str] = (),
    *,
    delimiter: str | None = None,
    encoding: str = "utf-8",
) -> Table:
    """Read number columns (float64, strictly parsed, finite) and value columns (as written).

    Args:
        path: a ``.csv``/``.tsv``/``.txt`` file with a header row, ``.npy``, ``.npz`` or
            ``.parquet``/``.pq``.
        numbers: columns parsed as numbers.
        values: columns kept as written (text for text files).
        delimiter: the separator of text files (default ``,``; a tab for ``.tsv``).
        encoding: the text encoding of text files (default UTF-8, with or without BOM).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: naming the file, and the line or row and the column where there is one: an
            unsupported suffix, a missing column, an empty, non-numeric or non-finite cell, a
            ragged row, text that is not in ``encoding``, an empty file.
    """
    path = _checked_path(path)
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return _TextFile(path, delimiter, encoding).read(numbers, values)
    wanted = [*numbers, *values]
    if suffix in PARQUET_SUFFIXES:
        available = _parquet_names(path)
        _check_present(path, available, wanted)
        try:
            table = pq.read_table(path, columns=list(dict.fromkeys(wanted)))
        except (pa.ArrowInvalid, OSError) as err:
            raise ValueError(f"{path} is not a readable Parquet file: {err}") from None
        columns = {name: table[name].combine_chunks() for name in dict.fromkeys(wanted)}
    else:
        arrays = _numpy_columns(path)
        _check_present(path, list(arrays), wanted)
        columns = {name: pa.array(arrays[name]) for name in dict.fromkeys(wanted)}
    return _read_arrays(path, columns, numbers, values)


def read_tabular(
    path: str | Path,
    columns: Sequence[str] | None = None,
    delimiter: str | None = None,
    encoding: str = "utf-8",
) -> tuple[list[str], np.ndarray, Callable[[int], str]]:
    """Read named numeric columns of a tabular file as float64 ``[rows, len(columns)]``.

    Args:
        path: a ``.csv``/``.tsv``/``.txt``, ``.npy``, ``.npz`` or ``.parquet`` file.
        columns: the columns to read, in order; ``None`` reads all.
        delimiter: for text files (default ``,``; a tab for ``.tsv``).
        encoding: for text files (default UTF-8).

    Returns:
        The column names, the table, and a function naming row ``i`` in messages
        (``"line 7"`` for text files, ``"row 5"`` for arrays).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: naming the file, row and column: a missing column, an empty, non-numeric
            or non-finite cell, a ragged row, an empty file or an unsupported suffix.
    """
    names = column_names(path, delimiter, encoding) if columns is None else list(columns)
    table = read_columns(path, names, delimiter=delimiter, encoding=encoding)
    data = np.stack([table.numbers[name] for name in names], axis=1)
    return names, data, table.row_name
