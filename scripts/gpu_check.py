#!/usr/bin/env python3
"""The numeric half of scripts/gpu-check: comparisons of `sluice model probe` outputs, and the
PyTorch/transformers reference measurements on the same checkpoint and GPU.

Subcommands (each prints `key=value` words on one line, or JSON for `torch-logits`):
  compare REF.json OTHER.json --logits-tol X [--grads-tol Y]
      relative logits error  max|a-b| / max|a|  of the prefill path (`logits_rel`) and of the
      decode path (`decode_rel`, worst row, when both files have `decode_logits`), and the worst
      relative gradient-norm error over the parameters; exit 1 when a tolerance is exceeded.
  torch-logits MODEL --tokens 1,2,3 [--dtype f32|bf16]
      last-position logits of transformers' model, by one forward (`logits`) and by the decode
      path over its KV cache (`decode_logits`), as `sluice model probe` prints them.
  torch-generate MODEL --batch 64 --prompt-tokens 16 --max-new-tokens 128 [--dtype bf16]
      decode tokens/s of `generate` (greedy, no early stop) at that batch.
  torch-train MODEL --rows 8 --len 512 [--steps 5] [--autocast]
      training tokens/s of eager PyTorch: f32 weights, forward + backward + AdamW step, the
      shapes `sluice bench trainer --shape ROWSxLEN` uses; with --autocast the forward runs
      under bf16 autocast (PyTorch's mixed precision, what `trainer.compute_dtype = "bf16"`
      matches).
  accuracy METRICS.jsonl
      the last `eval_accuracy` a run logged, and every one by step (`eval_curve=step:acc,...`).
  kernel-profile NCU.csv --ours KERNELS.cu... [--wall-seconds S]
      the device time of every kernel Nsight Compute timed (`ncu --csv --metrics
      gpu__time_duration.sum`), by name (the heaviest, with counts) and by origin: cuBLAS's
      products, Sluice's own kernels (the `extern "C" __global__` names of the given sources),
      and the rest (candle's); with the profiled steps' wall time, the share the device was
      busy.

Only `compare`, `accuracy` and `kernel-profile` run without PyTorch.
"""

import argparse
import csv
import json
import math
import re
import sys
import time


def load(path):
    with open(path) as f:
        return json.load(f)


def rel_error(a, b):
    scale = max(abs(x) for x in a) or 1.0
    return max(abs(x - y) for x, y in zip(a, b)) / scale


def cmd_compare(args):
    ref, other = load(args.ref), load(args.other)
    if len(ref["logits"]) != len(other["logits"]):
        print(f"logits_rel=nan (lengths {len(ref['logits'])} vs {len(other['logits'])})")
        return 1
    logits = rel_error(ref["logits"], other["logits"])
    words = [f"logits_rel={logits:.3g}"]
    ok = logits <= args.logits_tol
    if "decode_logits" in ref and "decode_logits" in other:
        rows = list(zip(ref["decode_logits"], other["decode_logits"]))
        if len(rows) != len(ref["decode_logits"]) or any(len(a) != len(b) for a, b in rows):
            decode = math.inf
        else:
            decode = max(rel_error(a, b) for a, b in rows)
        words.append(f"decode_rel={decode:.3g}")
        ok = ok and decode <= args.logits_tol
    if args.grads_tol is not None:
        worst, name = 0.0, None
        for key, g in ref["grad_norms"].items():
            h = other["grad_norms"].get(key)
            if h is None:
                worst, name = math.inf, key
                break
            err = abs(g - h) / max(abs(g), 1e-12)
            if err > worst:
                worst, name = err, key
        words.append(f"grads_rel={worst:.3g}")
        words.append(f"grads_worst={name}")
        ok = ok and worst <= args.grads_tol
    words.append(f"ok={int(ok)}")
    print(" ".join(words))
    return 0 if ok else 1


def torch_model(path, dtype):
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    return model.to("cuda")


def cmd_torch_logits(args):
    import torch

    model = torch_model(args.model, args.dtype).eval()
    tokens = [int(t) for t in args.tokens.split(",")]
    # The decode path as `sluice model probe` takes it: the prompt and the prompt reversed in
    # one batch, each prefilled with its first half, then fed the rest a token per step over
    # the KV cache; the last step's logits of each.
    seqs = torch.tensor([tokens, tokens[::-1]], device="cuda")
    half = len(tokens) // 2
    with torch.no_grad():
        out = model(torch.tensor([tokens], device="cuda")).logits[0, -1]
        step = model(seqs[:, :half], use_cache=True)
        for i in range(half, len(tokens)):
            step = model(seqs[:, i:i + 1], past_key_values=step.past_key_values, use_cache=True)
        decode = step.logits[:, -1]
    print(json.dumps({"device": "torch", "dtype": args.dtype, "tokens": tokens,
                      "logits": out.float().cpu().tolist(),
                      "decode_logits": decode.float().cpu().tolist()}))
    return 0


def cmd_torch_generate(args):
    import torch

    model = torch_model(args.model, args.dtype).eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, vocab, (args.batch, args.prompt_tokens), generator=g).to("cuda")
    kwargs = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens,
                  do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    with torch.no_grad():
        model.generate(prompt, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(prompt, **kwargs)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    generated = (out.shape[1] - args.prompt_tokens) * args.batch
    print(f"torch_decode_tok_s={generated / seconds:.1f} batch={args.batch} seconds={seconds:.3f}")
    return 0


def cmd_torch_train(args):
    import contextlib
    import torch

    model = torch_model(args.model, "f32").train()
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if args.autocast
                else contextlib.nullcontext())
    vocab = model.config.vocab_size
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (args.rows, args.len), generator=g).to("cuda")

    def step():
        with autocast:
            logits = model(ids).logits[:, :-1].float()
        logp = torch.log_softmax(logits, dim=-1)
        target = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        loss = -target.mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = args.rows * args.len * args.steps
    params = sum(p.numel() for p in model.parameters())
    print(f"torch_train_tok_s={tokens / seconds:.1f} params={params} seconds={seconds:.3f}")
    return 0


def cmd_accuracy(args):
    last = None
    curve = []
    with open(args.metrics) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if "eval_accuracy" in row:
                last = row["eval_accuracy"]
                curve.append(f"{row.get('step', '?')}:{last:.3f}")
    print(f"eval_accuracy={'nan' if last is None else f'{last:.3f}'} eval_curve={','.join(curve) or 'none'}")
    return 0 if last is not None else 1


# cuBLAS's (and cuBLASLt's) product kernels, by their names' marks.
GEMM = re.compile(r"gemm|nvjet|cutlass|xmma|cublas|splitK", re.IGNORECASE)


def cmd_kernel_profile(args):
    # A macro's kernel names (`attn_fwd_##S##_##D`) as patterns: its parameters (capitals) stand
    # for any word. A kernel may carry launch bounds before its name.
    ours = []
    declared = re.compile(
        r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^;{]*?\)\s+)?([\w#]+)\s*\(')
    for path in args.ours:
        with open(path) as f:
            for name in declared.findall(f.read()):
                parts = name.split("##")
                ours.append(re.compile(parts[0] + "".join(
                    "[A-Za-z0-9]+" if re.fullmatch(r"[A-Z][A-Z0-9]*", p) else re.escape(p)
                    for p in parts[1:])))
    by_name = {}
    with open(args.csv, newline="") as f:
        # ncu prints its own lines (`==PROF==`) and the program's around the table.
        rows = [line for line in f if line.startswith('"')]
    for row in csv.DictReader(rows):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = row["Kernel Name"]
        unit = row.get("Metric Unit", "nsecond")
        scale = {"nsecond": 1e-9, "ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3,
                 "ms": 1e-3, "second": 1.0, "s": 1.0}.get(unit)
        if scale is None:
            print(f"kernel-profile: unknown time unit {unit!r} for {name}", file=sys.stderr)
            return 1
        seconds = float(row["Metric Value"].replace(",", "")) * scale
        count, total = by_name.get(name, (0, 0.0))
        by_name[name] = (count + 1, total + seconds)
    if not by_name:
        print("kernel-profile: no gpu__time_duration.sum rows", file=sys.stderr)
        return 1

    # A kernel's bare name: a demangled C++ one without its return type, template and arguments.
    def bare(name):
        return name.split("(")[0].split("<")[0].split()[-1]

    def origin(name):
        if any(p.fullmatch(bare(name)) for p in ours):
            return "sluice"
        return "cublas" if GEMM.search(name) else "candle"

    origins = {name: origin(name) for name in by_name}
    total = sum(t for _, t in by_name.values())
    launches = sum(c for c, _ in by_name.values())
    groups = {"cublas": [0, 0.0], "sluice": [0, 0.0], "candle": [0, 0.0]}
    for name, (count, seconds) in by_name.items():
        groups[origins[name]][0] += count
        groups[origins[name]][1] += seconds
    heavy = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    for name, (count, seconds) in heavy[: args.top]:
        print(f"{100 * seconds / total:6.2f}%  {seconds * 1e3:10.2f} ms  {count:7d} x  "
              f"{seconds / count * 1e6:9.1f} us  [{origins[name]}]  {name[:100]}")
    words = [f"profile_launches={launches}", f"profile_device_ms={total * 1e3:.1f}"]
    for key, (count, seconds) in groups.items():
        words += [f"profile_{key}_pct={100 * seconds / total:.1f}", f"profile_{key}_launches={count}"]
    if args.wall_seconds:
        words.append(f"profile_busy_pct={100 * total / args.wall_seconds:.1f}")
    # The heaviest few as name:share, for the one-line result.
    short = lambda n: re.sub(r"[^A-Za-z0-9_]", "", bare(n))[:40]
    words.append("profile_top=" + ",".join(
        f"{short(n)}:{100 * t / total:.1f}" for n, (_, t) in heavy[:5]))
    print(" ".join(words))
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compare")
    c.add_argument("ref")
    c.add_argument("other")
    c.add_argument("--logits-tol", type=float, required=True)
    c.add_argument("--grads-tol", type=float)
    c.set_defaults(run=cmd_compare)
    c = sub.add_parser("torch-logits")
    c.add_argument("model")
    c.add_argument("--tokens", required=True)
    c.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    c.set_defaults(run=cmd_torch_logits)
    c = sub.add_parser("torch-generate")
    c.add_argument("model")
    c.add_argument("--batch", type=int, default=64)
    c.add_argument("--prompt-tokens", type=int, default=16)
    c.add_argument("--max-new-tokens", type=int, default=128)
    c.add_argument("--dtype", default="bf16", choices=["f32", "bf16"])
    c.set_defaults(run=cmd_torch_generate)
    c = sub.add_parser("torch-train")
    c.add_argument("model")
    c.add_argument("--rows", type=int, default=8)
    c.add_argument("--len", type=int, default=512)
    c.add_argument("--steps", type=int, default=5)
    c.add_argument("--autocast", action="store_true", help="bf16 autocast over f32 weights")
    c.set_defaults(run=cmd_torch_train)
    c = sub.add_parser("accuracy")
    c.add_argument("metrics")
    c.set_defaults(run=cmd_accuracy)
    c = sub.add_parser("kernel-profile")
    c.add_argument("csv")
    c.add_argument("--ours", nargs="+", required=True, help="CUDA sources of Sluice's kernels")
    c.add_argument("--wall-seconds", type=float, help="the profiled work's time without ncu")
    c.add_argument("--top", type=int, default=15)
    c.set_defaults(run=cmd_kernel_profile)
    args = p.parse_args()
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
