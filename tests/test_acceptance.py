"""The acceptance test: a crowd against a real server, every survivor byte-identical to its solo
run on the same server, the pool returned, and proof that the crowd was hard."""

import pytest

from nanoserve.testing.crowd import (
    check_answers,
    check_pool_returned,
    check_survivors,
    mixed_crowd,
    run_crowd,
    run_solo,
)
from nanoserve.testing.harness import MODEL_NAME, live_server

# Measured: with 4 slots and 12 blocks of 16 tokens this crowd preempts (see the assertions).
POOL = dict(block_size=16, num_kv_blocks=12, max_num_seqs=4)


@pytest.mark.parametrize("seed", [0, 1])
async def test_twelve_clients_match_their_solo_runs_under_preemption(tiny_model_dir, seed):
    plans = mixed_crowd(12, seed=seed)
    async with live_server(tiny_model_dir, **POOL) as server:
        solo = await run_solo(server, plans, MODEL_NAME)
        await check_pool_returned(server)
        crowd = await run_crowd(server, plans, MODEL_NAME)
        check_survivors(crowd)
        compared = check_answers(solo, crowd)
        await check_pool_returned(server)
    print(
        f"\n[crowd seed={seed}] {compared} survivors identical to solo; peak running "
        f"{crowd.peak_running}, preemptions {crowd.preemptions}, "
        f"positions recomputed {crowd.recomputed_tokens}"
    )
    assert compared == 9  # three of the twelve hang up
    assert crowd.peak_running >= 2, "the crowd never ran two requests together"
    assert crowd.preemptions > 0 and crowd.recomputed_tokens > 0, "the crowd never preempted"
    assert any(r.hung_up for r in crowd.results.values())
