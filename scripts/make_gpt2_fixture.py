#!/usr/bin/env python3
"""Writes the Hugging Face parity fixture for the C++ GPT-2 (tests/fixtures/gpt2_tiny/).

A small random GPT2LMHeadModel saved with save_pretrained (config.json + model.safetensors), and
references.safetensors holding a fixed batch (input_ids, labels, label_token_weights, as float32),
the reference logits, the SPEC section 3 loss (weighted cross entropy / sum of weights) and the
gradient of that loss for every parameter ("grad." + Hugging Face name). The references are
computed in float64 and stored as float32, so they are the exact values up to one rounding.

Usage: .venv/bin/python scripts/make_gpt2_fixture.py [OUT_DIR]
"""
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

SEED = 20240611
B, T = 3, 12


def main() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "tests", "fixtures", "gpt2_tiny")
    os.makedirs(out_dir, exist_ok=True)

    torch.manual_seed(SEED)
    config = GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                        embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0,
                        bos_token_id=96, eos_token_id=96)
    model = GPT2LMHeadModel(config)
    # Non-trivial LayerNorm and bias values, so that a transposed or dropped parameter shows up.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.05 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)

    generator = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(0, config.vocab_size, (B, T + 1), generator=generator)
    input_ids, labels = ids[:, :-1], ids[:, 1:]
    weights = (torch.rand(B, T, generator=generator) > 0.3).to(torch.float64)
    weights[:, 0] = 0.0
    weights[2, 7:] = 0.0  # a padded tail

    reference = GPT2LMHeadModel.from_pretrained(out_dir, attn_implementation="eager").double()
    reference.eval()
    logits = reference(input_ids).logits
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, config.vocab_size), labels.reshape(-1),
                                           reduction="none").reshape(B, T)
    loss = (ce * weights).sum() / weights.sum()
    loss.backward()

    tensors = {
        "input_ids": input_ids.float(),
        "labels": labels.float(),
        "label_token_weights": weights.float(),
        "logits": logits.detach().float(),
        "loss": loss.detach().float().reshape(1),
    }
    for name, p in reference.named_parameters():
        tensors["grad." + name] = p.grad.float().contiguous()
    save_file(tensors, os.path.join(out_dir, "references.safetensors"),
              metadata={"generator": "scripts/make_gpt2_fixture.py", "seed": str(SEED)})
    print(f"wrote {out_dir}: loss {loss.item():.8f}, {len(tensors) - 5} gradients")


if __name__ == "__main__":
    main()
