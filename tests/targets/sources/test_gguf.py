"""targets/sources/gguf.py: the bundled GGUF's header parsed once per conversion."""

from __future__ import annotations

import gguf
import pytest

from targets.sources import bundled_gguf_path
from targets.sources.gguf import _one_reader


@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_one_reader_hands_every_call_the_same_parse_and_restores_the_class():
    path = bundled_gguf_path("smollm2-135m")
    original = gguf.GGUFReader
    with _one_reader():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first  # str or Path, one parse
        assert isinstance(first, original)
        assert first.fields["general.architecture"].contents() == "llama"
    assert gguf.GGUFReader is original
