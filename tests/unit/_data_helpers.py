"""Helpers shared by the test_data_*.py and test_token_cache_*.py files."""

from lit_dtrain.data import CorpusSource, LMDataModule


def files_source(path, name="x") -> CorpusSource:
    return CorpusSource(name=name, kind="files", paths=[str(path)])


def dm_for(corpus, tmp_path, **kw):
    kw.setdefault("block_size", 32)
    kw.setdefault("batch_size", 4)
    src = kw.pop("sources", [CorpusSource(name="t", kind="files", paths=[str(corpus)])])
    dm = LMDataModule(sources=src, cache_dir=str(tmp_path / "cache"), progress=False, **kw)
    dm.prepare_data()
    dm.setup()
    return dm


def drew_a_batch(dm):
    """``dm`` after one training batch: its state is a checkpoint's of a run that trained (micro_step 1)."""
    dm.next_train_batch()
    return dm


def _is_val(data: bytes, val_fraction: float) -> bool:
    import hashlib

    from lit_dtrain.data.token_cache import _is_val_doc

    return _is_val_doc(hashlib.sha256(data).digest(), val_fraction)
