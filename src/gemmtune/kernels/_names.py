"""The ``prefix:TAG<value>.TAG<value>...`` names that tables and the CLI spell kernel configs with.

``triton.tile:BM64.BN64.BK32.G8.W4.S3``, ``triton.splitk:...`` and ``cublaslt:id66.tile64x8...``
share this one codec: the prefix names the kernel family, then one tagged value per field of the
config's dataclass, in a fixed order. A name that does not parse says what is wrong and the
accepted form. A config dataclass gets ``name`` and ``from_name`` by deriving from
``NamedConfig`` and setting its ``NAME_CODEC``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

INT = "[0-9]+"


@dataclass(frozen=True)
class Field:
    """One ``TAG<value>`` of a name: ``tag`` spelled before the value, ``attr`` the dataclass field
    it holds, ``pattern`` the value's text (a regular expression) and ``parse`` text -> value."""

    tag: str
    attr: str
    pattern: str = INT
    parse: Callable[[str], object] = int
    # A trailing field with a default may be left out of a name, and is left out when it holds
    # the default: names written before the field existed keep their meaning.
    default: object = None

    @property
    def form(self) -> str:
        """How errors show this field: ``BM<int>``, or the pattern itself where it is not INT;
        in brackets where it may be left out."""
        text = f"{self.tag}<{'int' if self.pattern == INT else self.pattern}>"
        return text if self.default is None else f"[{text}]"


class NameCodec:
    """Formats a config as ``prefix:TAG<value>...`` and parses such a name back.

    ``what`` names the config in errors ("tile config"); ``form`` is the accepted form they show,
    by default the fields' own (``triton.tile:BM<int>.BN<int>...``).
    """

    def __init__(self, what: str, prefix: str, fields: tuple[Field, ...], form: str | None = None):
        self.what = what
        self.prefix = prefix
        optional = [f.default is not None for f in fields]
        if optional != sorted(optional):
            raise ValueError(f"{what}: fields with a default must come last")
        self.fields = fields
        self.form = form or f"{prefix}:" + ".".join(f.form for f in fields)
        self._patterns = tuple(re.compile(rf"{f.tag}({f.pattern})") for f in fields)

    def format(self, config) -> str:
        """Every field, less the trailing ones that hold their defaults (fields are positional:
        an optional field before a spelled one is spelled too)."""
        shown = list(self.fields)
        while shown and shown[-1].default is not None and \
                getattr(config, shown[-1].attr) == shown[-1].default:
            shown.pop()
        return f"{self.prefix}:" + ".".join(f"{f.tag}{getattr(config, f.attr)}" for f in shown)

    def parse(self, cls, name: str):
        """``cls(**fields of name)``; ValueError naming what is wrong and the accepted form, also
        where ``cls`` itself refuses a value (a ValueError from its ``__post_init__``)."""
        prefix, sep, body = name.partition(":")
        if not sep or prefix != self.prefix:
            raise ValueError(f"{self.what} {name!r}: prefix {prefix!r} is not {self.prefix!r}; "
                             f"expected {self.form}")
        parts = body.split(".")
        required = sum(1 for f in self.fields if f.default is None)
        if not required <= len(parts) <= len(self.fields):
            count = (f"{required} to {len(self.fields)}" if required < len(self.fields)
                     else str(required))
            raise ValueError(f"{self.what} {name!r}: has {len(parts)} dot-separated fields, "
                             f"expected {count}: {self.form}")
        values = {f.attr: f.default for f in self.fields[len(parts):]}
        for part, field, pattern in zip(parts, self.fields, self._patterns):
            match = pattern.fullmatch(part)
            if match is None:
                raise ValueError(f"{self.what} {name!r}: bad field {part!r}, expected "
                                 f"{field.form}; expected {self.form}")
            values[field.attr] = field.parse(match.group(1))
        try:
            return cls(**values)
        except ValueError as e:
            raise ValueError(f"{self.what} {name!r}: {e}; expected {self.form}") from None


class NamedConfig:
    """Base of the frozen config dataclasses that tables and the CLI spell by name: ``name`` and
    ``from_name`` through the class attribute ``NAME_CODEC`` (no annotation, so not a field)."""

    NAME_CODEC: NameCodec

    @property
    def name(self) -> str:
        return self.NAME_CODEC.format(self)

    @classmethod
    def from_name(cls, name: str):
        """Parse ``name`` back into a config; ValueError with what is wrong and the form expected."""
        return cls.NAME_CODEC.parse(cls, name)
