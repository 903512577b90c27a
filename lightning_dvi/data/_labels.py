"""Class labels as written, mapped to classes ``0..K-1`` by sorted value.

The classes are the training file's labels unless the user declares them (``labels``, or
``num_classes`` for ``0..K-1``): a label found only in a validation, test or predict file is
an error naming it and the file, never a class whose output no training row reaches.

Labels are integers (any values: ``1, 2, 3``, ``-1, 1``, ``0, 3000000000``) or text
(``"cat", "dog"``). Labels that are all integers written the plain way (``7``, ``-12``: no
spaces, ``+``, decimals or leading zeros), or stored as integral numbers (a Parquet or NumPy
column), are integer labels, sorted numerically. Any other labels are text, sorted as strings
and kept exactly as written, so ``"007"`` and ``"7"`` stay two classes and ``"1.0"`` stays
``"1.0"`` (with ``num_classes=K``, the labels-are-``0..K-1`` convention, integral numbers in
any notation are read as integers).
Numbers that are not all integers (``0.5``) are refused: that is a regression target.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ._read import fail

__all__ = ["Label", "LabelColumn", "resolve_labels"]

Label = int | str

_INTEGER = re.compile(r"0|-?[1-9][0-9]*")  # the plain way: one text per integer
_NUMBER = re.compile(r"\s*[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\s*")


@dataclass(frozen=True)
class LabelColumn:
    """The label column of one file: its distinct raw values and each row's index among them."""

    path: Path
    column: str
    distinct: list[object]
    codes: np.ndarray
    row_name: Callable[[int], str]

    @classmethod
    def from_array(
        cls, path: Path, column: str, array: pa.Array, row_name: Callable[[int], str]
    ) -> LabelColumn:
        """Dictionary-encode ``array``; a missing or empty label is an error naming its row."""
        if isinstance(array, pa.ChunkedArray):
            array = array.combine_chunks()
        if pa.types.is_dictionary(array.type):
            array = array.dictionary_decode()
        if array.null_count:
            valid = np.asarray(array.is_valid().to_numpy(zero_copy_only=False))
            raise fail(path, row_name(int(np.flatnonzero(~valid)[0])), column, "no class label")
        encoded = pc.dictionary_encode(array)
        distinct = encoded.dictionary.to_pylist()
        codes = np.asarray(encoded.indices.to_numpy(zero_copy_only=False), dtype=np.int64)
        self = cls(path, column, distinct, codes, row_name)
        for j, value in enumerate(distinct):
            if isinstance(value, str) and not value.strip():
                raise self.error(j, "empty cell (no class label)")
            if isinstance(value, float) and not math.isfinite(value):
                raise self.error(j, f"class label {value} is not a finite number")
        return self

    def error(self, j: int, problem: str) -> ValueError:
        """The error for distinct value ``j``, naming the first row that holds it."""
        row = int(np.flatnonzero(self.codes == j)[0])
        return fail(self.path, self.row_name(row), self.column, problem)


def _integer(value: object, numeric_text: bool = False) -> int | None:
    """``value`` as an integer label, or None when it is not one.

    Text is an integer when written the plain way; with ``numeric_text`` also when it is any
    integral number (``"3.0"``, ``"+3"``), as the ``num_classes`` convention reads labels.
    """
    if isinstance(value, str) and numeric_text and _NUMBER.fullmatch(value):
        value = float(value)
    if isinstance(value, (bool, int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return int(value) if math.isfinite(value) and float(value).is_integer() else None
    return int(value) if isinstance(value, str) and _INTEGER.fullmatch(value) else None


def _fraction(value: object) -> bool:
    """Whether ``value`` is a finite number that is not an integer (``0.5``, ``"2.5e-1"``)."""
    if isinstance(value, str) and _NUMBER.fullmatch(value):
        value = float(value)
    return (
        isinstance(value, (float, np.floating))
        and math.isfinite(value)
        and not float(value).is_integer()
    )


def _is_number(value: object) -> bool:
    if isinstance(value, str):
        return bool(_NUMBER.fullmatch(value))
    return isinstance(value, (int, float, np.number))


def _canonical(columns: Sequence[LabelColumn], numeric_text: bool) -> list[list[Label]]:
    """Per column, its distinct values as labels: all integers, or else all text as written."""
    values = [v for column in columns for v in column.distinct]
    integers = [_integer(v, numeric_text) for v in values]
    if all(i is not None for i in integers):
        it = iter(integers)
        return [[next(it) for _ in column.distinct] for column in columns]  # type: ignore[misc]  # no None left
    if all(_is_number(v) for v in values):  # numbers, some of them perhaps fractions
        for column in columns:
            for j, value in enumerate(column.distinct):
                if _fraction(value):
                    raise column.error(
                        j,
                        f"class label {str(value).strip()} is not an integer: class labels are "
                        "integers or text (a numeric target is task='regression')",
                    )
    return [[str(v) for v in column.distinct] for column in columns]


def _given(labels: Sequence[object], integer: bool) -> list[Label]:
    """The user's ``labels`` argument in the kind of the files' labels."""
    out: list[Label] = []
    for label in labels:
        if integer:
            value = _integer(label) if not isinstance(label, float) or label.is_integer() else None
            if value is None:
                raise ValueError(
                    f"labels: {label!r} is not an integer, but the files' class labels are integers"
                )
            out.append(value)
        else:
            out.append(str(label))
    if len(set(out)) != len(out):
        raise ValueError(f"labels lists a class twice: {list(labels)}")
    return out


def _shell_list(labels: Sequence[Label]) -> str:
    """``labels`` as a command-line value: a JSON list (valid YAML), quoted for the shell."""
    return shlex.quote(json.dumps(list(labels)))


def _unknown(
    columns: Sequence[LabelColumn], canonical: Sequence[Sequence[Label]], known: Sequence[Label]
) -> list[tuple[LabelColumn, list[tuple[int, Label]]]]:
    """Per column, its distinct labels outside ``known`` as ``(first row, label)``, by row."""
    allowed = set(known)
    found = []
    for column, per in zip(columns, canonical, strict=True):
        missing = [j for j, label in enumerate(per) if label not in allowed]
        if missing:
            first = {j: int(np.flatnonzero(column.codes == j)[0]) for j in missing}
            found.append((column, sorted((first[j], per[j]) for j in missing)))
    return found


def _unknown_error(
    unknown: Sequence[tuple[LabelColumn, Sequence[tuple[int, Label]]]], problem: str, advice: str
) -> ValueError:
    """One error naming every label outside the classes, with its file and first row.

    The message is ``FILE, line N, column C: class label(s) ... PROBLEM``, then the labels of
    further files, then ``advice``; ``problem`` reads after ``is``/``are``
    (``"not one of labels=[...]"``).
    """

    def named(column: LabelColumn, rows: Sequence[tuple[int, Label]], lines: bool) -> str:
        return ", ".join(
            (f"{label!r}" if isinstance(label, str) else f"{label}")
            + (f" ({column.row_name(row)})" if lines else "")
            for row, label in rows
        )

    column, rows = unknown[0]
    first = rows[0][0]
    if len(rows) == 1:
        text = f"class label {named(column, rows, False)} is {problem}"
    else:
        text = f"class labels {named(column, rows, True)} are {problem}"
    for other, other_rows in unknown[1:]:
        text += f"; so {'is' if len(other_rows) == 1 else 'are'} {named(other, other_rows, True)}"
        text += f" in {other.path}"
    return fail(column.path, column.row_name(first), column.column, text + advice)


def resolve_labels(
    columns: Sequence[LabelColumn],
    labels: Sequence[object] | None = None,
    num_classes: int | None = None,
) -> tuple[list[Label], list[np.ndarray]]:
    """The class labels (class ``k`` is ``labels[k]``) and each column's class per row.

    Without ``labels`` or ``num_classes`` the classes are the labels of the training file,
    ``columns[0]``, sorted: a label only in another file (validation, test or predict) is an
    error, since its class would have no training rows and its output would never be trained.
    Declaring the classes (``labels``, or ``num_classes`` for ``0..K-1``) allows a declared
    class without training rows.

    Args:
        columns: the label columns of every labelled file, the training file's first.
        labels: the classes in order, if the user gave them; every file label must be one.
        num_classes: integer labels ``0..num_classes-1`` (the former convention), if given.

    Returns:
        ``(labels, classes)``: the class labels and, per column, int64 classes ``[rows]``.

    Raises:
        ValueError: naming file, row and column for a label outside ``labels`` or
            ``0..num_classes-1``, or (classes not declared) outside the training file's labels,
            every such label of every file; a fractional numeric label; an empty label; and
            fewer than two classes.
    """
    canonical = _canonical(columns, numeric_text=num_classes is not None and labels is None)
    integer = all(isinstance(v, int) for per in canonical for v in per)
    if labels is not None:
        classes = _given(labels, integer)
        if num_classes is not None and num_classes != len(classes):
            raise ValueError(
                f"num_classes={num_classes} but labels lists {len(classes)} classes: {classes}"
            )
        problem = f"not one of labels={classes}"
    elif num_classes is not None:
        if not integer:
            raise ValueError(
                f"num_classes={num_classes} says the labels are 0..{num_classes - 1}, but the "
                "files' class labels are text; leave num_classes unset (or give labels=[...])"
            )
        classes = list(range(num_classes))
        problem = f"out of range for num_classes={num_classes}"
    else:
        classes = sorted(set(canonical[0]))  # one kind: all int or all str
        problem = f"not in the training file {columns[0].path} (its labels: {classes})"
    unknown = _unknown(columns, canonical, classes)
    if unknown:
        advice = ""
        if labels is None and num_classes is None:
            declared = classes + sorted({label for _, rows in unknown for _, label in rows})
            advice = (
                ": a class without training rows would get a model output that is never "
                "trained. Correct or drop those rows, or, to keep such a class, declare the "
                f"classes: labels={declared} (--data.labels {_shell_list(declared)} on the "
                "command line)"
            )
        raise _unknown_error(unknown, problem, advice)
    position = {label: k for k, label in enumerate(classes)}
    encoded = []
    for column, per in zip(columns, canonical, strict=True):
        lookup = np.array([position[label] for label in per], dtype=np.int64)
        encoded.append(lookup[column.codes])
    if len(classes) < 2:
        raise ValueError(
            f"{columns[0].path}: column {columns[0].column!r} holds a single class "
            f"({classes[0]!r}); classification needs at least 2"
        )
    return classes, encoded
