"""Sample text from a lit_dtrain checkpoint: temperature, top-k and top-p (nucleus) sampling.

    python scripts/generate.py outputs/runs/<run>/checkpoints/last.ckpt --prompt "def " --max-new-tokens 200
    python scripts/generate.py last.ckpt --prompt-file prompt.py      # the file's bytes, as they are
    python scripts/generate.py last.ckpt --top-k 0 --top-p 0.9        # the likeliest tokens holding 90 %
    git show HEAD:train.py | python scripts/generate.py last.ckpt --prompt-file -     # stdin

The checkpoint is loaded with ``torch.load(weights_only=True)``; the model shape comes from the
``model_config`` entry that ``LitLLM`` stores in every checkpoint; the weights (bf16 ones too) are sampled in fp32, on
``--device`` (default: cuda where available, else cpu). The end-of-run sample of ``train.py`` is drawn the same
way (fp32, seed ``seed``): ``--seed <the run's seed>`` with its ``sample.*`` values prints the same text on the same
device type. An empty prompt starts from EOS, which is not printed. ``--prompt-file`` reads the prompt's bytes from a
file (``-``: stdin) as they are, a final newline included (the model reads bytes, as it reads ``--prompt``'s); an empty
or unreadable file is refused. The model sees the last ``block_size`` tokens of a longer prompt. The last line is
JSON: ``{"error": ...}`` on bad input (exit status 2). One sample's text is printed as its tokens are drawn (the prompt
first), so a long ``--max-new-tokens`` shows its progress; the output is the same as printing it whole at the end.
Piped into a reader that stops early (``| head -n 2``), it ends as ``cat`` does (status 141).
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import sys

import torch

from lit_dtrain.checkpoint import CheckpointError
from lit_dtrain.data import ByteTokenizer
from lit_dtrain.end_sample import generated_text
from lit_dtrain.models.llama import check_sampling
from lit_dtrain.schedules.workflows import model_from_checkpoint
from lit_dtrain.utils.args import ScriptArgumentParser, fail, positive_int, quiet_when_the_reader_goes, seed_int


def load_model(path: str):
    """``(model, checkpoint)`` of a lit_dtrain checkpoint; one line naming the file when it is unusable (missing,
    truncated, foreign, weightless, or with non-finite weights: NaN logits, which multinomial refuses and greedy
    decoded as token 0 every time)."""
    try:
        return model_from_checkpoint(path)
    except CheckpointError as e:
        fail(str(e))


def read_prompt(path: str) -> bytes:
    """The bytes of ``--prompt-file path`` (``-``: stdin); one line naming the file when it cannot be read or is
    empty (an empty prompt is ``--prompt ''``: an empty file is more likely one that was never written)."""
    name = "stdin" if path == "-" else repr(path)
    try:
        if path == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as f:
                data = f.read()
    except OSError as e:
        fail(f"--prompt-file {name}: cannot read it: {e.strerror or e}")
    if not data:
        fail(f"--prompt-file {name} is empty; to start a new document use --prompt ''")
    return data


def sampling_device(name: str | None) -> torch.device:
    """The device of ``--device``: by default CUDA's current device where CUDA is available, else the CPU. A name
    torch does not know, or a CUDA device this machine lacks, is one line naming the flag."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as e:
        fail(f"--device {name!r} is not a device name (cpu, cuda, cuda:1, ...): {e}")
    if device.type == "cuda":  # cuda alone means the current device: the generator must be on the model's device
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            fail(f"--device {name}: CUDA is not available here (torch {torch.__version__}); use --device cpu")
        if device.index is not None and device.index >= count:
            fail(f"--device {name}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
        return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    elif device.type != "cpu":
        fail(f"--device {name}: only cpu and cuda are supported")
    return device


class TextStream:
    """Writes one sample's text to stdout piece by piece, as its tokens come: their bytes go through an incremental
    UTF-8 decoder, which holds a character's first bytes until its last one comes, so the pieces make up the text that
    ``ByteTokenizer.decode`` gives for all the tokens at the end."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self.tokenizer, self.decoder = tokenizer, codecs.getincrementaldecoder("utf-8")(errors="replace")

    def write(self, ids, final: bool = False) -> None:
        sys.stdout.write(self.decoder.decode(self.tokenizer.to_bytes(ids), final=final))
        sys.stdout.flush()


@quiet_when_the_reader_goes  # `generate.py ... | head`: ends as cat does
def main(argv: list[str] | None = None) -> None:
    ap = ScriptArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="path to a .ckpt written by train.py")
    source = ap.add_mutually_exclusive_group()
    source.add_argument("--prompt", default="def ", help="text to continue ('' starts a new document)")
    source.add_argument("--prompt-file", metavar="PATH", help="continue the bytes of this file ('-': stdin)")
    ap.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate")
    ap.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    ap.add_argument("--top-k", type=int, default=40, help="sample among the k most likely tokens (0: all)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: among the most likely tokens (after "
                    "--top-k and --temperature) down to the first whose cumulative probability reaches p, in (0, 1] "
                    "(1: all)")
    ap.add_argument("--seed", type=seed_int, default=0, help="sampling seed (the same seed draws other text on "
                    "another device type)")
    ap.add_argument("--num-samples", type=positive_int, default=1, help="continuations of the prompt (one batch)")
    ap.add_argument("--device", default=None, help="where to sample: cpu, cuda, cuda:1, ... (default: cuda if "
                    "available, else cpu)")
    args = ap.parse_args(argv)
    flags = {"temperature": "--temperature", "top_k": "--top-k", "max_new_tokens": "--max-new-tokens",
             "top_p": "--top-p"}
    try:  # before loading; the check of sample.* and Llama.generate (a negative temperature used to mean greedy)
        check_sampling(args.max_new_tokens, args.temperature, args.top_k, flags, top_p=args.top_p)
    except ValueError as e:
        ap.error(str(e))
    device = sampling_device(args.device)
    # the bytes given on the command line: argv bytes that are not UTF-8 arrive as surrogates, which str.encode refuses
    prompt = read_prompt(args.prompt_file) if args.prompt_file is not None else os.fsencode(args.prompt)

    model, ckpt = load_model(args.checkpoint)
    model.to(device)
    tok = ByteTokenizer()
    ids = torch.as_tensor(tok.prompt_ids(prompt).astype("int64"))[None].to(device)  # "" starts a new document
    g = torch.Generator(device=device).manual_seed(args.seed)
    stream = TextStream(tok) if args.num_samples == 1 else None
    if stream is not None:
        stream.write(ids[0, 1 if len(prompt) == 0 else 0:].cpu())  # the prompt, without the EOS that stands in for ''
    out = model.generate(ids.expand(args.num_samples, -1), args.max_new_tokens, temperature=args.temperature,
                         top_k=args.top_k or None, top_p=args.top_p, generator=g,
                         on_token=None if stream is None else lambda new: stream.write(new[0].cpu()))
    texts = [generated_text(tok, row, prompt) for row in out]  # without the EOS that stands in for ''
    if stream is not None:
        stream.write([], final=True)
        print()
    for i, text in enumerate(texts if stream is None else []):
        print(f"--- sample {i + 1} of {len(texts)} ---\n{text}")
    print(json.dumps({"text": texts[0], "texts": texts, "new_tokens": out.size(1) - ids.size(1),
                      "global_step": ckpt.get("global_step")}))

if __name__ == "__main__":
    main()
