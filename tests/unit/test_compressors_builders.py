"""Compressors and local-update rules built from names, mappings and Python values: what is refused and how it is
named."""

from __future__ import annotations

from pathlib import Path

import pytest

from lit_dtrain.strategies import (
    COMPRESSORS,
    BlockQuantizer,
    DiLoCo,
    HalfPrecision,
    ScaledSign,
    TopK,
    build_compressor,
    build_local_update,
)


def _setting(codec, key: str):
    """A codec's value of its constructor argument ``key`` (a dtype as its name: ``value_dtype_name``)."""
    return getattr(codec, f"{key}_name") if hasattr(codec, f"{key}_name") else getattr(codec, key)


def test_compressor_names_build_what_their_presets_configure():
    """``compressor="int4"`` (Python) and ``strategy=ddp_compressed/int4`` (Hydra) are the same codec: of the same
    class, with every setting the preset's file writes (``seed`` too, which the codecs' repr leaves out), for every
    codec preset shipped (compared by repr alone, and only for the presets whose name the registry knew, a preset
    whose name it lost or a seed that differed passed)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from tests.conftest import CONF_DIR

    compared = []
    for preset in sorted((Path(CONF_DIR) / "strategy" / "ddp_compressed").glob("*.yaml")):
        node = OmegaConf.load(preset).get("compressor")
        if not node or "_target_" not in node:  # a local-update preset (test_mutants5_local_updates)
            continue
        by_name = build_compressor(preset.stem)
        assert type(by_name) is type(instantiate(node)), preset.stem
        written = {key: value for key, value in node.items() if key != "_target_"}
        assert {key: _setting(by_name, key) for key in written} == written, preset.stem
        compared.append(preset.stem)
    assert compared == sorted(set(COMPRESSORS) - {"int4_rs"})  # every codec name has its preset but int4_rs


def test_loading_another_compressors_state_fails_loudly():
    with pytest.raises(ValueError, match="'topk'"):
        ScaledSign().load_state_dict(TopK().state_dict())


def test_builders_reject_unknown_names_and_keys():
    with pytest.raises(ValueError, match="unknown compressor 'lz4'"):
        build_compressor("lz4")
    with pytest.raises(ValueError, match="compressor.ration is not an argument .*did you mean 'compressor.ratio'"):
        build_compressor({"name": "topk", "ration": 0.1})
    with pytest.raises(ValueError, match="ratio must be in"):
        TopK(ratio=0.0)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        BlockQuantizer(bits=2)
    with pytest.raises(ValueError, match="dtype must be one of"):
        HalfPrecision(dtype="fp8")
    d = build_local_update({"name": "diloco", "sync_period": 4, "compressor": "int8"})
    assert isinstance(d, DiLoCo) and isinstance(d.compressor, BlockQuantizer)



def test_block_quantizers_bits_are_checked_as_a_count():
    """BlockQuantizer(bits=torch.tensor(4)) was taken as 4 bits (tensor(4) in (4, 8) is true) where its other
    arguments refuse a tensor, and bits=8.0 was taken and named the codec 'int8.0'. A tensor is refused now, and a
    whole float or numpy integer is the int it holds, as block_size's is."""
    import numpy as np
    import torch

    for bits in (torch.tensor(4), True, 4.5, "8"):
        with pytest.raises(ValueError, match=r"^BlockQuantizer: bits must be 8 or 4, got "):
            BlockQuantizer(bits=bits)
    for bits, name in ((8.0, "int8"), (np.int64(4), "int4")):
        q = BlockQuantizer(bits=bits)
        assert (q.name, q.levels, type(q.bits)) == (name, 127 if name == "int8" else 7, int)


def test_a_mapping_given_in_python_has_its_flags_and_numbers_type_checked():
    """Only a config's mapping was type-checked: CompressedDDPStrategy(compressor={"name": "topk", "error_feedback":
    "no"}) trained with error feedback on (bool('no') is true). One check serves both forms now."""
    from lit_dtrain.errors import ConfigError
    from lit_dtrain.strategies import CompressedDDPStrategy

    with pytest.raises(ConfigError, match=r"^compressor.error_feedback must be true or false, got 'no' \(str\)$"):
        CompressedDDPStrategy(compressor={"name": "topk", "error_feedback": "no"})
    with pytest.raises(ConfigError, match=r"^compressor.ratio must be a number, got '0.1' \(str\)$"):
        build_compressor({"name": "topk", "ratio": "0.1"})
    with pytest.raises(ConfigError, match=r"^local_update.nesterov must be true or false, got 1 \(int\)$"):
        build_local_update({"name": "diloco", "nesterov": 1})
    assert not build_compressor({"name": "topk", "error_feedback": False, "ratio": 1}).error_feedback


def test_numpy_numbers_given_in_python_are_taken_as_python_numbers():
    """A number read from a numpy array was refused where an integer is asked: build_compressor({"name": "powersgd",
    "matrix_approximation_rank": np.int64(2)}) raised 'must be an integer, got np.int64(2) (int64)', and
    make_ddp(collective_timeout_s=np.int64(60)) 'must be a number of seconds > 0'. They are taken, as Python's int
    and float (the codec's state holds no numpy scalar); a bool is still no integer."""
    import numpy as np

    from lit_dtrain.errors import ConfigError
    from lit_dtrain.strategies import CompressedDDPStrategy, make_ddp

    rank = build_compressor({"name": "powersgd", "matrix_approximation_rank": np.int64(2)}).matrix_approximation_rank
    assert rank == 2 and type(rank) is int
    ratio = build_compressor({"name": "topk", "ratio": np.float32(0.5)}).ratio
    assert ratio == 0.5 and type(ratio) is float
    assert type(build_local_update({"name": "local_sgd", "min_period": np.int64(4)}).min_period) is int
    assert make_ddp(collective_timeout_s=np.int64(60))._timeout.total_seconds() == 60
    assert CompressedDDPStrategy(compressor="int8", collective_timeout_s=np.uint16(8))._timeout.total_seconds() == 8
    for flag in (True, np.bool_(True)):
        with pytest.raises(ConfigError, match=r"^compressor.matrix_approximation_rank must be an integer, got"):
            build_compressor({"name": "powersgd", "matrix_approximation_rank": flag})
    with pytest.raises(ConfigError, match=r"^compressor.block_size must be an integer, got np.float64\(64.0\)"):
        build_compressor({"name": "int8", "block_size": np.float64(64)})


def test_a_numpy_bool_given_in_python_is_taken_where_a_flag_is_asked():
    """build_compressor({"name": "topk", "error_feedback": np.False_}) (a flag read from an array) was refused with
    'must be true or false, got np.False_ (bool)', which reads as if Python's bool were refused. It is taken, as numpy
    numbers are where a number is asked, and the codec holds Python's bool; where a number is asked a numpy bool is
    still refused, its type named as numpy's."""
    import numpy as np

    from lit_dtrain.errors import ConfigError

    for flag in (np.False_, np.True_):
        feedback = build_compressor({"name": "topk", "error_feedback": flag}).error_feedback
        assert feedback is bool(flag)
    assert build_local_update({"name": "diloco", "nesterov": np.False_}).nesterov is False
    with pytest.raises(ConfigError, match=r"^compressor.ratio must be a number, got np.True_ \(numpy.bool\)$"):
        build_compressor({"name": "topk", "ratio": np.True_})
    with pytest.raises(ConfigError, match=r"^compressor.error_feedback must be true or false, got np.str_\('no'\) "
                                          r"\(numpy.str_\)$"):
        build_compressor({"name": "topk", "error_feedback": np.str_("no")})


def test_a_bad_collective_timeout_given_in_python_is_named_as_its_argument():
    """make_ddp(collective_timeout_s='60') was told 'strategy.collective_timeout_s must be ...', a key of train.py's
    config that a Python user never wrote; a config's value is still named by its key
    (test_configs_run_dirs)."""
    from lit_dtrain.strategies import CompressedDDPStrategy, make_ddp, make_fsdp

    for build, name in ((make_ddp, "make_ddp"), (make_fsdp, "make_fsdp"),
                        (lambda **kw: CompressedDDPStrategy(compressor="int8", **kw), "CompressedDDPStrategy")):
        with pytest.raises(ValueError, match=rf"^{name}: collective_timeout_s must be a number of seconds > 0, got "
                                             r"'60'$"):
            build(collective_timeout_s="60")


def test_diloco_s_codec_given_in_python_is_named_by_its_place():
    """CompressedDDPStrategy(local_update={"name": "diloco", "compressor": {...}}) named a bad key of DiLoCo's codec
    'compressor.error_feedback', the key of the strategy's own codec, which the user had not set."""
    from lit_dtrain.errors import ConfigError
    from lit_dtrain.strategies import CompressedDDPStrategy

    bad = {"name": "topk", "error_feedback": "no"}
    with pytest.raises(ConfigError, match=r"^local_update.compressor.error_feedback must be true or false, got 'no'"):
        CompressedDDPStrategy(local_update={"name": "diloco", "compressor": bad})
    with pytest.raises(ValueError, match=r"^local_update.compressor.ratoi is not an argument .*'local_update.compres"):
        build_local_update({"name": "diloco", "compressor": {"name": "topk", "ratoi": 0.1}})
    with pytest.raises(ConfigError, match=r"^compressor.error_feedback must be"):  # DiLoCo itself: its own argument
        DiLoCo(compressor=bad)
    assert isinstance(build_local_update({"name": "diloco", "compressor": "int8"}).compressor, BlockQuantizer)


def test_a_codec_spec_names_a_misspelt_key_and_the_right_one():
    """A mapping's unknown argument was the codec class's TypeError (under train.py inside Hydra's instantiate
    wrapper, 'full_key: strategy'), an unknown name a list of names without the close one."""
    from lit_dtrain.strategies import CompressedDDPStrategy

    with pytest.raises(ValueError, match=r"^compressor.ratoi is not an argument of the compressor 'topk' \(TopK\); "
                                         r"did you mean 'compressor.ratio'\?$"):
        CompressedDDPStrategy(compressor={"name": "topk", "ratoi": 0.01})
    with pytest.raises(ValueError, match=r"^local_update: unknown local-update rule 'dilcoo'; .*did you mean 'diloco'"):
        CompressedDDPStrategy(local_update="dilcoo")
    with pytest.raises(ValueError, match=r"^compressor.bits: the compressor 'int4_rs' sets bits=4 itself$"):
        build_compressor({"name": "int4_rs", "bits": 8})
    # a preset's defaults can be overridden, its name's arguments cannot
    assert build_compressor("int4").error_feedback and not build_compressor({"name": "int4", "error_feedback": False}
                                                                            ).error_feedback
    assert build_compressor({"name": "int8_rs", "block_size": 64}).block_size == 64
    assert build_local_update({"name": "local_sgd_adaptive", "sync_period": 4}).adaptive


@pytest.mark.parametrize("preset", ["local_sgd", "local_sgd_adaptive", "diloco"])
def test_a_local_update_preset_turned_per_step_names_only_the_sync_flags_the_user_gave(preset, tiny_cfg):
    """The local-update presets set both sync flags to true, so strategy.local_update=null with a per-step codec over
    them was told 'sync_on_last_step and sync_before_validation ... do nothing: remove it' of keys never typed."""
    import warnings

    from lit_dtrain.strategies.by_name import build_strategy

    per_step = [f"strategy=ddp_compressed/{preset}", "strategy.local_update=null", "strategy.compressor=int8"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy = build_strategy(tiny_cfg(*per_step))
        local = build_strategy(tiny_cfg(f"strategy=ddp_compressed/{preset}"))
    assert strategy.sync_on_last_step and strategy.sync_before_validation
    assert local.sync_on_last_step and local.sync_before_validation
    with pytest.warns(UserWarning, match=r"^CompressedDDPStrategy: sync_on_last_step acts only"):
        build_strategy(tiny_cfg(*per_step, "strategy.sync_on_last_step=false"))


def test_a_codec_with_a_local_update_is_refused_in_the_words_of_a_config(tiny_cfg):
    """strategy=ddp_compressed/local_sgd strategy.compressor=int8 was told to 'set compressor=None', the Python form."""
    from hydra.errors import InstantiationException

    from lit_dtrain.strategies.by_name import build_strategy

    with pytest.raises(InstantiationException) as caught:
        build_strategy(tiny_cfg("strategy=ddp_compressed/local_sgd", "strategy.compressor=int8"))
    assert str(caught.value.__cause__).endswith(
        "gradient compressor would never run: set strategy.compressor=null (compressor=None in Python); a codec for "
        "DiLoCo's pseudo-gradient goes in strategy.local_update.compressor")


def test_sync_flags_given_under_a_per_step_codec_are_named():
    """sync_on_last_step / sync_before_validation act only under a local-update rule; given under a per-step codec
    (false included) they did nothing, without a word. Not given, or under local updates: no warning, default true."""
    import warnings

    from lit_dtrain.strategies import CompressedDDPStrategy

    with pytest.warns(UserWarning, match=r"^CompressedDDPStrategy: sync_before_validation acts only under a "
                                         r"local-update rule .* the compressor 'int8' .* does nothing: remove it$"):
        assert not CompressedDDPStrategy(compressor="int8", sync_before_validation=False).sync_before_validation
    with pytest.warns(UserWarning, match=r"sync_on_last_step and sync_before_validation act only"):
        CompressedDDPStrategy(compressor="topk", sync_on_last_step=True, sync_before_validation=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = CompressedDDPStrategy(compressor="int8")
        local = CompressedDDPStrategy(local_update="local_sgd", sync_on_last_step=False)
    assert plain.sync_on_last_step and plain.sync_before_validation
    assert not local.sync_on_last_step and local.sync_before_validation
    # on one process (world size 1 until a fit's setup says otherwise): DiLoCo's pseudo-gradient codec is named too
    from lit_dtrain.strategies.without_effect import warn_about_settings_without_effect

    with pytest.warns(UserWarning, match=r"the 'int8' codec sends nothing, yet training uses its decoded \(lossy\) "
                                         r"diloco pseudo-gradient"):
        warn_about_settings_without_effect(CompressedDDPStrategy(local_update={"name": "diloco", "compressor": "int8"}),
                                           None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for quiet in (CompressedDDPStrategy(compressor="none"), CompressedDDPStrategy(local_update="diloco")):
            warn_about_settings_without_effect(quiet, None)
    # 16-bit gradients (bf16-true) through a 16-bit codec: no byte saved (a 2-rank run logged compression_ratio 1)
    from unittest import mock

    from lightning.pytorch.plugins import HalfPrecision as HalfPrecisionPlugin
    from lightning.pytorch.plugins import Precision

    fp16 = CompressedDDPStrategy(compressor="fp16", precision_plugin=HalfPrecisionPlugin("bf16-true"))
    with pytest.warns(UserWarning, match=r"^CompressedDDPStrategy: under trainer.precision=bf16-true the gradients are "
                                         r"bf16 already: the 'fp16' codec sends as many bytes .* fp16's range; use "):
        warn_about_settings_without_effect(fp16, None)
    # bf16 has the wider range: on fp16 gradients it rounds them to 8 significant bits (it said "to bf16's range")
    bf16 = CompressedDDPStrategy(compressor="bf16", precision_plugin=HalfPrecisionPlugin("16-true"))
    with pytest.warns(UserWarning, match=r"the 'bf16' codec sends as many bytes \(comm/compression_ratio 1\) and "
                                         r"rounds them to bf16's 8 significant bits \(fp16 keeps 11\); use ") as said:
        warn_about_settings_without_effect(bf16, None)
    assert not any("range" in str(w.message) for w in said if "16-true" in str(w.message))
    with warnings.catch_warnings(), mock.patch.object(CompressedDDPStrategy, "world_size", 2):
        warnings.simplefilter("error")
        fp16.precision_plugin = Precision()  # 32-true: fp32 gradients, 2x fewer bytes; 2 processes
        warn_about_settings_without_effect(fp16, None)
