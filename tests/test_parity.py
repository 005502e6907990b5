"""training.parity.judge: a compiled run against the eager floor, with the margin on its largest step."""

from qlora_nb_utils.training.parity import judge

ULP = 2.384185791015625e-07  # one unit in the last place of an fp32 loss between 2 and 4
EAGER = [4.0] * 6
FLOOR = [[4.0, 4.0 + 4 * ULP, 4.0 - ULP, 4.0, 4.0 + 2 * ULP, 4.0],
         [4.0, 4.0 - 2 * ULP, 4.0, 4.0 + 3 * ULP, 4.0, 4.0 + ULP]]


def test_one_more_ulp_than_the_floors_largest_is_within_it():
    """The main job's fp32 case: the floor's largest 4 ulps, a correct compiled run's 5 at one step."""
    run = [4.0, 4.0, 4.0 + 5 * ULP, 4.0 + ULP, 4.0, 4.0 + 2 * ULP]
    verdict = judge(EAGER, FLOOR, run)
    assert verdict["within_floor"] and verdict["steps_over_floor"] == [] and verdict["max_factor"] == 1.5
    assert not judge(EAGER, FLOOR, run, max_factor=1.0)["within_floor"]  # the strict maximum fails it


def test_a_real_difference_is_not_within_the_floor():
    run = [4.0, 4.0 + 70 * ULP, 4.0 + 70 * ULP, 4.0, 4.0, 4.0]  # a loss computed with another exp
    verdict = judge(EAGER, FLOOR, run)
    assert not verdict["within_floor"] and verdict["steps_over_floor"] == [1, 2]
    small_but_often = [4.0 + 3 * ULP] * 6  # under the largest at every step, but far above on average
    assert not judge(EAGER, FLOOR, small_but_often)["within_floor"]
