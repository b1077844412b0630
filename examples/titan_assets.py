"""What torchtitan's Trainer reads besides its config, made here: a tokenizer and a text dataset (torchtitan's
wheel has neither; its repository's tests/assets has both). Nothing is downloaded.

    python examples/titan_assets.py ASSETS [--documents 64] [--words 127]

ASSETS/tokenizer/  tokenizer.json: a word-level tokenizer (the `tokenizers` library's) of VOCAB words "w0" ..
                   "w{VOCAB-1}", split at spaces, and <bos>, <eos>, <unk>; tokenizer_config.json names its BOS
                   and EOS (torchtitan's HuggingFaceTokenizer reads both): --hf_assets_path ASSETS/tokenizer
ASSETS/data/       data.json, one JSON object a line, {"text": "w12 w7 ..."}: torchtitan's "c4_test" format, read
                   by its HuggingFaceTextDataLoader (the `datasets` library): --dataloader.dataset_path ASSETS/data
Each document is --words words, drawn from a seeded generator as a walk (each word a few steps from the one
before) so that a model has something to learn; with BOS and EOS a document is words + 2 tokens, one row of
torchtitan's packed sequences of --training.seq_len words + 1.
"""

import argparse
import json
import pathlib
import random

VOCAB = 1000
BOS, EOS, UNK = "<bos>", "<eos>", "<unk>"


def write_tokenizer(folder):
    """folder/tokenizer.json and folder/tokenizer_config.json (the module's text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {f"w{i}": i for i in range(VOCAB)} | {BOS: VOCAB, EOS: VOCAB + 1, UNK: VOCAB + 2}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS, "unk_token": UNK}))


def documents(count, words, seed):
    """`count` documents of `words` words each (the module's text), the same for the same seed."""
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        word = rng.randrange(VOCAB)
        text = []
        for _ in range(words):
            word = (word + rng.randrange(-3, 4)) % VOCAB
            text.append(f"w{word}")
        docs.append(" ".join(text))
    return docs


def write_dataset(folder, docs):
    """folder/data.json: the documents, one {"text": ...} a line, in order."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "data.json").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("assets", type=pathlib.Path, help="the folder to make (tokenizer/ and data/ in it)")
    parser.add_argument("--documents", type=int, default=64)
    parser.add_argument("--words", type=int, default=127, help="words a document (seq_len - 1 makes one row each)")
    opts = parser.parse_args()
    write_tokenizer(opts.assets / "tokenizer")
    write_dataset(opts.assets / "data", documents(opts.documents, opts.words, seed=0))
    print(f"{opts.assets}/tokenizer: {VOCAB + 3} tokens; {opts.assets}/data: {opts.documents} documents of "
          f"{opts.words} words")


if __name__ == "__main__":
    main()
