"""Settings from the environment, declared once per component as typed records.

A component (the registry, the CPU backend, the ONNX front end, ...) declares its environment
variables beside its code, as a frozen dataclass whose fields each name the variable, its type,
its default and a one-line meaning::

    @dataclass(frozen=True)
    class RegistrySettings(Settings, component="registry"):
        plugin_timeout: float = setting("POLYHAL_PLUGIN_TIMEOUT", Number("seconds", low=0), 5.0,
                                        "seconds one plugin may take to import")

    timeout = RegistrySettings.from_env().plugin_timeout

:meth:`Settings.from_env` reads the environment when it is called, so a variable changed since
(``monkeypatch.setenv`` in a test) counts at the next read; the record is memoized on the raw
values, so a read costs a dictionary lookup per variable. An unset or blank variable takes the
default. A value the type does not accept is a :class:`~polyhal.errors.ConfigError` that names
the variable, the value and what is accepted.

Every record is listed in one table in the documentation (``docs/configuration.md``, between
the markers of :data:`TABLE_MARKERS`), generated from the records by ``python -m polyhal.config
--markdown``; ``--update`` writes it there in a checkout (``python -m polyhal.config`` shows the
values in effect).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Iterable, Mapping

from polyhal.errors import ConfigError

__all__ = ["Choice", "Flag", "Integer", "Kind", "Names", "Number", "Settings", "Size", "Text", "Variable",
           "declared", "markdown", "parse_size", "setting"]


# --------------------------------------------------------------------------------------------------
# Types of values
# --------------------------------------------------------------------------------------------------

class Kind:
    """How one variable's text becomes a value. ``name`` is the type the documentation's table shows,
    ``what`` completes "is not ..." in an error; :meth:`parse` raises ValueError on bad text."""

    name = "str"
    what = "a string"
    #: Whether a blank value is a value of its own (a cache folder set empty: no disk cache)
    #: rather than the default.
    keep_blank = False

    def parse(self, raw: str) -> Any:
        return raw

    def show(self, value: Any) -> str:
        """``value`` as one would write it in the variable."""
        return "" if value is None else str(value)


class Text(Kind):
    """Any text (stripped), checked, if at all, where it is used."""

    def __init__(self, *, keep_blank: bool = False) -> None:
        self.keep_blank = keep_blank


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class Flag(Kind):
    """A switch: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (any case)."""

    name = "bool"
    what = "a switch (1, true, yes, on / 0, false, no, off)"

    def parse(self, raw: str) -> bool:
        word = raw.lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        raise ValueError(raw)

    def show(self, value: Any) -> str:
        return {True: "1", False: "0"}.get(value, Kind.show(self, value))


class Integer(Kind):
    """An integer, within ``low``..``high`` where they are given."""

    name = "int"

    def __init__(self, low: int | None = None, high: int | None = None) -> None:
        self.low, self.high = low, high
        self.what = ("an integer" if low is None and high is None else f"an integer >= {low}" if high is None
                     else f"an integer <= {high}" if low is None else f"an integer in {low}..{high}")

    def parse(self, raw: str) -> int:
        value = int(raw)
        if (self.low is not None and value < self.low) or (self.high is not None and value > self.high):
            raise ValueError(raw)
        return value


class Number(Kind):
    """A real number of ``unit`` (``inf`` allowed), at least ``low`` where it is given."""

    name = "float"

    def __init__(self, unit: str, *, low: float | None = None) -> None:
        self.low = low
        self.what = f"a number of {unit}" + ("" if low is None else f" >= {low:g}")

    def parse(self, raw: str) -> float:
        value = float(raw)
        if math.isnan(value) or (self.low is not None and value < self.low):
            raise ValueError(raw)
        return value

    def show(self, value: Any) -> str:
        return f"{value:g}" if isinstance(value, float) else Kind.show(self, value)


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
               "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """``"512MiB"``, ``"1g"``, ``"1000000"`` -> bytes (ValueError for anything else)."""
    raw = text.strip().lower().replace("_", "")
    digits = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(digits):].strip()
    try:
        value = int(float(digits) * _SIZE_UNITS[unit])
    except (ValueError, KeyError, OverflowError):
        raise ValueError(f"{text!r} is not a size; write e.g. 4096, 512MiB or 2GiB") from None
    if value < 0:
        raise ValueError(f"{text!r} is not a size; write e.g. 4096, 512MiB or 2GiB")
    return value


class Size(Kind):
    """A byte count: ``4096``, ``512MiB``, ``2GiB``, ``1g`` (binary units), ``1MB`` (decimal)."""

    name = "size"
    what = "a size in bytes (e.g. 4096, 512MiB or 2GiB)"

    def parse(self, raw: str) -> int:
        return parse_size(raw)

    def show(self, value: Any) -> str:
        if isinstance(value, int) and value:
            for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
                if value % scale == 0:
                    return f"{value // scale}{unit}"
        return Kind.show(self, value)


class Names(Kind):
    """A comma-separated list of names (blank entries dropped), as a tuple."""

    name = "list"
    what = "a comma-separated list of names"

    def parse(self, raw: str) -> tuple[str, ...]:
        names = tuple(p.strip() for p in raw.split(",") if p.strip())
        if not names:
            raise ValueError(raw)
        return names

    def show(self, value: Any) -> str:
        return ",".join(value) if isinstance(value, tuple) else Kind.show(self, value)


class Choice(Kind):
    """One of ``values`` (compared in lower case); ``aliases`` maps other words to values."""

    def __init__(self, *values: str, aliases: Mapping[str, str] | None = None) -> None:
        self.values, self.aliases = values, dict(aliases or {})
        self.name = "enum: " + " \\| ".join(values)
        self.what = "one of " + ", ".join(values) + "".join(
            f" ({', '.join(k for k, v in self.aliases.items() if v == value)} = {value})"
            for value in values if value in self.aliases.values())

    def parse(self, raw: str) -> str:
        word = raw.lower()
        word = self.aliases.get(word, word)
        if word not in self.values:
            raise ValueError(raw)
        return word


# --------------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Variable:
    """One environment variable as a record declares it (the field's metadata)."""

    name: str
    kind: Kind
    default: Any
    doc: str
    #: The default as the documentation's table shows it, where the value alone would not say it (``None``:
    #: the kind writes the value; "" shows as "unset").
    shown: str | None = None
    #: What an error says to do, where "unset it for the default" is not enough.
    hint: str | None = None

    def shown_default(self) -> str:
        text = self.kind.show(self.default) if self.shown is None else self.shown
        return text if text else "unset"

    def parse(self, raw: str | None, component: str) -> Any:
        """The value of ``raw`` (the variable's text, None where unset)."""
        if raw is None:
            return self.default
        text = raw.strip()
        if not text and not self.kind.keep_blank:
            return self.default
        try:
            return self.kind.parse(text)
        except (ValueError, OverflowError):
            hint = self.hint or f"unset it for the default ({self.shown_default()})"
            raise ConfigError(f"{self.name}={raw!r} is not {self.kind.what}; {hint} "
                              f"[{component}: {self.doc}]", variable=self.name, value=raw) from None


_METADATA = "polyhal.config"


def setting(variable: str, kind: Kind, default: Any, doc: str, *, shown: str | None = None,
            hint: str | None = None) -> Any:
    """A field of a :class:`Settings` record: environment ``variable``, read as ``kind``,
    ``default`` where unset or blank, ``doc`` its meaning in one line (the documentation's table)."""
    return field(default=default, metadata={_METADATA: Variable(variable, kind, default, doc, shown, hint)})


#: Every declared record, in the order of declaration.
_DECLARED: list[type["Settings"]] = []
#: (record, raw values) -> record: reads are memoized on what the environment holds.
_READS: dict[tuple, "Settings"] = {}


class Settings:
    """Base of the settings records: subclass as a frozen dataclass with ``component=``, its
    fields made with :func:`setting`."""

    #: The component the variables belong to (the documentation's table groups by it).
    COMPONENT: ClassVar[str]

    def __init_subclass__(cls, *, component: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.COMPONENT = component
        _DECLARED.append(cls)

    @classmethod
    def variables(cls) -> tuple[tuple[str, Variable], ...]:
        """``(field name, variable)`` of every field."""
        found = cls.__dict__.get("_variables")
        if found is None:
            found = tuple((f.name, f.metadata[_METADATA]) for f in fields(cls))  # type: ignore[arg-type]
            cls._variables = found  # type: ignore[attr-defined]
        return found

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Any:
        """The record as ``environ`` (default: ``os.environ``, now) sets it."""
        environ = os.environ if environ is None else environ
        variables = cls.variables()
        raws = tuple(environ.get(v.name) for _, v in variables)
        key = (cls, raws)
        found = _READS.get(key)
        if found is None:
            found = cls(**{name: v.parse(raw, cls.COMPONENT) for (name, v), raw in zip(variables, raws)})
            if len(_READS) > 1024:  # environments churn in tests only; keep the memo small
                _READS.clear()
            _READS[key] = found
        return found


# --------------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------------

#: The core modules that declare records (the backends' come through their entry points).
CORE_MODULES = ("polyhal.registry", "polyhal.progress", "polyhal.policies.adaptors", "polyhal.policies.context",
                "polyhal.passes.precision", "polyhal.specialization", "polyhal.frontends.onnx.settings",
                "polyhal.testing.settings", "polyhal.hal.queue")


def declared(modules: Iterable[str] | None = None) -> list[type[Settings]]:
    """Every record declared by ``modules`` (default: the core's, then those of each installed
    backend's entry point, ``polyhal.backends``), which are imported for it."""
    import importlib

    if modules is None:
        from importlib import metadata

        modules = [*CORE_MODULES, *sorted({ep.module for ep in metadata.entry_points(group="polyhal.backends")})]
    names = list(modules)
    for name in names:
        importlib.import_module(name)
    packages = list(dict.fromkeys(n.partition(".")[0] for n in names))  # the core first
    found = [r for r in _DECLARED if r.__module__.partition(".")[0] in packages]
    # The core's records in the order of its modules, each backend's in the order they are declared.
    return sorted(found, key=lambda r: (packages.index(r.__module__.partition(".")[0]),
                                        names.index(r.__module__) if r.__module__ in names else len(names),
                                        _DECLARED.index(r)))


#: The documentation page that holds the table, relative to a checkout's root.
TABLE_PAGE = "docs/configuration.md"
#: The lines the table sits between on that page.
TABLE_MARKERS = ("<!-- config-table: python -m polyhal.config --markdown -->\n", "<!-- /config-table -->")


def markdown(records: Iterable[type[Settings]]) -> str:
    """The documentation's table of ``records``: one row per variable."""
    rows = ["| variable | component | type | default | meaning |", "| --- | --- | --- | --- | --- |"]
    for record in records:
        for _, v in record.variables():
            rows.append(f"| `{v.name}` | {record.COMPONENT} | {v.kind.name} | {v.shown_default()} | {v.doc} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m polyhal.config``: each variable and the value in effect; ``--markdown``: the
    documentation's table; ``--update``: write that table into :data:`TABLE_PAGE` of this checkout."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m polyhal.config", description=main.__doc__)
    parser.add_argument("--markdown", action="store_true", help="print the documentation's table of every variable")
    parser.add_argument("--update", action="store_true",
                        help=f"write the table between its markers in {TABLE_PAGE} (in a source checkout)")
    args = parser.parse_args(argv)
    records = declared()
    if args.markdown:
        print(markdown(records), end="")
        return 0
    if args.update:
        return _update_table(markdown(records))
    for record in records:
        for _, v in record.variables():
            raw = os.environ.get(v.name)
            print(f"{v.name}={raw if raw is not None else ''}"
                  + ("" if raw is not None else f"  (default: {v.shown_default()})"))
    return 0


def _update_table(table: str) -> int:
    """Replace the table between :data:`TABLE_MARKERS` in :data:`TABLE_PAGE` of the checkout this
    polyhal runs from; 1 with one line on stderr where there is no such page or no markers."""
    import sys
    from pathlib import Path

    page = Path(__file__).resolve().parents[3] / TABLE_PAGE  # core/polyhal/config/ -> the root
    start, end = TABLE_MARKERS
    try:
        text = page.read_text()
    except OSError as exc:
        print(f"python -m polyhal.config: cannot read {page} ({exc.strerror or exc}): --update needs a source "
              "checkout; use --markdown and paste the table", file=sys.stderr)
        return 1
    head, found, rest = text.partition(start)
    if not found or end not in rest:
        print(f"python -m polyhal.config: {page} lost its table markers {start.strip()} ... {end}", file=sys.stderr)
        return 1
    page.write_text(head + start + table + end + rest.partition(end)[2])
    return 0
