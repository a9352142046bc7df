"""A pipeline stage's own host time per decode step, by part, in one process: where the ~0.55 ms
a token of host work in an overlapped two-stage ring goes (bench/NOTES-gpu-pipeline.md).

    python bench/stage_host.py                       # CPU, batch 1 and 16, llama-3-8b's hidden size
    python bench/stage_host.py --device cuda --json  # on a GPU: pinned staging, host-to-device copies

What runs: the real pieces of a ring of two stages, each step of B overlapped decodes (the head's
StepEncoder makes them, with `prev_rows` and `feed`): frames sealed and opened (msgpack, HMAC) as
the Connection does, stage 0's FeedGate, both stages' sequence mirrors, the decode graphs' static
input fill (DecodeInputs, as wide as --max-model-len), the hidden states' way out of stage 0 and
into stage 1, the last stage's sampler on logits of --vocab columns, its StepResult and Sampled.
The graphs' replays (the GPU's work) are left out: what is timed is what the host does. Each part
is timed by the thread's CPU time (`--clock wall`: the wall clock) over --steps steps, best of
--repeats, in µs per step.

Modes (rows):

    plain      as main ran a step before this branch: everything on the ring's critical path
               (stage 0 applies its mirror and fills its graph's inputs when the ids come), and
               the hidden states through a pinned allocation a tensor a step on a GPU
    prepared   this branch: stage 0 prepares a parked step while it waits (mirror, graph inputs;
               `StageRuntime.prepare`), then only the ids go in (`DecodeInputs.set_tokens`);
               persistent pinned staging (HostStaging), the received hidden states copied straight
               into the graph's static input

`path` sums the parts on the ring's critical path for one token (both stages); parts marked
`(off)` run while the stage waits. On a CPU device the staging parts do nothing but the dtype's
cast; the host-to-device copies and pinned buffers are measured with --device cuda.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import torch  # noqa: E402

from flotilla.runtime.cuda_graphs import BUCKETS, DecodeInputs, bucket_for  # noqa: E402
from flotilla.runtime.model_runner import StepInput  # noqa: E402
from flotilla.runtime.pipeline.activations import HostStaging, pack  # noqa: E402
from flotilla.runtime.pipeline.connection import Connection  # noqa: E402
from flotilla.runtime.pipeline.feed import FeedGate  # noqa: E402
from flotilla.runtime.pipeline.messages import Sampled  # noqa: E402
from flotilla.runtime.pipeline.step_codec import StageSequences, StepEncoder, step_result  # noqa: E402
from flotilla.runtime.pipeline.wire import encode  # noqa: E402
from flotilla.runtime.sampler import Sampler, SamplingBatch  # noqa: E402

BLOCK = 16
# (stage, part, on the critical path in plain mode, in prepared mode)
PARTS = [
    ("0", "open Step frame", False, False),
    ("0", "open Sampled frame", True, True),
    ("0", "gate: fill tokens", True, True),
    ("0", "mirror + step input", True, False),
    ("0", "graph inputs fill", True, False),
    ("0", "token ids to the device", False, True),
    ("0", "hidden states out", True, True),
    ("0", "seal Step frame", True, True),
    ("1", "open Step frame", True, True),
    ("1", "mirror + sampling batch", True, True),
    ("1", "hidden states in", True, True),
    ("1", "graph inputs fill", True, True),
    ("1", "sampler (ids to host)", True, True),
    ("1", "result + record", True, True),
    ("1", "seal Sampled frame", True, True),
    ("1", "seal StepResult frame", False, False),
]


class Parts:
    def __init__(self, now):
        self.now, self.total = now, {(s, p): 0.0 for s, p, _, _ in PARTS}

    def time(self, stage: str, part: str, fn, *args):
        t = self.now()
        out = fn(*args)
        self.total[(stage, part)] += self.now() - t
        return out


class Link:
    """Both ends of one authenticated connection, without sockets: seal on one, open on the other."""

    def __init__(self):
        key = b"k" * 32
        self.tx = Connection(None, None, key, b"x" * 32, "bench")
        self.rx = Connection(None, None, b"x" * 32, key, "bench")

    def seal(self, msg) -> bytes:
        return self.tx._seal(encode(msg))[4:]  # the body after the length prefix, as the reader hands it on

    def open(self, body: bytes):
        return self.rx._open(body)


def main_staging_to_host(device, *tensors):
    """main's HostStaging.to_host before this branch: a pinned allocation a tensor a step."""
    out = []
    for t in tensors:
        if t is not None:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            t = host
        out.append(t)
    torch.cuda.current_stream(device).synchronize()
    return tuple(out)


def main_staging_in(device, t):
    """main's way in: a pinned allocation, a device tensor, then the graph's copy from it."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)
    return host.to(device, non_blocking=True)


def run(batch: int, steps: int, mode: str, device: torch.device, hidden_size: int, vocab: int,
        max_model_len: int, now) -> dict[str, float]:
    cuda = device.type == "cuda"
    prepared = mode == "prepared"
    dtype = torch.float16 if cuda else torch.float32
    bucket = bucket_for(batch, BUCKETS)
    width = -(-max_model_len // BLOCK)
    in0 = DecodeInputs(bucket, width, BLOCK, device)
    in1 = DecodeInputs(bucket, width, BLOCK, device, (hidden_size, dtype))
    staging0, staging1 = HostStaging(device), HostStaging(device)
    out0 = torch.randn(bucket, hidden_size, device=device, dtype=dtype)  # stage 0's graph output
    logits = torch.randn(bucket, vocab, device=device)  # stage 1's
    sampler = Sampler(vocab)
    head, gate, seqs0, seqs1 = StepEncoder(), FeedGate(), StageSequences(), StageSequences()
    from_head, hop, feedback, to_head = Link(), Link(), Link(), Link()
    pending = None  # the Sampled frame of the step before, on its way to stage 0
    greedy = SamplingBatch([0.0] * batch, [0] * batch, [1.0] * batch, [0.0] * batch, [1.0] * batch, [0.0] * batch,
                           [0.0] * batch, [0] * batch, [0] * batch, [-1] * batch, [[] for _ in range(batch)],
                           [[] for _ in range(batch)], [[] for _ in range(batch)], [0] * batch,
                           [[] for _ in range(batch)])
    parts = Parts(now)
    start = 100
    last_ids = list(range(batch))  # the sampled ids that come back (their values do not matter)
    for i in range(steps + 8):
        if i == 8:
            parts = Parts(now)  # warm: the sampling parameters went with the first steps
            wall = now()
        pos = start + i
        tables = [list(range(1 + b * width, 1 + b * width + pos // BLOCK + 1)) for b in range(batch)]
        step_in = StepInput([f"r{b}" for b in range(batch)], [0] * batch, [pos] * batch, [1] * batch, tables, batch,
                            [True] * batch, greedy, prev_rows=list(range(batch)))
        msg = head.encode(step_in, 1, i + 2, prev_mb=i + 1, feed=True)
        # stage 0: the step arrives (parked: its ids come later)
        got = parts.time("0", "open Step frame", from_head.open, from_head.seal(msg))
        if gate.step(got):
            raise RuntimeError("an overlapped decode ran before its ids came")
        if prepared:  # while it waits: the mirror and the graph's inputs (StageRuntime.prepare)
            step0 = parts.time("0", "mirror + step input", seqs0.apply, got, False)
            parts.time("0", "graph inputs fill", in0.fill, step0.token_ids, step0.starts, step0.block_tables)
        # the last stage's ids of the step before come
        if pending is None:
            pending = feedback.seal(Sampled(1, i + 1, last_ids))
        s = parts.time("0", "open Sampled frame", feedback.open, pending)
        (run0,) = parts.time("0", "gate: fill tokens", gate.sampled, s)
        if prepared:
            parts.time("0", "token ids to the device", in0.set_tokens, run0.token_ids)
        else:
            step0 = parts.time("0", "mirror + step input", seqs0.apply, run0, False)
            parts.time("0", "graph inputs fill", in0.fill, run0.token_ids, step0.starts, step0.block_tables)
        # (the replay: GPU work) then the hidden states out and the frame to stage 1
        if prepared:
            data, scales = parts.time("0", "hidden states out", lambda: staging0.to_host(*pack(out0[:batch], "fp16")))
        elif cuda:
            data, scales = parts.time("0", "hidden states out",
                                      lambda: main_staging_to_host(device, *pack(out0[:batch], "fp16")))
        else:
            data, scales = parts.time("0", "hidden states out", lambda: pack(out0[:batch], "fp16"))
        body = parts.time("0", "seal Step frame", _seal_with_hidden, hop, run0, data, scales)
        # stage 1
        m1 = parts.time("1", "open Step frame", hop.open, body)
        step1 = parts.time("1", "mirror + sampling batch", seqs1.apply, m1, True)
        if prepared and cuda:
            way_in = _pinned_in
        elif cuda:
            way_in = _main_way_in
        else:
            way_in = _cpu_way_in
        parts.time("1", "hidden states in", way_in, in1.hidden[:batch], m1.hidden, staging1)
        parts.time("1", "graph inputs fill", in1.fill, step1.token_ids, step1.starts, step1.block_tables)
        staging1.release()
        out = parts.time("1", "sampler (ids to host)", sampler, logits[:batch], step1.sampling)
        result = parts.time("1", "result + record", _result, seqs1, m1, out)
        pending = parts.time("1", "seal Sampled frame", feedback.seal, Sampled(1, m1.mb, result.token_ids))
        parts.time("1", "seal StepResult frame", to_head.seal, result)
    wall = now() - wall
    row = {f"{s}: {p}": 1e6 * v / steps for (s, p), v in parts.total.items()}
    on = {(s, p) for s, p, plain, prep in PARTS if (prep if prepared else plain)}
    row["path"] = sum(1e6 * v / steps for k, v in parts.total.items() if k in on)
    row["all"] = 1e6 * wall / steps
    return row


def _seal_with_hidden(link: Link, msg, data, scales) -> bytes:
    """Stage 0's output frame: the step with its hidden states (as StageRuntime.run makes it)."""
    return link.seal(dataclasses.replace(msg, hidden=data, scales=scales))


def _pinned_in(static: torch.Tensor, hidden: torch.Tensor, staging: HostStaging) -> None:
    """This branch: into the pinned buffer, then straight into the graph's static input."""
    static.copy_(staging.to_pinned(hidden)[0], non_blocking=True)


def _main_way_in(static: torch.Tensor, hidden: torch.Tensor, staging: HostStaging) -> None:
    static.copy_(main_staging_in(static.device, hidden), non_blocking=True)


def _cpu_way_in(static: torch.Tensor, hidden: torch.Tensor, staging: HostStaging) -> None:
    static.copy_(hidden.to(static.dtype))


def _result(seqs: StageSequences, msg, out):
    seqs.record(msg, out.token_ids)
    return step_result(1, msg.mb, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--modes", default="plain,prepared")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden-size", type=int, default=4096, help="llama-3-8b's")
    ap.add_argument("--vocab", type=int, default=0, help="logits columns (default: 128256 on a GPU, 1024 on a CPU, "
                                                         "where the argmax would be the CPU's compute)")
    ap.add_argument("--max-model-len", type=int, default=4096, help="the graphs' block-table width")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    vocab = args.vocab or (128256 if device.type == "cuda" else 1024)
    now = time.thread_time if args.clock == "cpu" else time.perf_counter
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for mode in args.modes.split(","):
            best = None
            for _ in range(args.repeats):
                with torch.inference_mode():
                    row = run(batch, args.steps, mode, device, args.hidden_size, vocab, args.max_model_len, now)
                if best is None or row["path"] < best["path"]:
                    best = row
            rows.append({"device": str(device), "batch": batch, "mode": mode, **best})
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"µs per decode step on {device} ({'CPU' if args.clock == 'cpu' else 'wall'} time), hidden "
          f"{args.hidden_size}, vocab {vocab}; (off): not on the ring's critical path in that mode")
    cols = [(b, m) for b in sorted({r["batch"] for r in rows}) for m in args.modes.split(",")]
    print("| stage: part | " + " | ".join(f"{m} B={b}" for b, m in cols) + " |")
    print("|---|" + "---|" * len(cols))
    by = {(r["batch"], r["mode"]): r for r in rows}
    for s, p, plain, prep in PARTS:
        cells = []
        for b, m in cols:
            on = prep if m == "prepared" else plain
            cells.append(f"{by[(b, m)][f'{s}: {p}']:.1f}{'' if on else ' (off)'}")
        print(f"| {s}: {p} | " + " | ".join(cells) + " |")
    for k in ("path", "all"):
        print(f"| **{k}** | " + " | ".join(f"**{by[c][k]:.1f}**" for c in cols) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
