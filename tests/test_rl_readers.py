"""The RL dump readers: one registry (`lpf.rl.readers.READERS`) whose every entry keeps the `Reader` protocol,
from which the command line's `--format` choices, the detection order and the "readable:" line all come."""

from __future__ import annotations

import sys
import types

import pytest

from lpf.rl import FORMAT_NAMES, readers


def test_every_registered_reader_keeps_the_protocol_and_the_names_come_from_the_registry():
    from lpf.cli.rl import rl
    from lpf.rl.formats import _DETECT_ORDER, _KNOWN, FORMATS

    assert FORMAT_NAMES == tuple(readers.READERS) == tuple(FORMATS)
    for name, r in readers.readers().items():
        assert isinstance(r, (readers.RowReader, readers.FileReader)) and r.NAME == name
        assert r.LAYOUT in _KNOWN and (name in _DETECT_ORDER) == (r.DETECT is not None)
    choices = {c for cmd in rl.commands.values() for p in cmd.params if p.name == "fmt" for c in p.type.choices}
    assert choices == {"auto", *FORMAT_NAMES}


def test_a_module_that_breaks_the_protocol_is_named_not_read(monkeypatch):
    broken = types.ModuleType("lpf_test_broken_reader")
    broken.NAME, broken.REQUIRED = "broken", ("x",)  # no LAYOUT, KINDS, DETECT, matches, missing, convert
    monkeypatch.setitem(sys.modules, broken.__name__, broken)
    monkeypatch.setitem(readers.READERS, "broken", broken.__name__)
    readers.reader.cache_clear()
    try:
        with pytest.raises(TypeError, match="is not an RL dump reader for 'broken'.*LAYOUT"):
            readers.reader("broken")
    finally:
        readers.reader.cache_clear()
