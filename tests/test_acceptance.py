"""The acceptance test: a crowd against a real server, every survivor byte-identical to its solo
run on the same server, the pool returned, and proof that the crowd was hard; in one process and
with the model split over two (tensor parallelism on gloo)."""

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


async def _crowd(model_dir, seed, **engine_args):
    plans = mixed_crowd(12, seed=seed)
    async with live_server(model_dir, **POOL, **engine_args) as server:
        solo = await run_solo(server, plans, MODEL_NAME)
        await check_pool_returned(server)
        crowd = await run_crowd(server, plans, MODEL_NAME)
        check_survivors(crowd)
        compared = check_answers(solo, crowd)
        await check_pool_returned(server)
        blocks = server.engine.cache_blocks()
    print(
        f"\n[crowd seed={seed} {engine_args}] {compared} survivors identical to solo; peak "
        f"running {crowd.peak_running}, preemptions {crowd.preemptions}, positions recomputed "
        f"{crowd.recomputed_tokens}; KV blocks per rank {blocks}"
    )
    assert compared == 9  # three of the twelve hang up
    assert crowd.peak_running >= 2, "the crowd never ran two requests together"
    assert crowd.preemptions > 0 and crowd.recomputed_tokens > 0, "the crowd never preempted"
    assert any(r.hung_up for r in crowd.results.values())
    return blocks


@pytest.mark.parametrize("seed", [0, 1])
async def test_twelve_clients_match_their_solo_runs_under_preemption(tiny_model_dir, seed):
    await _crowd(tiny_model_dir, seed)


async def test_the_crowd_on_two_ranks(tiny_model_dir):
    """The pool returned on every rank: one allocator (rank 0's scheduler) decides the block
    tables of every rank, so the ledger audit on rank 0 covers them all; what makes those tables
    valid on the worker is its cache holding exactly the pool's blocks, which Engine.audit (in
    check_pool_returned) checks by asking the worker, and which is asserted here once more."""
    blocks = await _crowd(tiny_model_dir, 0, tensor_parallel_size=2)
    assert blocks == [POOL["num_kv_blocks"]] * 2
