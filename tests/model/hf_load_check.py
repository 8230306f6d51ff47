"""Loads a model directory written by our save_pretrained with transformers and compares its logits
with the ones our C++ model computed (DIR/../expected.safetensors: input_ids, logits).
Exit 0 when they agree, 1 with the numbers otherwise."""
import os
import sys

import torch
from safetensors.torch import load_file
from transformers import GPT2LMHeadModel


def main() -> int:
    model_dir = sys.argv[1]
    expected = load_file(os.path.join(os.path.dirname(model_dir.rstrip("/")), "expected.safetensors"))
    model = GPT2LMHeadModel.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(expected["input_ids"].long()).logits
    err = (logits - expected["logits"]).abs().max().item()
    scale = expected["logits"].abs().max().item()
    tied = model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    print(f"hf_load_check: max|diff| {err:.3g}, max|logit| {scale:.3g}, tied head {tied}")
    return 0 if tied and err <= 1e-5 * scale + 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
