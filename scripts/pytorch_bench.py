"""PyTorch eager on the same model directory, shapes and threads as `sluice bench`: the yardstick
the issue-35 speed targets are written against.

    train     forward + backward + AdamW on [B x L] token ids (causal LM cross-entropy on every
              position), f32, the model loaded by transformers from the HF directory as it is
              (tied embeddings stay tied). Prints `RESULT pytorch train_tok_s=...`: B*L over the
              median step time of `--steps` timed steps after one warm-up step.
    generate  `model.generate` at batch B, greedy, prompts of `--prompt-tokens` ids, exactly
              `--max-tokens` new tokens per row (EOS ignored, as Sluice's bench does), KV cache
              on. Prints `RESULT pytorch generate_tok_s=...`: B*max_tokens over the median wall
              time of `--repeats` calls after one warm-up call (prefill included, as in Sluice's
              `tokens/s`).

How it departs from a training recipe: the batch is synthetic (ids derived from the row and
position, the same every step), there is no data loader, no gradient clipping and no mixed
precision (`--dtype bfloat16` casts the whole model instead, the fair yardstick for Sluice's
`--compute-dtype bf16` engine); the point is the arithmetic of one step at the shapes Sluice
runs.
"""

import argparse
import statistics
import sys
import time


def parse_args(argv):
    p = argparse.ArgumentParser(prog="pytorch-bench", description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["train", "generate"])
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--batch", type=int, default=None, help="rows (train 8, generate 64)")
    p.add_argument("--seq", type=int, default=128, help="train: tokens per row (default 128)")
    p.add_argument("--steps", type=int, default=3, help="train: timed steps (default 3)")
    p.add_argument("--lr", type=float, default=1e-6, help="train: AdamW learning rate")
    p.add_argument("--prompt-tokens", type=int, default=16, help="generate: prompt ids per row")
    p.add_argument("--max-tokens", type=int, default=16, help="generate: new tokens per row")
    p.add_argument("--repeats", type=int, default=2, help="generate: timed calls (default 2)")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the model's weights and compute (default float32; bfloat16 runs oneDNN's bf16 "
        "kernels, AMX where the CPU has it)",
    )
    return p.parse_args(argv)


def load(args):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    return torch, model


def ids(torch, rows, cols, vocab):
    """Token ids that depend only on row and position: every run sees the same batch."""
    r = torch.arange(rows).unsqueeze(1)
    c = torch.arange(cols).unsqueeze(0)
    return ((r * 13 + c * 7) % min(vocab, 90)).long()


def train(args):
    torch, model = load(args)
    model.train()
    batch = args.batch or 8
    x = ids(torch, batch, args.seq, model.config.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=True)
    times = []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if step > 0:
            times.append(dt)
        print(f"step {step}: {dt:.3f} s, loss {out.loss.item():.4f}", file=sys.stderr)
    med = statistics.median(times)
    print(f"pytorch {torch.__version__} train [{batch}x{args.seq}] threads {args.threads}: "
          f"{batch * args.seq / med:.1f} tok/s ({med:.3f} s/step)")
    print(f"RESULT pytorch train_tok_s={batch * args.seq / med:.1f}")


def generate(args):
    torch, model = load(args)
    model.eval()
    batch = args.batch or 64
    x = ids(torch, batch, args.prompt_tokens, model.config.vocab_size)
    mask = torch.ones_like(x)
    times = []
    with torch.inference_mode():
        for call in range(args.repeats + 1):
            t0 = time.perf_counter()
            out = model.generate(
                input_ids=x,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=args.max_tokens,
                min_new_tokens=args.max_tokens,
                pad_token_id=model.config.eos_token_id,
                use_cache=True,
            )
            dt = time.perf_counter() - t0
            new = out.shape[1] - x.shape[1]
            if new != args.max_tokens:
                raise SystemExit(f"pytorch-bench: generate made {new} tokens, not {args.max_tokens}")
            if call > 0:
                times.append(dt)
            print(f"call {call}: {dt:.3f} s", file=sys.stderr)
    med = statistics.median(times)
    rate = batch * args.max_tokens / med
    print(f"pytorch {torch.__version__} generate batch {batch}, prompts {args.prompt_tokens}, "
          f"{args.max_tokens} new tokens, threads {args.threads}: {rate:.1f} tok/s")
    print(f"RESULT pytorch generate_tok_s={rate:.1f}")


def main(argv):
    args = parse_args(argv)
    if args.threads < 1:
        raise SystemExit("pytorch-bench: --threads must be at least 1")
    train(args) if args.mode == "train" else generate(args)


if __name__ == "__main__":
    main(sys.argv[1:])
