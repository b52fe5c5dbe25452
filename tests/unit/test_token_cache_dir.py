"""A token cache dir that cannot be one: the error names what is in the way."""

from __future__ import annotations

import re

import pytest

from lit_dtrain.data import CorpusError, CorpusSource, build_token_cache


@pytest.mark.parametrize("below", ["", "sub"])
def test_a_cache_dir_that_is_a_file_is_named_as_one(tmp_path, below):
    """LIT_DTRAIN_CACHE naming a file (or a path below one) said 'File exists; free space there'."""
    (tmp_path / "c.txt").write_text("some text to train on\n" * 20)
    (tmp_path / "afile").write_text("not a dir")
    cache = tmp_path / "afile" / below if below else tmp_path / "afile"
    source = CorpusSource(name="t", kind="files", paths=[str(tmp_path / "c.txt")])
    expected = (f"cannot write the token cache of data source 't' under '{cache}': '{tmp_path / 'afile'}' is a file, "
                "not a directory; move it away or point LIT_DTRAIN_CACHE")
    with pytest.raises(CorpusError, match=re.escape(expected)):
        build_token_cache(source, cache, min_tokens=9, val_fraction=0.1, progress=False)
