"""The Trio bridge, in process: one engine task, handlers talking to it only through the inbox.

These check the turn order's promises (deliver on finish, aborts before the next step, a waiting
request whose caller left never runs), the three error routes, and that the event loop stays
responsive while steps run. Disconnects over real sockets are tested in test_disconnect.py.
"""

import time

import pytest
import trio

from nanoserve.config import EngineConfig
from nanoserve.engine import Engine, RequestRejected
from nanoserve.engine.sampling import SamplingParams
from nanoserve.server.bridge import EngineDead, Overloaded, RequestFailed, Serving

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def engine(tiny_model_dir):
    return Engine(tiny_model_dir, EngineConfig(max_num_seqs=2))


async def _serve(nursery, engine, **kw):
    serving = Serving(engine, **kw)
    await nursery.start(serving.run)
    return serving


async def _collect(serving, prompt, params=GREEDY):
    (admitted,) = await serving.admit([prompt], params)
    async with serving.generate(admitted) as outputs:
        return [out async for out in outputs]


async def test_answers_match_the_offline_engine(engine, tiny_model_dir):
    offline = Engine(tiny_model_dir)
    offline.add_request("x", [5, 6, 7, 8], GREEDY)
    while offline.has_unfinished():
        for out in offline.step():
            expected = out.outputs[0].token_ids
    async with trio.open_nursery() as nursery:
        serving = await _serve(nursery, engine)
        results = {}

        async def one(i):
            results[i] = await _collect(serving, [5, 6, 7, 8])

        async with trio.open_nursery() as clients:
            for i in range(5):
                clients.start_soon(one, i)
        for outs in results.values():
            assert outs[-1].finished and outs[-1].outputs[0].token_ids == expected
        assert serving.health()["free_blocks"] == engine.num_blocks
        engine.audit()
        nursery.cancel_scope.cancel()


async def test_a_waiting_request_whose_caller_left_never_runs(engine):
    async with trio.open_nursery() as nursery:
        serving = await _serve(nursery, engine)
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        seen = set()
        async with trio.open_nursery() as busy:
            busy.start_soon(_collect, serving, [1, 2, 3], long)
            busy.start_soon(_collect, serving, [1, 2, 3], long)
            while serving.health()["running"] < 2:  # both slots taken
                await trio.sleep(0.001)
            with trio.move_on_after(0.01) as scope:  # queued behind them (id "2"), then gone
                await _collect(serving, [9, 9, 9], long)
            assert scope.cancelled_caught
            busy.cancel_scope.cancel()  # free the slots: "gone" would run now if still queued
        while engine.has_unfinished() or serving.health()["waiting"]:
            seen |= {r.group_id for r in engine.scheduler.running}
            await trio.sleep(0.001)
        steps = serving.task.steps
        await trio.sleep(0.05)
        assert "2" not in seen and serving.task.steps == steps  # the third request's id
        assert serving.health()["free_blocks"] == engine.num_blocks
        nursery.cancel_scope.cancel()


async def test_cancelled_caller_aborts_a_running_request_within_a_step(engine):
    async with trio.open_nursery() as nursery:
        serving = await _serve(nursery, engine)
        params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        async with serving.generate(engine.admit([1, 2, 3], params)) as outputs:
            async for out in outputs:
                if len(out.outputs[0].token_ids) >= 3:
                    break
        steps_at_leave = serving.task.steps
        while engine.has_unfinished():
            await trio.sleep(0.005)
        assert serving.task.steps - steps_at_leave <= 2
        assert engine.stats().generation_tokens < 10
        engine.audit()
        nursery.cancel_scope.cancel()


async def test_a_slow_reader_gets_coalesced_snapshots(engine):
    async with trio.open_nursery() as nursery:
        serving = await _serve(nursery, engine)
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        seen = []
        async with serving.generate(engine.admit([1, 2, 3], params)) as outputs:
            async for out in outputs:
                seen.append(len(out.outputs[0].token_ids))
                await trio.sleep(0.05)  # far slower than a step
        assert seen[-1] == 30 and len(seen) < 30
        nursery.cancel_scope.cancel()


async def test_refusals_happen_before_anything_is_queued(engine):
    async with trio.open_nursery() as nursery:
        serving = await _serve(nursery, engine, max_queue=1)
        with pytest.raises(RequestRejected) as e:
            await _collect(serving, [], GREEDY)
        assert e.value.param == "prompt"
        with pytest.raises(RequestRejected) as e:
            await _collect(serving, [1], SamplingParams(max_tokens=10**6))
        assert e.value.param == "max_tokens"
        async with serving.generate(engine.admit([1, 2], GREEDY)):
            with pytest.raises(Overloaded):
                await _collect(serving, [1, 2])
        nursery.cancel_scope.cancel()


async def test_a_step_that_raises_fails_every_open_request(engine, monkeypatch):
    async with trio.open_nursery() as nursery:
        serving = await _serve(nursery, engine)

        def broken_step():
            raise RuntimeError("simulated device fault")

        monkeypatch.setattr(engine, "step", broken_step)
        failures = []

        async def client(i):
            try:
                await _collect(serving, [1, 2, 3])
            except RequestFailed as e:
                failures.append(str(e))

        async with trio.open_nursery() as clients:
            for i in range(3):
                clients.start_soon(client, i)
        assert len(failures) == 3 and all("simulated device fault" in f for f in failures)
        health = serving.health()
        assert health["status"] == "dead" and "simulated" in health["reason"]
        assert health["free_blocks"] == engine.num_blocks
        with pytest.raises(EngineDead):
            await _collect(serving, [1, 2, 3])
        nursery.cancel_scope.cancel()


async def test_a_schedule_without_progress_fails_every_open_request(engine):
    async with trio.open_nursery() as nursery:
        serving = await _serve(nursery, engine)
        engine.scheduler.max_num_batched_tokens = 0  # nothing can ever be scheduled
        with pytest.raises(RequestFailed, match="none can be scheduled"):
            await _collect(serving, [1, 2, 3])
        assert serving.health()["status"] == "dead"
        nursery.cancel_scope.cancel()


async def test_event_loop_stays_responsive_while_steps_run(engine, monkeypatch, capsys):
    """Every step is made to take STEP_S (a sleep in the step's thread, standing in for a big
    model): a loop that ran the step itself would stall for STEP_S at a time; the bridge's loop
    never stalls for half of it."""
    step_s = 0.2
    step = engine.step

    def slow_step():
        time.sleep(step_s)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    stalls = []
    async with trio.open_nursery() as nursery:
        serving = await _serve(nursery, engine)
        done = trio.Event()

        async def ticker():
            last = time.perf_counter()
            while not done.is_set():
                await trio.sleep(0.001)
                now = time.perf_counter()
                stalls.append(now - last - 0.001)
                last = now

        nursery.start_soon(ticker)
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        async with trio.open_nursery() as clients:
            for _ in range(2):
                clients.start_soon(_collect, serving, list(range(1, 60)), params)
        done.set()
        steps = serving.task.steps
        nursery.cancel_scope.cancel()
    stalls.sort()
    with capsys.disabled():
        print(
            f"\n[ticker] {len(stalls)} turns over {steps} steps of {step_s * 1e3:.0f} ms; median "
            f"stall {stalls[len(stalls) // 2] * 1e6:.0f} us, longest {stalls[-1] * 1e3:.2f} ms"
        )
    assert steps >= 4
    assert stalls[-1] < step_s / 2
