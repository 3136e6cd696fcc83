"""What ColMHA's re-parametrisation of a trained model costs: a stock GPT-2 trained on bytes, converted to
`cross_head_variant="colmha"` at several shared key widths `D~`, with no further training.

Per width: the relative error of the heads' score forms that the CP decomposition leaves (`colmha.reparametrize`, mean
and largest over the layers), and the validation bits per byte of the converted model against the trained MHA's
(the same blocks). At `D~ = D` (all heads' width) the conversion is exact.

    python experiments/colmha_reparametrization.py                    # 4 layers, width 64, 1,500 steps
    python experiments/colmha_reparametrization.py --steps 300        # a quick look
    python experiments/colmha_reparametrization.py --json out.json
"""

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from damcha_hf.argument_checks import ArgumentParser, positive_int  # noqa: E402
from damcha_hf.safe_files.atomic_files import write_json  # noqa: E402
from experiments.common import format_table, gpt2_config_kwargs, set_up_device  # noqa: E402

CONTEXT = 128


def parse_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=positive_int, default=4)
    parser.add_argument("--width", type=positive_int, default=64)
    parser.add_argument("--heads", type=positive_int, default=8)
    parser.add_argument("--steps", type=positive_int, default=1500, help="training steps of the MHA model")
    parser.add_argument("--batch-size", type=positive_int, default=16)
    parser.add_argument("--eval-blocks", type=positive_int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=positive_int, default=2, help="CPU threads")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.width % args.heads:
        parser.error(f"--heads {args.heads} must divide --width {args.width}")
    return args


def stdlib_bytes(limit: int) -> bytes:
    """The Python installation's own standard library sources, concatenated (a corpus every machine has)."""
    from damcha_hf.data import stdlib_corpus_files

    chunks, size = [], 0
    for path in stdlib_corpus_files():
        with open(path, "rb") as file:
            chunks.append(file.read())
        size += len(chunks[-1])
        if size >= limit:
            break
    return b"".join(chunks)[:limit]


def bits_per_byte(model, blocks) -> float:
    import torch

    with torch.no_grad():
        losses = [float(model(input_ids=batch, labels=batch).loss) for batch in blocks.split(32)]
    return sum(losses) / len(losses) / math.log(2)


def main(argv=None) -> dict:
    args = parse_args(argv)
    _, machine = set_up_device("cpu", args.threads)
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import damcha_hf

    torch.manual_seed(args.seed)
    data = torch.frombuffer(bytearray(stdlib_bytes(8_000_000)), dtype=torch.uint8).long()
    split = int(len(data) * 0.9)
    train, validation = data[:split], data[split:]
    starts = torch.arange(0, len(validation) - CONTEXT, CONTEXT)[: args.eval_blocks]
    eval_blocks = torch.stack([validation[s : s + CONTEXT] for s in starts])

    config = GPT2Config(**gpt2_config_kwargs(args.layers, args.width, args.heads, CONTEXT, vocab=256))
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=args.steps, pct_start=0.1)
    generator = torch.Generator().manual_seed(args.seed)
    model.train()
    for step in range(1, args.steps + 1):
        offsets = torch.randint(0, len(train) - CONTEXT, (args.batch_size,), generator=generator)
        batch = torch.stack([train[o : o + CONTEXT] for o in offsets])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % max(1, args.steps // 10) == 0:
            print(f"step {step}/{args.steps}: train loss {float(loss):.4f}", flush=True)
    model.eval()
    reference = bits_per_byte(model, eval_blocks)

    rows, records = [], []
    for key_dim in (args.width, args.width * 3 // 4, args.width // 2, args.width // 4, args.width // 8):
        if key_dim < 1:
            continue
        converted = damcha_hf.convert_to_damcha(model, cross_head_variant="colmha", colmha_key_dim=key_dim).eval()
        errors = [block.attn.colmha_reparametrization_error for block in converted.transformer.h]
        score = bits_per_byte(converted, eval_blocks)
        records.append({"colmha_key_dim": key_dim, "layer_errors": errors, "validation_bpb": score})
        rows.append([key_dim, f"{sum(errors) / len(errors):.4f}", f"{max(errors):.4f}", f"{score:.4f}",
                     f"{score - reference:+.4f}"])  # fmt: skip
    print(f"\ntrained MHA: validation {reference:.4f} bits per byte ({len(eval_blocks)} blocks of {CONTEXT} bytes)")
    print(format_table(["D~", "mean error", "largest error", "validation bpb", "vs MHA"], rows))
    print(f"machine: {machine}")
    report = {"arguments": vars(args), "machine": machine, "mha_validation_bpb": reference, "conversions": records}
    if args.json:
        write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
