"""``scripts/generate.py`` prints one sample's text as its tokens are drawn: it printed nothing until the last one
(on this shared CPU, 90 s of silence for ``--max-new-tokens 1500`` of a tiny model, then all 13845 bytes at once);
the output is unchanged, byte for byte."""

import json

import torch

from lit_dtrain.data import ByteTokenizer
from lit_dtrain.models.llama import Llama
from tests.conftest import load_script
from tests.unit.test_script_checkpoint_errors import _tiny_checkpoint


class _Recorder:
    """A stdout that notes, for each write, whether ``Llama.generate`` had returned yet."""

    def __init__(self):
        self.writes: list[tuple[bool, str]] = []
        self.generated = False

    def write(self, text: str) -> int:
        self.writes.append((self.generated, text))
        return len(text)

    def flush(self) -> None:
        pass


def test_one_sample_is_written_while_it_is_drawn_and_the_output_is_unchanged(tmp_path, monkeypatch):
    ckpt = str(_tiny_checkpoint(tmp_path / "tiny.ckpt"))
    out = _Recorder()
    generate = Llama.generate

    def noting_the_end(*args, **kwargs):
        result = generate(*args, **kwargs)
        out.generated = True
        return result

    monkeypatch.setattr(Llama, "generate", noting_the_end)
    monkeypatch.setattr("sys.stdout", out)
    load_script("generate").main([ckpt, "--prompt", "d\u00e9f ", "--max-new-tokens", "8", "--device", "cpu"])
    text = "".join(t for _, t in out.writes)
    last = text.rstrip("\n").split("\n")[-1]
    result = json.loads(last)
    assert text == result["text"] + "\n" + last + "\n"  # as print(text) then the JSON line printed it
    during = "".join(t for generated, t in out.writes if not generated)
    assert during.startswith("d\u00e9f ") and len(during) > len("d\u00e9f ")  # the prompt, then drawn text
    assert result["text"].startswith(during)
    assert sum(1 for generated, t in out.writes if not generated and t) >= 2  # the prompt, then token by token


def test_a_character_split_over_tokens_streams_as_decode_gives_it(capsys):
    """A UTF-8 character's bytes come as several tokens: the stream holds them until the last one; invalid bytes,
    EOS and an id that is no byte come out as ``ByteTokenizer.decode`` writes them."""
    tok = ByteTokenizer()
    ids = [*"d\u00e9\u20ac".encode(), 0xFF, 0xC3, ord("("), tok.eos_id, 300, *"\U0001f600".encode()[:3]]
    stream = load_script("generate").TextStream(tok)
    for i in ids:
        stream.write(torch.tensor([i]))
    stream.write([], final=True)
    assert capsys.readouterr().out == tok.decode(ids)
