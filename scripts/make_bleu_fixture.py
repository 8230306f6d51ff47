#!/usr/bin/env python3
"""Writes tests/fixtures/bleu/sacrebleu_cases.json: corpus BLEU scores and statistics that
sacrebleu's default corpus_bleu computes for a fixed, varied set of corpora, plus its 13a
tokenisation of tricky lines. tests/train/bleu_test.cpp compares the C++ implementation to them.

Run: .venv/bin/python scripts/make_bleu_fixture.py
"""
import json
import pathlib

import sacrebleu
from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "bleu" / "sacrebleu_cases.json"

CORPORA = {
    "identical": (
        ["the dog sees the ball .", "on monday the small cat reads a book in the park ."],
        ["the dog sees the ball .", "on monday the small cat reads a book in the park ."],
    ),
    "empty_hypothesis": (
        ["", "the man buys two red apples ."],
        ["the woman buys a red apple .", "the man buys two red apples ."],
    ),
    "all_empty_hypotheses": (["", ""], ["a b c d", "e f g"]),
    "no_match": (["x y z w"], ["a b c d"]),
    "short_hypotheses": (
        ["the", "a cat", "dogs run"],
        ["the dog runs fast .", "a cat sleeps on the mat .", "dogs run in the park ."],
    ),
    "unigrams_only": (["the cat dog"], ["the dog cat"]),
    "longer_than_reference": (
        ["the the the the the the the the cat is on the mat and the dog too"],
        ["the cat is on the mat"],
    ),
    "punctuation": (
        ["Hello, world! (This is) a test; isn't it? \"Quoted\" text...",
         "Well -- well: yes/no [maybe] {or} <not> @home #tag $5 & 100% ~ ^ _ ` |"],
        ["Hello world! (This is) the test; is it? \"Quoted\" text.",
         "Well - well: yes / no [maybe] {or} <not> @home #tag $5 &amp; 100% ~ ^ _ ` |"],
    ),
    "numbers": (
        ["It costs 3.50 dollars, or 1,000 cents.", "From 1990-2000 there were 5.5 million.",
         "Call 555-1234 at 8.30 or 9,15."],
        ["It costs 3.50 dollars, or 1,000 cents.", "From 1990 - 2000 there were 5.5 millions.",
         "Call 555-1234 at 8:30 or 9.15."],
    ),
    "apostrophes_and_hyphens": (
        ["it's the children's well-known toy - don't touch", "rock'n'roll isn't dead -- it's e-mail"],
        ["it 's the childrens' well-known toy -- do n't touch", "rock 'n' roll is not dead - it is email"],
    ),
    "html_entities_and_markup": (
        ["a &quot;quoted&quot; &lt;tag&gt; &amp; more <skipped> text"],
        ["a \"quoted\" <tag> & more text"],
    ),
    "unicode": (
        ["die größte straße in münchen ist schön .", "naïve café — “quotes” and ‘single’ … 東京 に 行く",
         "über\u00a0alles\u3000und\u2009mehr"],
        ["die grösste strasse in münchen ist schön .", "naive café - \"quotes\" and 'single' ... 東京 に 行きます",
         "über alles und mehr"],
    ),
    "whitespace": (
        ["  the   dog \t sees\nthe ball  ", "trailing spaces   "],
        ["the dog sees the ball", "trailing spaces"],
    ),
    "iwslt_style": (
        ["and i said , well , that 's not what we wanted .", "thank you very much .",
         "we have 20 years of data , and it 's clear .", "so what 's happening here ?"],
        ["and i said , well , that 's not what we want .", "thank you so much .",
         "we have 20 years of data , and it 's very clear .", "so what is happening here ?"],
    ),
    "synthetic_translations": (
        ["the small dog sees the red ball in the park .", "on monday two women buy a new car .",
         "the teacher wants to read the newspaper at home .", "the children called the man at eight o'clock .",
         "a bird finds three green apples ."],
        ["the small dog sees the red ball in the park .", "on monday two women buy an old car .",
         "the teacher must read the newspaper at home .", "the children called the man at nine o'clock .",
         "a bird finds three green apples in the garden ."],
    ),
}

TOKENIZE_LINES = [
    "Hello, world!",
    "3.14 and 1,000 and a.b and x,y",
    "1990-2000 vs. e-mail",
    "it's a \"test\" (really) [yes] {no} <tag> & so on.",
    "a..b,,c",
    "trailing -\nhyphen and\nnewline",
    "&quot;x&quot; &amp; &lt;y&gt;",
    "über straße , café .",
    "mixed\u00a0space\u2003here",
    "end.",
    "9.",
    ".5",
]


def main():
    corpora = []
    for name, (hyps, refs) in CORPORA.items():
        result = sacrebleu.corpus_bleu(hyps, [refs])
        corpora.append({
            "name": name,
            "hypotheses": hyps,
            "references": refs,
            "score": result.score,
            "sys_len": result.sys_len,
            "ref_len": result.ref_len,
            "counts": list(result.counts),
            "totals": list(result.totals),
        })
    tokenizer = Tokenizer13a()
    tokenized = [{"input": line, "output": tokenizer(line)} for line in TOKENIZE_LINES]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump({"sacrebleu_version": sacrebleu.__version__, "corpora": corpora,
                   "tokenize_13a": tokenized}, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {OUT} ({len(corpora)} corpora, {len(tokenized)} tokenizer lines)")


if __name__ == "__main__":
    main()
