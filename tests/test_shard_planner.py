"""ShardPlanner and the backend feed, in process: which samples go into which shard, in what
order, where each sample's rows are to go, and what the backend is handed while staging space
is short."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from job.backend_io import BackendInput, Completion, GenerationInput
from job.data.encode import EncodedSample, EncoderSpec, SampleEncoder
from job.generate.sampling import resolve_sampling
from job.generate.stage import Regenerator
from job.hidden_dtype import hidden_dtype
from job.layout import index_dir_name
from job.pipeline.feed import BackendFeed, ShardPlanner
from job.pipeline.stop import StopFlag
from job.settings import GenerateSettings
from job.shards.format import ShardContext, ShardPlan
from job.storage.local import LocalIndexStore
from job.storage.staging import StagingArea

BYTES_PER_TOKEN = 10


def sample(name: str, tokens: int) -> EncodedSample:
    return EncodedSample(name, np.arange(tokens, dtype=np.int32), np.ones(tokens, np.uint8), False)


def plans(planner: ShardPlanner, samples: list[EncodedSample]) -> list[tuple[int, list[str]]]:
    out = [p for s in samples for p in planner.add(s)] + list(planner.flush())
    return [(p.number, [s.sample_id for s in p.samples]) for p in out]


def test_shards_fill_in_input_order_up_to_the_target_size() -> None:
    planner = ShardPlanner(shard_bytes=100, bytes_per_token=BYTES_PER_TOKEN, first_number=3)
    got = plans(planner, [sample("a", 4), sample("b", 5), sample("c", 3), sample("d", 7), sample("e", 1)])
    # a+b = 90 B; c would make 120 B > 100: a new shard; c+d = 100 B closes it exactly.
    assert got == [(3, ["a", "b"]), (4, ["c", "d"]), (5, ["e"])]
    assert planner.next_number == 6


def test_a_sample_larger_than_a_shard_gets_one_of_its_own() -> None:
    planner = ShardPlanner(shard_bytes=100, bytes_per_token=BYTES_PER_TOKEN, first_number=0)
    got = plans(planner, [sample("a", 2), sample("huge", 50), sample("b", 2)])
    assert got == [(0, ["a"]), (1, ["huge"]), (2, ["b"])]


def test_nothing_to_flush_without_samples() -> None:
    assert list(ShardPlanner(100, BYTES_PER_TOKEN, 0).flush()) == []


CONTEXT = ShardContext(1, 4, hidden_dtype("float32"), {"dtype": "float32", "model_dtype": "float32"})


def test_the_feed_reserves_a_shard_before_handing_out_its_samples(tmp_path: Path) -> None:
    store = LocalIndexStore.open(str(tmp_path), 0)
    samples = [sample(f"s{i}", 20) for i in range(5)]
    with StopFlag() as stop:
        inputs = BackendFeed(iter(samples), ShardPlanner(16 * 20 * 2, 16, 0), CONTEXT, store.staging, stop)
        got = []
        for item in inputs:
            assert item is not None
            # the shard holding this sample exists, at its final size, before the backend sees it
            shard, position = item.destination.shard, item.destination.position
            assert shard.plan.samples[position].sample_id == item.sample_id
            assert (
                shard.staged.path.stat().st_size
                == shard.layout.total_bytes
                == CONTEXT.layout(shard.plan).total_bytes
            )
            got.append((item.sample_id, shard.plan.name, position))
    assert got == [(f"s{i}", f"shard-0000{i // 2}.safetensors", i % 2) for i in range(5)]
    assert [p.name for p in inputs.abandon()] == [f"shard-0000{i}.safetensors" for i in range(3)]
    assert store.staging.used_bytes == 0  # given back, and the files gone
    assert not any(p.name.startswith("shard-") for p in (tmp_path / index_dir_name(0)).iterdir())
    assert inputs.abandon() == []
    store.close()


def test_the_feed_yields_none_while_staging_is_full_and_stops_on_request(tmp_path: Path) -> None:
    store = LocalIndexStore.open(str(tmp_path), 0)
    samples = [sample(f"s{i}", 20) for i in range(6)]
    planner = ShardPlanner(2 * 20 * 16, 16, 0)  # two samples a shard
    one_shard = CONTEXT.layout(ShardPlan(0, samples[:2])).total_bytes
    store.staging = StagingArea(store.directory, limit=one_shard)  # room for one shard only
    with StopFlag() as stop:
        inputs = iter(BackendFeed(iter(samples), planner, CONTEXT, store.staging, stop))
        first = next(inputs)
        assert first is not None and [first.sample_id, next(inputs).sample_id] == ["s0", "s1"]  # type: ignore[union-attr]
        assert next(inputs) is None  # the second shard waits for space: "nothing new yet"
        assert next(inputs) is None
        # the first shard is committed (or dropped): its space frees up
        freed = threading.Timer(0.1, first.destination.shard.staged.discard)
        freed.start()
        item = next(inputs)
        while item is None:
            item = next(inputs)
        assert item.sample_id == "s2"
        freed.join()
        stop.request("test")
        assert next(inputs).sample_id == "s3"  # type: ignore[union-attr]  # the open shard's samples still come
        assert list(inputs) == []  # then nothing more: the third shard is never reserved
    store.close()


def test_once_every_conversation_started_a_shard_closes_at_what_is_still_generating(
    tmp_path: Path, builtin_model: Callable[[str], Path]
) -> None:
    """Regeneration: after the last conversation has started, finished samples no longer wait for
    a full shard (they would be extracted after the last turn, with nothing to generate beside
    them) once they match the conversations still under way. The test answers each turn as a
    backend would, one conversation at a time, the others still generating."""
    model_dir = builtin_model("tiny-chatml")
    spec = EncoderSpec(str(model_dir), None, "auto", 512, "truncate", 1024, True, generate_mode="all_turns")
    encoder = SampleEncoder(spec)
    generate = GenerateSettings(mode="all_turns", temperature=0.0, max_new_tokens=8)
    sampling = resolve_sampling(generate, model_dir, encoder.tokenizer.eos_token_id)
    regenerator = Regenerator(encoder, sampling, "all_turns", 512, True, "keep", max_active=4)
    messages = [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "So."}]
    starts = [encoder.encode(f"c{i}", {"messages": messages}, None) for i in range(6)]
    store = LocalIndexStore.open(str(tmp_path), 0)
    planner = ShardPlanner(shard_bytes=1 << 30, bytes_per_token=16, first_number=0)  # one shard, if full
    eos = sampling.eos_token_ids[0]
    turns: list[GenerationInput] = []
    order: list[str] = []  # what the "backend" saw: turns generated, samples handed to extraction
    with StopFlag() as stop:
        inputs = BackendFeed(iter(starts), planner, CONTEXT, store.staging, stop, regenerator)
        for item in inputs:
            if isinstance(item, GenerationInput):
                turns.append(item)
            elif isinstance(item, BackendInput):
                order.append(f"extract {item.sample_id}")
            elif turns:  # nothing new: finish the oldest turn under way
                turn = turns.pop(0)
                regenerator.complete(Completion(turn.request_id, [eos], "stop"))
                order.append(f"done {turn.request_id}")
        shards = [[s.sample_id for s in plan.samples] for plan in inputs.abandon()]
    # c0..c3 start at once, c4 and c5 as c0 and c1 finish, and the input is exhausted once c2 has
    # finished: c0..c2 then match the three under way (c3..c5), c3 and c4 the one left (c5).
    assert shards == [["c0", "c1", "c2"], ["c3", "c4"], ["c5"]]
    assert order.index("extract c0") < order.index("done c3#0")  # extracted while others generate
    store.close()
