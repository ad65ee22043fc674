"""Fair admission between HTTP requests, through a real server: one request of many prompts holds
at most all but a sixteenth of the batch rows (max_num_seqs), so that a short request arriving
while it runs gets a row at once instead of waiting for a whole wave of the big one's prompts."""

from functools import partial

import trio

from nanoserve.server.engine_task import RESERVED_ROW_SHARE
from nanoserve.testing.harness import live_server

C = "/v1/completions"
ROWS = 32  # max_num_seqs
CAP = ROWS - ROWS // RESERVED_ROW_SHARE
TOKENS = 100  # each of the big request's completions


async def test_a_short_request_beside_many_prompts_is_admitted_at_once(tiny_model_dir):
    """The big request fills the rows it may (never all of them); the short one is answered
    before the first wave of the big one's prompts has finished."""
    async with live_server(tiny_model_dir, num_kv_blocks=1024, max_num_seqs=ROWS) as server:
        big = {"prompt": [f"a b c {i}" for i in range(2 * ROWS)], "max_tokens": TOKENS,
               "ignore_eos": True}  # fmt: skip
        answers = []

        async def send_big() -> None:
            answers.append(await server.http.post(C, json=big))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_big)
            health = await server.wait_until(lambda h: h["running"] >= CAP)
            assert health["running"] == CAP
            short = await server.http.post(C, json={"prompt": "hi", "max_tokens": 1})
            assert short.status_code == 200
            generated = (await server.health())["generation_tokens"]
        assert generated < CAP * TOKENS  # the first wave was still running
        assert answers[0].status_code == 200 and len(answers[0].json()["choices"]) == 2 * ROWS
        health = await server.wait_idle()
        assert health["peak_running"] <= CAP + 1


async def test_n_completions_take_n_rows(tiny_model_dir):
    """Two requests of n = 8 on 16 rows run together; a third waits for rows, then runs."""
    async with live_server(tiny_model_dir, num_kv_blocks=1024, max_num_seqs=16) as server:
        body = {"prompt": "a b c", "n": 8, "max_tokens": 40, "ignore_eos": True}
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(partial(server.http.post, C, json=body))
            health = await server.wait_until(lambda h: h["running"] == 16)
            assert health["waiting"] == 1
        health = await server.wait_idle()
        assert health["peak_running"] == 16
