"""Records read from disk, changed one field at a time, as the fuzz tests of the records change them."""

import json

HOW = ("missing", "type", "low", "high")


def fields(record, path=(), every_item: bool = True) -> list[tuple]:
    """The path (keys and indices) of every field of a JSON record, containers included, outermost first;
    with `every_item` False, of a list's first item only (for lists whose items are alike)."""
    paths = [path] if path else []
    if isinstance(record, dict):
        children = list(record.items())
    elif isinstance(record, list):
        children = list(enumerate(record if every_item else record[:1]))
    else:
        children = []
    for key, value in children:
        paths += fields(value, (*path, key), every_item)
    return paths


def changed(record, path: tuple, how: str):
    """A deep copy of `record` with the field at `path` removed ("missing"), of another JSON type ("type": a
    number as text, a list as an object, anything else in a list), or at an extreme of its type ("low",
    "high": a number of -1 or 2**64, anything else a text of 100,000 characters)."""
    record = json.loads(json.dumps(record))
    *parents, last = path
    holder = record
    for key in parents:
        holder = holder[key]
    value = holder[last]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if how == "missing":
        del holder[last]
    elif how == "type":
        holder[last] = str(value) if number else {"0": value} if isinstance(value, list) else [value]
    else:
        holder[last] = {"low": -1, "high": 2**64}[how] if number else "x" * 100_000
    return record
