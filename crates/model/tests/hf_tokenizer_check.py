"""Checks that transformers loads a Sluice model directory's tokenizer with exactly our ids.

Usage: python3 hf_tokenizer_check.py MODEL_DIR CASES_JSON

CASES_JSON is a list of {"messages": [...], "text": "<rendered prompt>", "ids": [...]}, written
by crates/model/tests/hf_tokenizer.rs from Sluice's own tokenizer and chat template. For each
case, `AutoTokenizer.from_pretrained(MODEL_DIR)` must encode `text` to `ids`, and its
`apply_chat_template(messages, add_generation_prompt=True)` must render `text` and give `ids`.
Prints one line per mismatch and exits 1 if any; exits 0 with "ok N" otherwise.
"""

import json
import sys

from transformers import AutoTokenizer


def ids_of(encoded):
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True), 4 a list.
    if hasattr(encoded, "keys"):
        return list(encoded["input_ids"])
    return list(encoded)


def main():
    model_dir, cases_path = sys.argv[1], sys.argv[2]
    with open(cases_path, encoding="utf-8") as f:
        cases = json.load(f)
    tok = AutoTokenizer.from_pretrained(model_dir)
    failures = []
    for i, case in enumerate(cases):
        want = case["ids"]
        got = tok(case["text"], add_special_tokens=False)["input_ids"]
        if got != want:
            failures.append(f"case {i} ({type(tok).__name__}) encode: {len(got)} ids {got} != {len(want)} ids {want}")
        rendered = tok.apply_chat_template(case["messages"], add_generation_prompt=True, tokenize=False)
        if rendered != case["text"]:
            failures.append(f"case {i} template: {rendered!r} != {case['text']!r}")
        chat_ids = ids_of(tok.apply_chat_template(case["messages"], add_generation_prompt=True, tokenize=True))
        if chat_ids != want:
            failures.append(f"case {i} chat ids: {chat_ids} != {want}")
        decoded = tok.decode(want, skip_special_tokens=False)
        if decoded != case["text"]:
            failures.append(f"case {i} decode: {decoded!r} != {case['text']!r}")
    for line in failures:
        print(line)
    if failures:
        sys.exit(1)
    print(f"ok {len(cases)} ({type(tok).__name__})")


if __name__ == "__main__":
    main()
