"""How fast `quantize` samples its calibration text from the model, against the way it did before.

    python bench/calibration.py                       # the default model, 16 steps of each
    python bench/calibration.py --steps 126 --json    # the whole default: 128 x 128 tokens

Both rows run `quantize/calibration.sample_sequences` on the same bf16 model loaded once, with the
default 128 sequences; tok/s = tokens sampled / wall time (the model load is not counted):

- flotilla: all 128 sequences in one batch, each step's token drawn from the top 256 (topk) then
  the top-p nucleus (what `quantize` does);
- before (the peer): batches of 32 sequences, the nucleus found by sorting the whole vocabulary
  every step (what `quantize` did up to this change).

`--steps` decoding steps per batch (the default run takes 126); the rows' ratio is the speed-up of
the calibration part of a default GPTQ run. The last row times `--steps` for 1 / 2 threads when
`--threads` lists them (a loaded machine hurts two threads far more than one).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from flotilla.models.sources import open_source  # noqa: E402
from flotilla.models.weights import load_stage  # noqa: E402
from flotilla.quantize.calibration import TOP_P, sample_sequences  # noqa: E402
from flotilla.runtime.default_model import default_model_path  # noqa: E402


def sort_top_p(logits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The earlier sampler: sort the whole vocabulary, keep the nucleus, draw."""
    probs = torch.softmax(logits, dim=-1)
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p > TOP_P, 0.0)
    return idx.gather(-1, torch.multinomial(sorted_p, 1, generator=gen)).squeeze(-1)


METHODS = {  # name: (sequences per batch, sampler)
    "flotilla: one batch of 128, topk 256 + top-p": (128, None),
    "before: batches of 32, full sort + top-p": (32, sort_top_p),
}


def run(model, batch: int, sampler, samples: int, steps: int) -> float:
    """tok/s of `steps` decoding steps over `samples` sequences, `batch` at a time."""
    start = time.perf_counter()
    tokens = sample_sequences(model, samples, 2 + steps, seed=0, batch=batch, sample=sampler)
    seconds = time.perf_counter() - start
    return tokens.shape[0] * steps / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model path (default: the embedded SmolLM2-135M)")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", default="", help="e.g. 1,2: also time the flotilla row at these thread counts")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    path = Path(args.model) if args.model else default_model_path()
    model = load_stage(open_source(path), device=torch.device("cpu"), dtype=torch.bfloat16)
    total = args.samples * 126  # a default run: 128 x (128 - BOS - the random first token)
    rows = []
    for name, (batch, sampler) in METHODS.items():
        rate = run(model, batch, sampler, args.samples, args.steps)
        rows.append({"method": name, "threads": torch.get_num_threads(), "tok_s": round(rate, 1),
                     "default_run_s": round(total / rate, 1)})
    for threads in [int(t) for t in args.threads.split(",") if t]:
        torch.set_num_threads(threads)
        rate = run(model, 128, None, args.samples, args.steps)
        rows.append({"method": "flotilla", "threads": threads, "tok_s": round(rate, 1),
                     "default_run_s": round(total / rate, 1)})
    peer = rows[1]["tok_s"]
    if args.json:
        for r in rows:
            print(json.dumps({**r, "vs_before": round(r["tok_s"] / peer, 2)}))
        return
    print(f"calibration sampling, {path.name}, {args.samples} sequences, {args.steps} steps")
    print("| method | threads | tok/s | 128x128 default, s | vs before |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['threads']} | {r['tok_s']} | {r['default_run_s']} | {r['tok_s'] / peer:.2f}x |")


if __name__ == "__main__":
    main()
