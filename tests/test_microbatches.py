"""megatron_fsdp.num_microbatches_calculator: constant batches and Megatron's batch-size ramp-up."""

import pytest

from megatron_fsdp import num_microbatches_calculator as nmc


@pytest.fixture(autouse=True)
def _fresh_calculator():
    nmc.destroy_num_microbatches_calculator()
    yield
    nmc.destroy_num_microbatches_calculator()


def test_constant_number_of_microbatches():
    nmc.init_num_microbatches_calculator(0, None, global_batch_size=48, micro_batch_size=4, data_parallel_size=3)
    assert nmc.get_num_microbatches() == 4
    assert nmc.get_current_global_batch_size() == 48
    assert nmc.get_micro_batch_size() == 4
    nmc.update_num_microbatches(10_000)
    assert nmc.get_num_microbatches() == 4


def _rampup_batch(consumed, start, increment, samples, final):
    """Megatron-LM's ramp-up rule, written out: START grows by INCREMENT every
    SAMPLES / ((FINAL - START) / INCREMENT) samples, FINAL once past SAMPLES."""
    if consumed > samples:
        return final
    per_increment = samples / ((final - start) // increment)
    return start + int(consumed / per_increment) * increment


def test_rampup_follows_megatrons_rule_and_reaches_the_global_batch():
    start, increment, samples, final, mbs, dp = 4, 4, 120, 16, 2, 2
    nmc.init_num_microbatches_calculator(0, [start, increment, samples], final, mbs, dp)
    seen = []
    consumed = 0
    while consumed <= samples + 40:
        nmc.update_num_microbatches(consumed)
        expected = _rampup_batch(consumed, start, increment, samples, final)
        assert nmc.get_current_global_batch_size() == expected, consumed
        assert nmc.get_num_microbatches() == expected // (mbs * dp)
        seen.append(expected)
        consumed += expected
    assert seen[0] == 4 and seen[-1] == 16 and sorted(seen) == seen
    assert {4, 8, 12, 16} <= set(seen)


def test_rampup_batch_not_divisible_by_micro_batch_times_dp_is_an_error():
    nmc.init_num_microbatches_calculator(0, [6, 2, 100], 10, micro_batch_size=2, data_parallel_size=2)
    with pytest.raises(ValueError, match="global batch size 6 is not divisible"):
        nmc.update_num_microbatches(0, consistency_check=True)


def test_decrease_batch_size_if_needed_rounds_down():
    nmc.init_num_microbatches_calculator(0, None, 50, micro_batch_size=4, data_parallel_size=3,
                                         decrease_batch_size_if_needed=True)
    assert nmc.get_current_running_global_batch_size() == 48
    assert nmc.get_num_microbatches() == 4


@pytest.mark.parametrize("rampup, match", [([8, 3, 100], "multiple of the increment"),
                                           ([32, 4, 100], "multiple of the increment"),
                                           ([4, 4], "rampup_batch_size must be")])
def test_bad_rampup_is_rejected(rampup, match):
    with pytest.raises(ValueError, match=match):
        nmc.init_num_microbatches_calculator(0, rampup, 16, 2, 2)


def test_use_before_init_and_double_init_are_errors():
    with pytest.raises(RuntimeError, match="not initialized"):
        nmc.get_num_microbatches()
    nmc.init_num_microbatches_calculator(0, None, 8, 2, 2)
    with pytest.raises(RuntimeError, match="already initialized"):
        nmc.init_num_microbatches_calculator(0, None, 8, 2, 2)
    nmc.reconfigure_num_microbatches_calculator(0, None, 16, 2, 2)
    assert nmc.get_num_microbatches() == 4
