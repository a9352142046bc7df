"""Every message between the head and the pipeline workers (after the handshake of connection.py).

Control, on the head's connection to each worker (one request at a time, answered in order):

    Probe            -> WorkerInfo       free memory and a speed probe on this model's layer shape
    LoadStage        -> NeedFiles        the shards the worker lacks; the head sends FileChunk…FileEnd
                     -> StageLoaded      its layers are loaded; how many KV blocks it can hold
    Configure        -> Configured       a new epoch: KV pool size, the next hop, the wire dtype,
                                         the decode graphs to capture
    Ping             -> Pong             heartbeat
    StatsRequest     -> WorkerStats      byte counters (tests and benchmarks)
    any              -> Failure          the request failed; the message says why

Data, around the ring head -> stage 0 -> … -> last stage -> head:

    Upstream         first frame of a stage-to-stage connection: "my steps come to you" (from
                     the last stage to stage 0: its feedback link, "my Sampled ids come to you")
    DeviceLane       right after it, from a stage whose outputs can skip the socket on this
                     host (lane.py): where to map them; steps then name a slot (`lane_seq`)
    ResultsLink      first frame of the head's result connection to the last stage (one per epoch),
                     answered there by Configured: "send this epoch's StepResults here"
    Step             one micro-batch: block-table diffs, token ids (stage 0) or hidden states,
                     and drafts to verify (speculative decoding)
    StepResult       the last stage's sampled tokens (and accepted drafts), back to the head
    Sampled          the same ids, last stage -> stage 0 on its feedback link (a step with `feed`):
                     the input of the decode the head sent before it read them (overlap)
    Fault            a worker tells the head that its part of the ring broke

Steps carry the epoch they were sent in; a worker drops steps of any other epoch, so nothing of
a broken ring leaks into the repaired one.
"""
from __future__ import annotations

import torch

from .wire import message


@message("probe")
class Probe:
    config_json: str  # the model's config.json, for the speed probe's layer shape
    measure: bool  # time a layer (skipped when the split is given with --layers)
    dtype: str  # "auto" or a dtype name: the activations' dtype on this worker


@message("worker_info")
class WorkerInfo:
    version: str
    device: str
    free_memory: int  # bytes
    layer_bytes: int  # one decoder layer's weights on this device, as loaded
    layer_ms: float  # one decoder layer for one decode token (0 when not measured)
    head_ms: float  # the lm_head for one token (0 when not measured)
    head_bytes: int  # the embedding / lm_head matrix on this device
    memory_id: str  # whose memory free_memory counts (host and GPU): stages that share it split it
    tp: int  # tensor-parallel ranks serving this worker's stage (their memory and speed are counted)
    mps: bool  # a client of an NVIDIA MPS daemon (its control pipe is in this worker's environment)


@message("load_stage")
class LoadStage:
    fingerprint: str  # the model's identity (see weight_push.fingerprint)
    files: dict[str, str]  # metadata files the worker may need: name -> text (config.json, index, manifest)
    shards: dict[str, str]  # shard file -> sha256 (from flotilla.json); empty: no push possible
    start: int
    end: int
    num_layers: int
    dtype: str
    kv_memory: int  # bytes of KV cache for this stage (--kv-cache-memory); 0: not given
    kv_fraction: float  # of free memory (--kv-cache-fraction); 0: not given
    # with neither, the default of a single-process run (kv_cache.plan_kv_cache): a GPU's share of
    # its free memory, a CPU's room for its default tokens; never more than max_num_seqs contexts
    max_model_len: int
    max_num_seqs: int
    memory_shares: int  # stages that share this worker's memory (several on one GPU or host)
    block_size: int
    exact_blocks: int  # > 0: the pool is already sized (a stage rejoining): hold exactly this many


@message("need_files")
class NeedFiles:
    files: list[str]


@message("file_chunk")
class FileChunk:
    file: str
    offset: int
    data: bytes


@message("file_end")
class FileEnd:
    file: str
    size: int


@message("stage_loaded")
class StageLoaded:
    capacity: int  # KV blocks (null block included) this stage can hold
    source: str  # where the weights came from: the worker's --model, its cache, or a push
    received_bytes: int  # shard bytes received for this load


@message("configure")
class Configure:
    epoch: int
    num_blocks: int
    downstream: str | None  # "host:port" of the next stage; None: the last stage answers the head
    wire_dtype: str
    stage_index: int
    graph_tokens: int  # CUDA graphs for decode steps of up to this many tokens (0: eager)
    graph_query_len: int  # most new tokens of one sequence in a replayed step (1 + speculative tokens)
    max_model_len: int  # longest context: the graphs' block-table width
    feedback: str | None = None  # the last stage of a ring of several: "host:port" of stage 0, fed sampled ids


@message("configured")
class Configured:
    epoch: int


@message("ping")
class Ping:
    nonce: int


@message("pong")
class Pong:
    nonce: int


@message("stats_request")
class StatsRequest:
    reset: bool


@message("worker_stats")
class WorkerStats:
    steps: int
    tokens: int  # tokens in the steps this worker forwarded
    decode_steps: int  # steps of decode tokens only
    decode_tokens: int
    decode_bytes: int  # bytes those decode-only steps took on the wire to the next hop
    bytes_sent: int  # everything sent on the data path (to the next stage or the head)
    shard_bytes_received: int  # weight-push payload received since the worker started
    compute_seconds: float  # time in steps: inputs to the device, the stage's compute, outputs back to the host
    # where compute_seconds goes (the stage's fixed cost per step is in the first and last):
    prepare_seconds: float  # the sequence mirror, the step's inputs to the device
    execute_seconds: float  # the runner: launching the layers (a graph replay); the last stage waits for its ids
    output_seconds: float  # a middle stage's hidden states to host memory (it waits for the device) and packed
    send_seconds: float  # encoding, sealing and writing the step's output frames
    parked_steps: int  # stage 0: overlapped decodes that came before their input ids (the head ahead of the ring)
    lane_sent: int = 0  # outputs (hidden states, ids) handed to the next hop through a device lane (lane.py)
    lane_refused: int = 0  # outputs an accepted lane could not take (sent in the frame instead)


@message("failure")
class Failure:
    message: str


@message("fault")
class Fault:
    epoch: int
    message: str


@message("upstream")
class Upstream:
    epoch: int
    stage_index: int  # the sender's stage


@message("results_link")
class ResultsLink:
    epoch: int


@message("seq_sampling")
class SeqSampling:
    """A sequence's sampling parameters, sent once (with its first sampling step) to the last stage."""

    handle: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    top_logprobs: int  # -1: no logprobs
    num_prompt_tokens: int
    prompt_ids: list[int]  # only with a repetition penalty
    output_ids: list[int]  # only with any penalty: the tokens generated so far
    bias_ids: list[int]  # logit_bias: the token ids
    bias_values: list[float]  # and what is added to their logits
    min_tokens: int  # below this output index, `ends` cannot be sampled
    ends: list[int]  # eos and stop tokens (only with min_tokens)


@message("prompt_rows")
class PromptRows:
    """A sequence's prompt logprobs wanted from a step (StepInput.prompt_logprobs), to the last stage."""

    k: int  # how many likeliest tokens
    targets: list[int]  # the prompt tokens the sequence's first rows predict


@message("prompt_logprob")
class PromptLogprob:
    """One prompt token's logprob, from the last stage (ModelRunner.prompt_logprobs)."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_values: list[float]


@message("step")
class Step:
    epoch: int
    mb: int  # micro-batch id, echoed in the StepResult
    handles: list[int]  # the sequences, decodes first
    starts: list[int]  # tokens already computed per sequence
    query_lens: list[int]  # new tokens per sequence
    num_decodes: int
    sample: list[bool]  # whether each sequence samples (the last stage)
    blocks: list[list[int]]  # block ids to append to each sequence's table (a new handle: the whole table)
    sampling: list[SeqSampling]  # first-time sampling parameters
    dropped: list[int]  # handles finished or replaced since the previous step
    token_ids: list[int] | None  # the new tokens (to stage 0)
    hidden: torch.Tensor | None  # [T, hidden] in the wire dtype (to later stages)
    scales: torch.Tensor | None  # [T] float32 per-token scales of int8 hidden states
    # speculative decoding (see step_codec): per sequence, the drafts ending its new tokens,
    # verified by the last stage; None when no sequence speculates
    spec_token_ids: list[list[int]] | None = None
    # [D, vocab] float32: the distributions of the drafts of the sequences that sample (not greedy),
    # in order; None: every draft is a point mass (n-gram drafts, greedy requests)
    draft_probs: torch.Tensor | None = None
    trims: list[list[int]] | None = None  # [handle, blocks]: cut the table to this length, then append
    # overlapped decodes (sent before the step before was read): stage 0 takes the token of each
    # sequence with prev_rows[i] >= 0 from the ids the last stage sampled for step `prev_mb` (row
    # prev_rows[i]), which that stage sends it (`Sampled`) when the step before asked with `feed`
    prev_mb: int = 0
    prev_rows: list[int] | None = None
    feed: bool = False  # the last stage sends this step's sampled ids to stage 0 as well
    # > 0: this step's input is in slot `lane_seq` of the previous hop's device lane (lane.py):
    # the hidden states (then `hidden` is None); at stage 0, set by its gate, step `prev_mb`'s ids
    lane_seq: int = 0
    prompt_logprobs: list[PromptRows] | None = None  # per sequence; None: no prompt logprobs in this step
    # [handle, n]: the table's first n ids become the null block (given back behind a sliding window); applied
    # before the trims
    nulls: list[list[int]] | None = None


@message("device_lane")
class DeviceLane:
    """A sender's lane on this link (lane.py): a ring of `slots` buffers [rows, width] of `dtype`
    in a file of this host's shared memory (`device` cpu) or CUDA memory shared between processes."""

    epoch: int
    kind: str  # "hidden" (to the next stage) or "ids" (the last stage's sampled ids, to stage 0)
    name: str  # the shared file: flotilla-lane-<32 hex digits>
    device: str  # "cpu" or "cuda"
    dtype: str
    slots: int
    rows: int
    width: int
    process: int  # a random id of the sender's process (a pid can repeat across PID namespaces)
    # CUDA only: the GPU's UUID, the slots' IPC memory handle (torch's storage share fields)
    uuid: str
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_handle: bytes
    ref_offset: int
    alloc_event: bytes
    alloc_event_sync: bool
    written_events: list[bytes]  # per slot: the sender's copy in is done
    read_events: list[bytes]  # per slot: the receiver's read is done


@message("sampled")
class Sampled:
    """The last stage's sampled ids of a step sent with `feed`, to stage 0 (on its feedback link):
    the input tokens of the overlapped decode that follows."""

    epoch: int
    mb: int
    token_ids: list[int]  # empty when they are in the ids lane
    lane_seq: int = 0  # > 0: the ids are in this slot of the ids lane (sent before they reach the host)
    lane_rows: int = 0  # and how many ids that slot holds


@message("step_result")
class StepResult:
    epoch: int
    mb: int
    token_ids: list[int]
    logprobs: list[float | None] | None  # per row, when any row asked for logprobs
    top_ids: list[list[int]] | None  # per row: the top tokens, best first
    top_values: list[list[float]] | None  # and their logprobs
    accepted: list[list[int]] | None = None  # speculative steps: per row, the drafts accepted before the token
    prompt_logprobs: list[list[PromptLogprob]] | None = None  # per sequence of the step, when it asked
