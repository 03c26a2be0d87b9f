"""Compares the tokenizer `sluice model import` built from a GGUF file with transformers' own
GGUF conversion of the same file (a manual check; no Rust test runs it).

Usage: python3 gguf_tokenizer_check.py FILE.gguf IMPORTED_DIR

Needs `transformers` (4.x: 5 wants torch even for tokenizers), `gguf` and `tokenizers`;
torch is not needed (the check that asks for it is bypassed: only metadata is read). Encodes
a corpus with digits, whitespace runs, CJK, emoji, accents and special tokens through both,
without special tokens (transformers' conversion prepends BOS even when the file says
`add_bos_token = false`; llama.cpp and Sluice follow the file), checks that Sluice's ids
decode back to the text, prints one line per mismatch and exits 1 if any, "ok N" otherwise.
"""

import os
import sys

import transformers.modeling_gguf_pytorch_utils as gguf_utils
from tokenizers import Tokenizer
from transformers import AutoTokenizer

gguf_utils.is_torch_available = lambda: True

CORPUS = [
    "The capital of France is",
    "Numbers 1234567 and 3.14159, 2024-11-28",
    "  leading and   multiple   spaces\n\n\ttabs\r\nwin",
    "日本語のテキスト 中文 한국어",
    "emoji 😀👍🏽 family 👨‍👩‍👧",
    "accents: café naïve résumé Ünïcödé",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "don't won't I'm you're they've we'll he'd",
    "code: def f(x):\n    return x**2  # comment",
    "trailing space ",
    " leading",
]


def main():
    gguf_path, imported = sys.argv[1], sys.argv[2]
    hf = AutoTokenizer.from_pretrained(
        os.path.dirname(os.path.abspath(gguf_path)), gguf_file=os.path.basename(gguf_path)
    )
    ours = Tokenizer.from_file(os.path.join(imported, "tokenizer.json"))
    failures = []
    for text in CORPUS:
        want = hf(text, add_special_tokens=False)["input_ids"]
        got = ours.encode(text, add_special_tokens=False).ids
        if got != want:
            failures.append(f"{text!r}: transformers {want}, sluice {got}")
        back = ours.decode(got, skip_special_tokens=False)
        if back != text:
            failures.append(f"{text!r}: decodes to {back!r}")
    for line in failures:
        print(line)
    if failures:
        sys.exit(1)
    print(f"ok {len(CORPUS)}")


if __name__ == "__main__":
    main()
