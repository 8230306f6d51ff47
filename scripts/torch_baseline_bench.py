#!/usr/bin/env python3
"""Ours against PyTorch on the same work: GPT-2 124M (Hugging Face's default GPT2Config()), fp32,
AdamW, one thread per process, every batch exactly B x T tokens.

  single: one process, batch 4 x 64. Ours: build/step_breakdown (GPT2TrainStep: forward, SPEC §3's
          loss, backward, fused AdamW). PyTorch: transformers' GPT2LMHeadModel in eager mode
          (attn_implementation="eager" and "sdpa"), torch.optim.AdamW with its defaults.
  data parallel: two processes, global batch 8 x 64. Ours: build/run_data_parallel --world_size 2
          on a corpus whose every example fills the 64 tokens. PyTorch: DistributedDataParallel
          (Gloo) around the same Hugging Face model, torch.optim.AdamW.

Each figure is the mean tokens/s of the timed steps after warm-up; the ratios come from one run of
this script (this machine is shared and noisy). On CPUs a "device" is a share of the cores.

    .venv/bin/python scripts/torch_baseline_bench.py --out torch_baseline.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time

from bench_common import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hf_steps(batch: int, length: int, steps: int, warmup: int, attn: str, rank: int = 0, world: int = 1,
             port: int = 0) -> float:
    """tokens/s of Hugging Face GPT-2 124M trained by torch.optim.AdamW (DDP when world > 1)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config()
    config._attn_implementation = attn
    model = GPT2LMHeadModel(config).train()
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    per_rank = batch // world
    ids = torch.randint(0, 50257, (per_rank, length))
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        loss.item()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    if world > 1:
        torch.distributed.destroy_process_group()
    return per_rank * length / (sum(times) / len(times))


def hf_worker(args: argparse.Namespace) -> None:
    rate = hf_steps(args.batch, args.length, args.steps, args.warmup, args.attn, args.rank, args.world, args.port)
    print(json.dumps({"rank": args.rank, "tokens_per_second": rate}))


# glibc settings equal to what keep_freed_host_memory() does in our programs (host_memory.h).
KEEP_FREED = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "2147483647"}


def ddp(batch: int, length: int, steps: int, warmup: int, attn: str, world: int = 2, env: dict = None) -> float:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--rank", str(r), "--world", str(world),
                               "--port", str(port), "--batch", str(batch), "--length", str(length),
                               "--steps", str(steps), "--warmup", str(warmup), "--attn", attn],
                              stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
             for r in range(world)]
    rates = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"DDP worker exited {p.returncode}")
        rates.append(json.loads(out.strip().splitlines()[-1])["tokens_per_second"])
    return sum(rates)  # every rank's tokens per second of the same wall time


def ours_single(build: str, batch: int, length: int, steps: int, warmup: int) -> float:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([os.path.join(build, "step_breakdown"), "--model", "gpt2", "--batch_size", str(batch),
                        "--model_max_length", str(length), "--steps", str(steps), "--warmup", str(warmup),
                        "--threads", "1", "--out", out.name], check=True, stdout=subprocess.DEVNULL)
        return json.load(open(out.name))["tokens_per_second"]


def long_corpus(folder: str, rows: int) -> None:
    """A short source and a target of 80 words: every example fills --model_max_length 64, with
    target tokens to learn from (the loss weights only the target)."""
    rng = random.Random(0)
    words = [f"w{i}" for i in range(300)]
    for split, n in (("train", rows), ("validation", 8), ("test", 2)):
        with open(os.path.join(folder, f"{split}.jsonl"), "w") as f:
            for _ in range(n):
                de = " ".join(rng.choice(words) for _ in range(4))
                en = " ".join(rng.choice(words) for _ in range(80))
                f.write(json.dumps({"de": de, "en": en}) + "\n")


def ours_data_parallel(build: str, batch: int, length: int, steps: int, warmup: int) -> float:
    with tempfile.TemporaryDirectory(prefix="harness-baseline-") as tmp:
        corpus = os.path.join(tmp, "corpus")
        os.makedirs(corpus)
        long_corpus(corpus, batch * (steps + warmup))
        run = subprocess.run([os.path.join(build, "run_data_parallel"), "--world_size", "2", "--model", "gpt2",
                              "--dataset", corpus, "--batch_size", str(batch), "--model_max_length", str(length),
                              "--n_epochs", "1", "--max_batches", str(steps + warmup), "--threads_per_device", "1",
                              "--benchmark_only", "--no_progress", "--workdir", os.path.join(tmp, "work"),
                              "--trace", os.path.join(tmp, "trace.json")],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if run.returncode != 0:
            raise SystemExit(run.stdout[-3000:])
        rates = []
        for rank in (0, 1):
            events = json.load(open(os.path.join(tmp, f"trace.rank{rank}.json")))
            events = events["traceEvents"] if isinstance(events, dict) else events
            steps_us = [e["dur"] for e in events if e.get("name", "").startswith("step") and e.get("ph") == "X"]
            if len(steps_us) < steps + warmup:
                raise SystemExit(f"trace of rank {rank} has {len(steps_us)} step events: {sorted({e.get('name') for e in events})}")
            timed = steps_us[warmup:]
            rates.append((batch // 2) * length / (sum(timed) / len(timed) / 1e6))
        return sum(rates)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="")
    p.add_argument("--skip-data-parallel", action="store_true")
    # worker mode (DDP ranks)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, default=64, help=argparse.SUPPRESS)
    p.add_argument("--attn", default="eager", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        hf_worker(args)
        return 0
    r = {"note": "tokens/s, GPT-2 124M fp32, AdamW, 1 thread per process; on CPUs a device is a share of the cores",
         "steps": args.steps, "warmup": args.warmup}
    r["single"] = {"shape": "4 x 64", "ours_program": "build/step_breakdown",
                   "ours": ours_single(args.build_dir, 4, 64, args.steps, args.warmup),
                   "hf_eager": hf_steps(4, 64, args.steps, args.warmup, "eager"),
                   "hf_sdpa": hf_steps(4, 64, args.steps, args.warmup, "sdpa"),
                   # The same process started with our glibc settings: how much of the lead is them.
                   "hf_eager_keep_freed_memory": ddp(4, 64, args.steps, args.warmup, "eager", world=1, env=KEEP_FREED)}
    r["single"]["ours_over_hf_eager"] = r["single"]["ours"] / r["single"]["hf_eager"]
    r["single"]["ours_over_hf_sdpa"] = r["single"]["ours"] / r["single"]["hf_sdpa"]
    print(json.dumps(r["single"]), flush=True)
    if not args.skip_data_parallel:
        # Ours is timed from each rank's "step" events in the program's trace, after warm-up.
        r["data_parallel"] = {"shape": "global 8 x 64 over 2 ranks",
                              "ours": ours_data_parallel(args.build_dir, 8, 64, args.steps, args.warmup),
                              "ddp_hf_eager": ddp(8, 64, args.steps, args.warmup, "eager"),
                              "ddp_hf_eager_keep_freed_memory": ddp(8, 64, args.steps, args.warmup, "eager",
                                                                    env=KEEP_FREED)}
        r["data_parallel"]["ours_over_ddp"] = r["data_parallel"]["ours"] / r["data_parallel"]["ddp_hf_eager"]
        print(json.dumps(r["data_parallel"]), flush=True)
    text = json.dumps(r, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
