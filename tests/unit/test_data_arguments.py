"""LMDataModule's arguments: val split, weights, batch sizes, source names and entries, the cache dir, each bad one
named."""

import re

import pytest

from lit_dtrain.data import CorpusError, CorpusSource, LMDataModule, build_token_cache
from tests.conftest import make_corpus


def test_a_tail_split_says_that_val_shares_a_document_with_train(tmp_path, caplog):
    """Too few documents for a by-document split: val is the tail of the token stream, which cuts the last
    train document in two (its start is trained on). This was logged only at INFO as a cache detail."""
    few = make_corpus(tmp_path / "few", n_files=3, size=2000)
    src = CorpusSource(name="few", kind="files", paths=[str(few)])
    with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
        splits = build_token_cache(src, tmp_path / "c", 33, progress=False)
    assert splits.meta["split"] == "by_tokens_tail"
    [message] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "data source 'few'" in message and "cuts a document in two" in message
    assert f"last {len(splits.val)} tokens" in message and "or a larger data.val_fraction," in message  # val short
    many = make_corpus(tmp_path / "many", n_files=60, size=2000)
    caplog.clear()
    with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
        by_doc = build_token_cache(CorpusSource(name="many", kind="files", paths=[str(many)]), tmp_path / "c", 33,
                                   val_fraction=0.1, progress=False)
    assert by_doc.meta["split"] == "by_document" and not caplog.records


def test_a_tail_split_for_a_short_train_side_advises_a_smaller_val_fraction(tmp_path, caplog):
    """data.val_fraction=0.99 over two documents holds both out: it is the train side the by-document split left
    short, yet the warning advised 'a larger data.val_fraction' (measured: train.py on 2 files of ~8 KB). It names
    the fix for the short side now, from the cache's meta.json, so a reused cache says it again."""
    two = make_corpus(tmp_path / "two", n_files=2, size=5000)
    src = CorpusSource(name="two", kind="files", paths=[str(two)])
    for _ in range(2):  # built, then reused
        caplog.clear()
        with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
            splits = build_token_cache(src, tmp_path / "c", 33, val_fraction=0.99, progress=False)
        assert splits.meta["split"] == "by_tokens_tail" and splits.meta["short_side"] == "train"
        [message] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert "(more or larger files, or a smaller data.val_fraction, give a clean split)" in message
        assert "larger data.val_fraction" not in message


def test_a_tail_split_of_one_file_advises_more_files_not_a_val_fraction(tmp_path, caplog):
    """One file is never split by document: train.py over one 93 KB file (its hash at 0.84) was told 'a larger
    data.val_fraction' at 0.02, and at the 0.9 that advice gave (the file held out) 'a smaller data.val_fraction',
    each a tail split again. Either side short, the warning names more files only."""
    one = make_corpus(tmp_path / "one", n_files=1, size=5000)
    src = CorpusSource(name="one", kind="files", paths=[str(one)])
    sides = set()
    for fraction in (0.5, 0.8):  # its hash is at 0.78: trained on (val short), then held out (train short)
        caplog.clear()
        with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
            splits = build_token_cache(src, tmp_path / f"c{fraction}", 33, val_fraction=fraction, progress=False)
        sides.add(splits.meta["short_side"])
        [message] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert "(one file is never split by document, whatever data.val_fraction: more files give a clean split)" \
            in message and "larger" not in message and "smaller" not in message
    assert sides == {"val", "train"}


def test_a_val_fraction_that_leaves_no_training_window_is_named_not_a_short_corpus(tmp_path):
    """A corpus of 20 documents with data.val_fraction=0.999 (every document held out) was "too short: 42001 tokens",
    which blamed a corpus that has plenty; the setting that left training 43 tokens is named now."""
    corpus = make_corpus(tmp_path / "c", n_files=20, size=500)
    src = CorpusSource(name="t", kind="files", paths=[str(corpus)])
    total = sum(len((corpus / f"doc_{i:03d}.txt").read_bytes()) + 1 for i in range(20))
    held = int(total * 0.999)
    match = (rf"data source 't': data.val_fraction=0.999 holds out {held} of its {total} tokens for validation and "
             rf"leaves {total - held} to train on, less than one window of block_size\+1 = 65 tokens; lower data.val_f")
    with pytest.raises(CorpusError, match=match):
        build_token_cache(src, tmp_path / "cache", 65, val_fraction=0.999, progress=False)
    with pytest.raises(CorpusError, match=r"data source 't' is too short: .*block_size\+1 = 9000 tokens"):
        build_token_cache(src, tmp_path / "cache", 9000, val_fraction=0.999, progress=False)


@pytest.mark.parametrize("weight, match", [("abc", r"weight must be a number, got 'abc' \(str\)"),
                                           (float("inf"), "weight must be finite and >= 0, got inf"),
                                           (float("nan"), "weight must be finite and >= 0, got nan"),
                                           (-1.0, "weight must be finite and >= 0, got -1.0")])
def test_bad_source_weight_is_named(weight, match):
    """weight='abc' was a TypeError from '>=' and weight=inf made the mixture NaN (an IndexError mid-training)."""
    with pytest.raises(CorpusError, match=match):
        CorpusSource(name="t", kind="files", paths=["x"], weight=weight)


@pytest.mark.parametrize("value", [0, -1])
def test_bad_val_batch_size_is_named(corpus, tmp_path, value):
    with pytest.raises(ValueError, match=f"data.val_batch_size must be >= 1, got {value}"):
        LMDataModule(sources=[CorpusSource(name="t", kind="files", paths=[str(corpus)])], val_batch_size=value)


@pytest.mark.parametrize("key, value, message", [
    ("block_size", 64.5, "data.block_size must be an integer, got 64.5"),  # int() took it as 64
    ("block_size", "64", "data.block_size must be an integer, got '64'"),
    ("batch_size", True, "data.batch_size must be an integer, got True"),
    ("max_val_windows", 0, "data.max_val_windows must be >= 1, got 0"),
    ("seed", 1.5, "data.seed must be an integer, got 1.5"),
    ("val_fraction", "abc", "data.val_fraction must be a number in (0, 1) (the share of documents held out), got "
                            "'abc'"),
    ("val_fraction", 1.0, "data.val_fraction must be a number in (0, 1)"),
    ("val_fraction", float("nan"), "data.val_fraction must be a number in (0, 1)"),
])
def test_bad_numbers_given_to_the_python_api_are_named(corpus, key, value, message):
    """The CLI checks these keys' types; LMDataModule took block_size=64.5 as 64 and val_fraction='abc' failed with
    float()'s own message, naming no argument."""
    with pytest.raises(ValueError, match=re.escape(message)):
        LMDataModule(sources=[CorpusSource(name="t", kind="files", paths=[str(corpus)])], **{key: value})
    whole = LMDataModule(sources=[CorpusSource(name="t", kind="files", paths=[str(corpus)])], block_size=64.0, seed=-3)
    assert (whole.block_size, type(whole.block_size), whole.seed) == (64, int, -3)  # an integral float is that int


@pytest.mark.parametrize("name", ["web/en", "a\\b", "", ".hidden", "my corpus", "a:b", 1.5])  # None: the default name
def test_a_source_name_that_breaks_metric_names_or_paths_is_a_config_error(tmp_path, name):
    """The name goes into the metric val/<name>/loss and the cache dir <name>-<key>: 'web/en' made the
    metric val/web/en/loss (one level deeper, not matched by monitors) and a subdirectory web/ in the cache
    dir; '.hidden' made a hidden cache dir; '' the metric val//loss. It was not checked."""
    sources = [{"name": "stdlib", "kind": "stdlib"}, {"name": name, "kind": "stdlib", "weight": 1.0}]
    with pytest.raises(CorpusError, match=rf"data.sources.1.name={name!r}".replace("\\", "\\\\") + r": .*letters"):
        LMDataModule(sources=sources, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(CorpusError, match=r"data source name=.*letters"):
        CorpusSource(name=name, kind="stdlib")
    assert not (tmp_path / "cache").exists()


def test_source_names_of_letters_digits_dots_dashes_and_unicode_are_accepted():
    for name in ("stdlib", "web-en_v2.1", "código", "x+y", "2024"):
        assert CorpusSource(name=name, kind="stdlib").name == name
    assert CorpusSource(name=2024, kind="stdlib").name == "2024"  # YAML's name: 2024


def test_a_bad_source_name_stops_train_before_tokenizing(tmp_path, corpus):
    from hydra.errors import InstantiationException

    from lit_dtrain.train import train
    from tests.conftest import compose_cfg

    cfg = compose_cfg(["data.sources.0.name=web/en"], tmp_path / "run", corpus)
    with pytest.raises((CorpusError, InstantiationException), match=r"data.sources.0.name='web/en'"):
        train(cfg)
    assert not (tmp_path / "token_cache").exists()

def test_a_bad_source_entry_names_its_key(tmp_path):
    """data=mixture without paths said "data source 'text': kind='files' needs a non-empty 'paths' list" (which of
    data.sources?), and a misspelled key (+data.sources.0.path=...) was a TypeError from the dataclass."""
    sources = [{"name": "stdlib", "kind": "stdlib"}, {"name": "text", "kind": "files", "paths": []}]
    no_paths = r"data.sources.1 \(data source 'text'\): kind='files' needs a non-empty 'paths' list.*sources.1.paths="
    with pytest.raises(CorpusError, match=no_paths):
        LMDataModule(sources=sources, cache_dir=str(tmp_path))
    unknown = r"data.sources.0 has an unknown key 'path' \(keys: name, kind, paths, weight, pattern\)"
    with pytest.raises(CorpusError, match=unknown):
        LMDataModule(sources=[{"name": "t", "kind": "files", "path": "~/corpus"}], cache_dir=str(tmp_path))


def test_the_paths_override_an_error_suggests_is_one_hydra_parses(tmp_path):
    """The errors of a files source without paths and of an empty data.sources suggested
    'data.sources.0.paths=[~/corpus]', which Hydra's override grammar refuses (an unquoted '~':
    'LexerNoViableAltException: data.sources.0.paths=[~/corpus]'); pasted as given, it failed again."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for sources in ([{"name": "text", "kind": "files", "paths": []}], []):
        with pytest.raises(CorpusError) as error:
            LMDataModule(sources=sources, cache_dir=str(tmp_path))
        [suggested] = re.findall(r"'(data\.sources\.0\.paths=[^']*)'", str(error.value))
        assert parser.parse_override(suggested).value() == ["~/corpus"], suggested


def test_an_empty_or_malformed_sources_list_is_named(tmp_path, corpus):
    """data.sources=[] trained on the stdlib corpus without a word (an empty list read as "not given"), and
    data.sources=[foo] failed with an AttributeError traceback in train()'s monitor check (ValueError from dict('foo')
    in LMDataModule)."""
    from hydra.errors import InstantiationException

    from lit_dtrain.train import train
    from tests.conftest import compose_cfg

    for sources in ([], (), "~/corpus", {"name": "t"}):
        with pytest.raises(CorpusError, match=r"data.sources must be a non-empty list of sources, got "):
            LMDataModule(sources=sources, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(CorpusError, match=r"data.sources.1 must be a mapping of a source's keys \(name, .*got 'foo'"):
        LMDataModule(sources=[{"name": "t", "kind": "stdlib"}, "foo"], cache_dir=str(tmp_path / "cache"))
    for override, match in [("data.sources=[]", r"data.sources must be a non-empty list"),
                            ("data.sources=[foo]", r"data.sources.0 must be a mapping")]:
        cfg = compose_cfg([override], tmp_path / "run", corpus)
        with pytest.raises((CorpusError, InstantiationException), match=match):
            train(cfg)
    assert not (tmp_path / "token_cache").exists()
    assert [s.name for s in LMDataModule(sources=None, cache_dir=str(tmp_path)).sources] == ["stdlib"]
    generated = (CorpusSource(name=n, kind="stdlib") for n in ("a", "b"))  # any iterable of sources
    assert [s.name for s in LMDataModule(sources=generated, cache_dir=str(tmp_path)).sources] == ["a", "b"]


def test_an_empty_cache_dir_is_refused_not_the_working_directory(tmp_path, corpus, monkeypatch):
    """cache_dir='' (LIT_DTRAIN_CACHE= did it through the configs, before paths read it as unset) wrote the token
    caches into the working dir."""
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    source = CorpusSource(name="t", kind="files", paths=[str(corpus)])
    for cache_dir in ("", "  "):
        with pytest.raises(CorpusError, match=r"data.cache_dir is empty \(' *'\): give .*LIT_DTRAIN_CACHE"):
            LMDataModule(sources=[source], block_size=32, cache_dir=cache_dir).prepare_data()
    assert list((tmp_path / "work").iterdir()) == []


def test_paths_given_to_a_stdlib_source_are_refused_not_ignored(tmp_path, corpus):
    """CorpusSource(name="web", paths=[...]) (kind defaults to 'stdlib'), or +data.sources.0.paths=[...] with
    data=stdlib, trained on the standard library and never read the paths."""
    with pytest.raises(CorpusError, match=r"data source 'web': kind='stdlib' reads .* takes no paths, got paths="):
        CorpusSource(name="web", paths=[str(corpus)])
    with pytest.raises(CorpusError, match=r"data.sources.0 \(data source 'stdlib'\): kind='stdlib' .*kind='files'"):
        LMDataModule(sources=[{"name": "stdlib", "kind": "stdlib", "paths": [str(corpus)]}], cache_dir=str(tmp_path))
    assert CorpusSource(name="s", kind="stdlib", paths=[]).paths == []  # an empty list is no paths
    # likewise a pattern (+data.sources.0.pattern='*.txt' with data=stdlib): it filters the files of directories only
    with pytest.raises(CorpusError, match=r"data.sources.0 \(data source 'stdlib'\): kind='stdlib' reads every \.py "
                                          r"file .* takes no pattern, got pattern='\*\.txt'"):
        LMDataModule(sources=[{"name": "stdlib", "kind": "stdlib", "pattern": "*.txt"}], cache_dir=str(tmp_path))
    assert CorpusSource(name="s", kind="stdlib", pattern="*").pattern == "*"  # the default is no pattern


def test_a_null_or_nested_path_is_named_not_looked_up_as_a_file():
    """paths: [~] in YAML is null, not the home directory: it was looked up as the path 'None' ("path None does not
    exist"); a nested list was looked up as its text "['b']"."""
    with pytest.raises(CorpusError, match=re.escape(
            "data.sources.0 (data source 't'): paths[0] is null: in YAML a bare ~ is null, not the home directory; "
            "quote it ('~', '~/corpus')")):
        LMDataModule(sources=[{"name": "t", "kind": "files", "paths": [None]}])
    with pytest.raises(CorpusError, match=re.escape("paths[1] must be one file, directory or glob, got ['b'] (list)")):
        CorpusSource(name="t", kind="files", paths=["a", ["b"]])
    assert CorpusSource(name="t", kind="files", paths=[2024]).paths == [2024]  # a directory named 2024 (YAML int)


def test_weights_whose_sum_overflows_are_refused_before_tokenizing(tmp_path):
    """Weights 1e308 and 1e308, each finite, sum to inf: every share became 0 and the first draw failed in an
    IndexError traceback inside fit."""
    a = make_corpus(tmp_path / "a", n_files=2, size=500)
    sources = [CorpusSource(name="x", kind="files", paths=[str(a)], weight=1e308),
               CorpusSource(name="y", kind="stdlib", weight=1e308)]
    with pytest.raises(CorpusError, match=re.escape("data.sources: the weights [1e+308, 1e+308] sum past the largest "
                                                    "float; only their ratios count, so scale them down")):
        LMDataModule(sources=sources, block_size=16, batch_size=2, cache_dir=str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()
