"""Device lanes (runtime/pipeline/lane.py) on the CPU: slots in a shared file, the sequence
numbers, when a slot may be filled again, the refusals, and stage 0's gate with ids in a lane.
The CUDA form (IPC memory and events) runs in bench/gpu_pipeline.py on a GPU; the CPU rings of
the other pipeline tests go through these lanes on every decode."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from flotilla.runtime.pipeline.feed import FeedGate
from flotilla.runtime.pipeline.lane import LaneIn, LaneOut, lane_dir
from flotilla.runtime.pipeline.messages import Sampled, Step
from flotilla.runtime.pipeline.wire import decode, encode

CPU = torch.device("cpu")


@pytest.fixture
def lane():
    out = LaneOut("hidden", CPU, torch.float32, rows=3, width=4, slots=2)
    yield out
    out.close()


def through_the_wire(msg):
    return decode(encode(msg))


def test_a_lane_carries_tensors_in_order_and_refills_a_slot_only_once_it_is_read(lane):
    a, b, c = (torch.full((n, 4), float(n)) for n in (1, 2, 3))
    assert lane.put(a) == 0 and lane.refused == 0  # nobody mapped it yet: the frame carries it
    offer = through_the_wire(lane.offer(7))
    assert offer.device == "cpu" and offer.slots == 2 and offer.rows == 3 and offer.width == 4
    inbound = LaneIn.open(offer, CPU)
    assert inbound is not None and inbound.epoch == 7
    assert not os.path.exists(os.path.join(lane_dir(), offer.name))  # both hold it mapped; no file is left
    assert lane.put(a) == 1 and lane.put(b) == 2
    assert lane.put(c) == 0 and lane.refused == 1  # slot 1 (sequence 3's) still holds sequence 1, unread
    assert torch.equal(inbound.take(1, 1), a)
    inbound.done(1)
    assert lane.put(c) == 3  # now it may
    assert torch.equal(inbound.take(2, 2), b) and torch.equal(inbound.take(3, 3), c)
    with pytest.raises(ValueError, match="after slot"):
        inbound.take(1, 1)  # read already
    assert lane.put(torch.zeros(4, 4)) == 0  # more rows than a slot holds
    assert lane.put(torch.zeros(1, 5)) == 0  # the wrong width
    assert lane.sent == 3


def test_slots_done_out_of_order_free_the_sender_only_up_to_the_first_one_still_unread(lane):
    inbound = LaneIn.open(through_the_wire(lane.offer(1)), CPU)
    x = torch.ones(1, 4)
    assert [lane.put(x) for _ in range(3)] == [1, 2, 0]
    inbound.done(2)  # sequence 2 will never be read (stage 0's gate forgot it); 1 is still unread
    assert inbound.consumed == 0 and lane.put(x) == 0
    inbound.done(1)
    assert inbound.consumed == 2 and lane.put(x) == 3 and lane.put(x) == 4
    inbound.done(2)  # again: nothing changes
    assert inbound.consumed == 2


def test_lanes_are_refused_where_the_memory_cannot_be_mapped(lane, monkeypatch):
    offer = through_the_wire(lane.offer(1))
    assert LaneIn.open(dataclasses.replace(offer, name="flotilla-lane-" + "0" * 32), CPU) is None  # another host
    assert LaneIn.open(dataclasses.replace(offer, name="../etc/passwd"), CPU) is None
    assert LaneIn.open(dataclasses.replace(offer, rows=10**9), CPU) is None  # over the size limit
    assert LaneIn.open(dataclasses.replace(offer, rows=4), CPU) is None  # not the file's size
    assert LaneIn.open(dataclasses.replace(offer, device="cuda"), CPU) is None  # slots on another device
    monkeypatch.setenv("FLOTILLA_LANES", "0")
    assert LaneIn.open(offer, CPU) is None
    monkeypatch.delenv("FLOTILLA_LANES")
    assert lane.put(torch.ones(1, 4)) == 0  # none of the above accepted it
    assert LaneIn.open(offer, CPU) is not None and lane.put(torch.ones(1, 4)) == 1


def test_closing_the_sender_removes_a_file_nobody_mapped():
    lane = LaneOut("ids", CPU, torch.int64, rows=8, width=1)
    assert os.path.exists(lane.path)
    lane.close()
    assert not os.path.exists(lane.path)
    lane.close()  # twice is fine


def step(mb, tokens, prev_mb=0, rows=None):
    n = len(tokens)
    return Step(1, mb, list(range(n)), [5] * n, [1] * n, n, [True] * n, [[]] * n, [], [], tokens, None, None,
                prev_mb=prev_mb, prev_rows=rows, feed=True)


def test_stage_0_gate_passes_ids_in_the_lane_on_and_forgets_the_slots_no_step_reads():
    forgotten = []
    gate = FeedGate(forgotten.append)
    assert [s.mb for s in gate.step(step(1, [7, 8]))] == [1]
    assert gate.step(step(2, [0, 0, 9], 1, [1, 0, -1])) == []
    out = gate.sampled(Sampled(1, 1, [], lane_seq=5, lane_rows=2))
    # the ids stay on the device: zeros where they go, the rows kept for the runner, the slot named
    assert [(s.mb, s.token_ids, s.prev_rows, s.lane_seq) for s in out] == [(2, [0, 0, 9], [1, 0, -1], 5)]
    gate.sampled(Sampled(1, 2, [], lane_seq=6, lane_rows=3))  # step 2 fed, but the head sent nothing ahead of it
    gate.sampled(Sampled(1, 3, [12]))  # a step whose ids came in the frame
    assert [s.token_ids for s in gate.step(step(4, [3]))] == [[3]]
    assert forgotten == [6]  # its slot is free again; ids in frames need nothing


def test_stage_0_gate_refuses_rows_past_the_ids_in_the_lane_slot_and_frees_the_slot():
    forgotten = []
    gate = FeedGate(forgotten.append)
    gate.step(step(1, [7, 8]))
    assert gate.step(step(2, [0, 0], 1, [0, 2])) == []  # row 2 of a step that sampled 2 ids
    with pytest.raises(ValueError, match="2 sampled ids"):
        gate.sampled(Sampled(1, 1, [], lane_seq=5, lane_rows=2))
    assert forgotten == [5]  # the slot is free again (the ring's epoch then faults and starts anew)


def test_a_staged_decode_takes_its_prev_rows_with_its_tokens():
    from flotilla.runtime.cuda_graphs import DecodeInputs

    inputs = DecodeInputs(4, 2, 16, CPU, no_prev=9)
    inputs.fill([0, 0, 5], [3, 4, 5], [[1], [2], [3]])
    tok, _, _, _, _ = inputs.host_views()
    assert inputs.prev_rows.tolist() == [9, 9, 9, 9]
    inputs.set_tokens([0, 0, 5], [1, 0, -1])
    assert inputs.token_ids.tolist() == [0, 0, 5, 0] and inputs.prev_rows.tolist() == [1, 0, 9, 9]
    assert np.array_equal(tok[:3], [0, 0, 5])
    inputs.fill([1], [3], [[1]])  # the next step: no rows from the sampled ids
    assert inputs.prev_rows.tolist() == [9, 9, 9, 9]


def test_the_process_id_is_random_per_process_and_new_after_a_fork():
    from flotilla.runtime.pipeline.lane import process_id

    mine = process_id()
    assert mine == process_id() and 0 <= mine < 1 << 63
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a pid of its own, and an id of its own
        os.write(w, str(process_id()).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    child = int(os.read(r, 64))
    os.close(r)
    assert child != mine and process_id() == mine
