"""A resume with other mixture weights draws another share of each source: warned, as another data seed is."""

from __future__ import annotations

from lit_dtrain.data import LMDataModule
from lit_dtrain.data.corpus import CorpusSource
from tests.conftest import make_corpus


def mixture(tmp_path, a: float, b: float) -> LMDataModule:
    sources = [CorpusSource(name="old", kind="files", paths=[str(tmp_path / "a")], weight=a),
               CorpusSource(name="new", kind="files", paths=[str(tmp_path / "b")], weight=b)]
    dm = LMDataModule(sources=sources, cache_dir=str(tmp_path / "cache"), progress=False, block_size=32, batch_size=4)
    dm.prepare_data()
    dm.setup()
    return dm


def test_resuming_with_other_mixture_weights_warns(tmp_path, caplog):
    """A CPT run at 20 % replay (weights 20/80) resumed with 50/50 drew half its windows from the old corpus from the
    resumed step on (1000 batches: 0.205 of the windows before, 0.5 after) without a word."""
    make_corpus(tmp_path / "a", n_files=4, seed=1)
    make_corpus(tmp_path / "b", n_files=4, seed=2)
    state = mixture(tmp_path, 20, 80).state_dict()
    assert state["mixture_shares"] == {"old": 0.2, "new": 0.8}

    def said(a: float, b: float) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
            mixture(tmp_path, a, b).load_state_dict(state)
        return [r.getMessage() for r in caplog.records if "mixture shares" in r.getMessage()]

    assert said(20, 80) == [] and said(2, 8) == []  # the same shares, however written
    [message] = said(50, 50)
    assert "mixture shares (old 0.2, new 0.8), and this run's data.sources weights give (old 0.5, new 0.5)" in message
    assert "data.sources.0.weight=0.2 data.sources.1.weight=0.8 continues it" in message
    old = dict(state)
    del old["mixture_shares"]  # a checkpoint from before the record: nothing to compare
    caplog.clear()
    with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
        mixture(tmp_path, 50, 50).load_state_dict(old)
    assert not [r for r in caplog.records if "mixture shares" in r.getMessage()]


def test_the_advised_weights_continue_the_run_without_a_second_warning(tmp_path, caplog):
    """Weights 1 and 2 resumed with 1 and 1 advised 'data.sources.0.weight=0.3333 data.sources.1.weight=0.6667',
    which, followed (a real data=mixture run), warned again: '(stdlib 0.3333, text 0.6667), and this run's ... give
    (stdlib 0.3333, text 0.6667)'. The advice is exact now, and shares close to each other show the digits that
    differ."""
    import re

    make_corpus(tmp_path / "a", n_files=4, seed=1)
    make_corpus(tmp_path / "b", n_files=4, seed=2)
    state = mixture(tmp_path, 1, 2).state_dict()

    def said(a: float, b: float) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
            mixture(tmp_path, a, b).load_state_dict(state)
        return [r.getMessage() for r in caplog.records if "mixture shares" in r.getMessage()]

    [message] = said(1, 1)
    advised = [float(w) for w in re.findall(r"data\.sources\.\d\.weight=(\S+)", message)]
    assert said(*advised) == []
    [close] = said(0.3333, 0.6667)
    assert "mixture shares (old 0.33333, new 0.66667), and this run's data.sources weights give (old 0.3333, new " \
           "0.6667)" in close
