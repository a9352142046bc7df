"""Typed reads of a JSON object's fields: each mistake is a 400 that names the field and the fix."""
from __future__ import annotations

import json
from typing import Any

from .errors import bad_request

_MISSING = object()


def describe(value: Any) -> str:
    """A short, safe rendering of a wrong value for an error message."""
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)
    text = json.dumps(value) if not isinstance(value, (list, dict)) else ""
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{text} ({kind})" if text else kind


def text(value: str, param: str) -> str:
    """A string that can be encoded as UTF-8 (JSON allows lone surrogates like \\ud800; text does not)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"'{param}' holds an unpaired surrogate ({value[e.start]!a}) at character {e.start}; "
                          f"send valid Unicode text", param=param) from None
    return value


MAX_INT_DIGITS = 64  # no field takes an integer near this long (a seed has at most 19 digits)


class _IntegerTooLong(ValueError):
    def __init__(self, digits: int):
        super().__init__(digits)
        self.digits = digits


def _parse_int(literal: str) -> int:
    digits = len(literal.lstrip("-"))
    if digits > MAX_INT_DIGITS:  # int() of thousands of digits is slow, and past 4300 it raises
        raise _IntegerTooLong(digits)
    return int(literal)


def parse_json_object(raw: bytes | str, what: str = "request body", example: str = "") -> dict:
    """The JSON object in a request body (bytes, UTF-8) or a websocket frame (text); every way it
    can be malformed is a 400 that says so."""
    like = f" like {example}" if example else ""
    fix = f"send a JSON object{like}"
    if not raw.strip():
        raise bad_request(f"the {what} is empty; {fix}")
    try:
        data = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw, parse_int=_parse_int)
    except UnicodeDecodeError as e:
        raise bad_request(f"the {what} is not UTF-8 text (byte {e.start}); send a JSON object encoded as "
                          f"UTF-8") from None
    except json.JSONDecodeError as e:
        raise bad_request(f"the {what} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                          f"{fix}") from None
    except _IntegerTooLong as e:
        raise bad_request(f"the {what} holds an integer of {e.digits} digits; no field takes one longer than "
                          f"{MAX_INT_DIGITS} digits") from None
    except RecursionError:
        raise bad_request(f"the {what} is nested too deeply; send a flat JSON object{like}") from None
    if not isinstance(data, dict):
        raise bad_request(f"the {what} must be a JSON object{like}, got {describe(data)}")
    return data


class Fields:
    def __init__(self, data: dict, prefix: str = ""):
        self.data = data
        self.prefix = prefix
        self._read: set[str] = set()  # the keys asked for: the others were ignored (`unread`)

    def _get(self, key: str, default: Any = None) -> Any:
        self._read.add(key)
        return self.data.get(key, default)

    def unread(self) -> list[str]:
        """The object's keys that nothing asked for: what the request sent that was ignored."""
        return [k for k in self.data if k not in self._read]

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def has(self, key: str) -> bool:
        return self._get(key) is not None

    def raw(self, key: str, default: Any = None) -> Any:
        value = self._get(key)
        return default if value is None else value

    def _fail(self, key: str, expected: str, value: Any):
        raise bad_request(f"'{self.name(key)}' must be {expected}, got {describe(value)}", param=self.name(key))

    def integer(self, key: str, default: int | None, lo: int | None = None, hi: int | None = None,
                hint: str = "") -> int | None:
        value = self._get(key)
        if value is None:
            return default
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            value = int(value)
        expected = "an integer" + _range(lo, hi) + hint
        if not isinstance(value, int) or isinstance(value, bool):
            self._fail(key, expected, value)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            self._fail(key, expected, value)
        return value

    def number(self, key: str, default: float, lo: float | None = None, hi: float | None = None,
               lo_open: bool = False) -> float:
        value = self._get(key)
        if value is None:
            return default
        expected = "a number" + _range(lo, hi, lo_open)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
            self._fail(key, expected, value)
        if (lo is not None and (value <= lo if lo_open else value < lo)) or (hi is not None and value > hi):
            self._fail(key, expected, value)
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            self._fail(key, "true or false", value)
        return value

    def string(self, key: str, default: str | None = None) -> str | None:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            self._fail(key, "a string", value)
        return value

    def obj(self, key: str) -> "Fields | None":
        value = self._get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            self._fail(key, "an object", value)
        return Fields(value, prefix=f"{self.name(key)}.")

    def string_list(self, key: str, max_items: int, max_len: int) -> tuple[str, ...]:
        """A string or an array of strings (e.g. `stop`)."""
        value = self._get(key)
        if value is None:
            return ()
        items = [value] if isinstance(value, str) else value
        expected = f"a string or an array of at most {max_items} non-empty strings of at most {max_len} characters"
        if not isinstance(items, list) or len(items) > max_items:
            self._fail(key, expected, value)
        for item in items:
            if not isinstance(item, str) or not item or len(item) > max_len:
                self._fail(key, expected, item)
            text(item, self.name(key))
        return tuple(items)

    def int_list(self, key: str, lo: int, hi: int, max_items: int) -> tuple[int, ...]:
        value = self._get(key)
        if value is None:
            return ()
        expected = f"an array of at most {max_items} integers in {lo}..{hi}"
        if not isinstance(value, list) or len(value) > max_items:
            self._fail(key, expected, value)
        for item in value:
            if not isinstance(item, int) or isinstance(item, bool) or not lo <= item <= hi:
                self._fail(key, expected, item)
        return tuple(value)


def _range(lo, hi, lo_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f" in ({lo}, {hi}]" if lo_open else f" between {lo} and {hi}"
    if lo is not None:
        return f" > {lo}" if lo_open else f" >= {lo}"
    if hi is not None:
        return f" <= {hi}"
    return ""
