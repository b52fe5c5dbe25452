"""The note on a lone surrogate in a text value (``run_name``, ``sample.prompt``): only ``\\udc80``-``\\udcff``, what
Python makes of a command-line byte that is not UTF-8 (PEP 383), name a byte; a high surrogate (``"\\ud800"`` in a
YAML config) or a low one below ``\\udc80`` (no byte decodes to it) gets no byte, not a negative or ASCII one."""

from __future__ import annotations

import re

import pytest

from lit_dtrain.config_checks import ConfigError, check_utf8_text

CMDLINE = " (byte 0x{} of a command line that is not UTF-8)"


@pytest.mark.parametrize("char, note", [
    ("\ud800", ""), ("\udbff", ""),  # high surrogates: the note read 'byte 0x-400' / 'byte 0x-1'
    ("\udc00", ""), ("\udc7f", ""),  # low, below any byte surrogateescape makes
    ("\udc80", CMDLINE.format("80")), ("\udcff", CMDLINE.format("ff")),  # $'\x80', $'\xff' on the command line
])
def test_only_a_surrogate_of_an_undecodable_byte_names_the_byte(char, note):
    text = f"ab{char}c"
    message = f"sample.prompt={text!r} is not valid text: character 2 is a lone surrogate{note}; write it in UTF-8"
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        check_utf8_text("sample.prompt", text)


def test_text_without_a_surrogate_passes():
    check_utf8_text("run_name", "expé_✓ \U0001f600")  # an astral character is no surrogate in a Python str
