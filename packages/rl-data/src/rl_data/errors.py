"""The one error type for bad input data: it says what was wrong and where.

Every check in `rl_data` that rejects user data raises `DataError`, with the file (`source`),
the row (0-based index within that file, or a 1-based `line` for text formats) and the key
where they are known, so that a message reads like
`data/train.jsonl, row 17, key 'prompt': expected a non-empty string, got int`.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class DataError(ValueError):
    """Invalid input data. `source`, `row`, `line` and `key` locate the problem when known."""

    def __init__(
        self,
        message: str,
        *,
        source: str | None = None,
        row: int | None = None,
        line: int | None = None,
        key: str | None = None,
    ) -> None:
        self.source, self.row, self.line, self.key = source, row, line, key
        self.reason = message
        where = [str(source)] if source is not None else []
        if line is not None:
            where.append(f"line {line}")
        if row is not None:
            where.append(f"row {row}")
        if key is not None:
            where.append(f"key {key!r}")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)

    def __reduce__(self) -> tuple[Any, ...]:
        # Keeps the location when the error crosses a process boundary (Ray, multiprocessing).
        return (_rebuild, (self.reason, self.source, self.row, self.line, self.key))


def _rebuild(
    message: str, source: str | None, row: int | None, line: int | None, key: str | None
) -> DataError:
    return DataError(message, source=source, row=row, line=line, key=key)


def check_integer(name: str, value: Any, minimum: int, *, allow_none: bool = False) -> Any:
    """`value` as an int ≥ `minimum` (None passes when `allow_none`); ValueError naming `name` otherwise.

    bool is refused (True is not a count) and numpy integers are accepted.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        expected = f"an integer >= {minimum}" + (" or None" if allow_none else "")
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    return int(value)


def type_name(value: Any) -> str:
    """A short name of a value's type for error messages (`int`, `NoneType`, `list`)."""
    return type(value).__name__
