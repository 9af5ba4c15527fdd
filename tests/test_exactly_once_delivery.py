"""Re-delivery and replay: delivering a batch twice changes nothing; the output log replays exactly.

Method: a slice and a container core are fed the same input twice (the
second delivery must be dropped by the progress vector / inbox), and a
job's output log on Ray is read back from several progress points and
compared with the sink.
"""

from __future__ import annotations

import ray

import chronostream as cs
from chronostream.dag import compile_query
from chronostream.master.local import build_cores
from chronostream.master.placement import containers_per_stage, initial_placement
from queries import QUERIES, running_sum
from chronostream.slices.slice import SliceRuntime


def _first_epoch_parts(plan, sources):
    """Epoch 0's routed message from the source container to the next stage."""
    placement = initial_placement(plan, containers_per_stage(plan, 1))
    cores = build_cores(plan, placement, sources)
    src = cores[placement.containers[0][0]]
    dst = placement.containers[1][0]  # the running_sum stage's only container
    return placement, cores, {dst: src.step()[dst]}


def test_slice_given_the_same_batch_twice_changes_nothing():
    """A slice fed an epoch's input twice in one epoch produces the output of one delivery."""
    plan, sources = compile_query(running_sum(3))
    _, _, messages = _first_epoch_parts(plan, sources)
    (dst, msg), = messages.items()
    stream_id, (table, dst_slices) = next(iter(msg.parts.items()))
    mine = table.filter(dst_slices == 0)
    once = SliceRuntime(plan, 1, 0).process(0, {stream_id: [mine]})
    twice = SliceRuntime(plan, 1, 0).process(0, {stream_id: [mine, mine]})
    assert {k: v.to_pylist() for k, v in once.items()} == {k: v.to_pylist() for k, v in twice.items()}
    assert sum(v.num_rows for v in once.values()) > 0


def test_slice_given_an_old_batch_in_a_later_epoch_drops_it():
    """A replayed batch arriving in a later epoch is entirely below the progress vector."""
    plan, sources = compile_query(running_sum(3))
    _, _, messages = _first_epoch_parts(plan, sources)
    (_, msg), = messages.items()
    stream_id, (table, dst_slices) = next(iter(msg.parts.items()))
    rt = SliceRuntime(plan, 1, 0)
    rt.process(0, {stream_id: [table.filter(dst_slices == 0)]})
    again = rt.process(1, {stream_id: [table.filter(dst_slices == 0)]})
    assert again == {}
    assert rt.duplicates_dropped == int((dst_slices == 0).sum())


def test_container_given_the_same_message_twice_keeps_one():
    """The container inbox refuses a second message from the same sender for the same epoch."""
    plan, sources = compile_query(running_sum(3))
    placement, cores, messages = _first_epoch_parts(plan, sources)
    src_id = placement.containers[0][0]
    (dst, msg), = messages.items()
    assert cores[dst].deliver(0, src_id, msg) is True
    assert cores[dst].deliver(0, src_id, msg) is False
    assert cores[dst].messages_dropped == 1


def test_output_log_on_ray_replays_a_stream_from_any_progress_point(ray_session):
    """Each slice's logged outputs equal what it produced, and a read after out_seq k starts at k+1.

    The word counts feed a second stage, so they are logged; a sink on the
    same stream shows what each slice produced.
    """
    build, _, _ = QUERIES["rekey"]
    q = build(4)
    stage_two_input = q.stages[-1].inputs["in"]
    stage_two_input.sink(name="updates")
    job = cs.run(q, containers=2)
    try:
        sink = job.results("updates")
        plan = job.plan
        sink_stream = next(s.stream_id for s in plan.sinks if s.name == "updates")
        assert plan.streams[sink_stream].consumers, "the stream must feed a stage to be logged"
        handles = ray.get(job.master.container_handles.remote())
        stage = plan.stage("count").stage_id
        placement = job.placement().stages["count"]
        for cid, slices in placement.items():
            for s in slices:
                expected = [r for r in sink.to_pylist() if r["_slice"] == s]
                logged = ray.get(handles[int(cid)].read_output_log.remote(sink_stream, s, -1)).to_pylist()
                assert logged == expected
                k = len(expected) // 2
                tail = ray.get(handles[int(cid)].read_output_log.remote(sink_stream, s, k)).to_pylist()
                assert [r["_seq"] for r in tail] == list(range(k + 1, len(expected)))
        assert stage is not None
    finally:
        job.stop()
