#!/usr/bin/env python3
"""Checks the gradient files of `run_data_parallel --pytest`: DIR/model0_gradients.pth and
DIR/model1_gradients.pth must load with torch.load's default arguments as dicts of tensors with the
same keys, and every tensor must be bit-identical (torch.equal) between the two ranks.

Usage: check_gradients.py [DIR]   (DIR defaults to tests). Exit status 0 when they match."""
import os
import sys


def load(path):
    if not os.path.isfile(path):
        raise SystemExit(f"{path}: no such file (run run_data_parallel --pytest --grad_dir DIR first)")
    import torch  # here, so that a missing file is reported without the seconds torch takes to load

    grads = torch.load(path)  # default arguments on purpose: weights_only=True since PyTorch 2.6
    if not isinstance(grads, dict):
        raise SystemExit(f"{path}: expected a dict of tensors, got {type(grads).__name__}")
    for name, value in grads.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise SystemExit(f"{path}: entry {name!r} is a {type(value).__name__}, not a tensor")
    return grads


def main(argv):
    directory = argv[1] if len(argv) > 1 else "tests"
    paths = [os.path.join(directory, f"model{rank}_gradients.pth") for rank in (0, 1)]
    g0, g1 = (load(p) for p in paths)
    import torch
    problems = []
    if set(g0) != set(g1):
        only0 = sorted(set(g0) - set(g1))
        only1 = sorted(set(g1) - set(g0))
        problems.append(f"keys differ: only in rank 0: {only0[:5]}, only in rank 1: {only1[:5]}")
    if not g0:
        problems.append("no gradients in the files")
    n_elements = 0
    for name in sorted(set(g0) & set(g1)):
        a, b = g0[name], g1[name]
        n_elements += a.numel()
        if a.shape != b.shape or a.dtype != b.dtype:
            problems.append(f"{name}: rank 0 has {a.dtype} {list(a.shape)}, rank 1 {b.dtype} {list(b.shape)}")
        elif not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item()
            problems.append(f"{name}: tensors differ (max abs difference {diff:g})")
    if problems:
        print(f"gradient check FAILED for {directory}:")
        for p in problems:
            print("  " + p)
        return 1
    print(f"gradient check passed: {len(g0)} tensors, {n_elements} elements, "
          f"bit-identical between rank 0 and rank 1 ({directory})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
