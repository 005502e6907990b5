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


def test_the_verdict_names_both_limits_it_judges_by():
    from qlora_nb_utils.training.parity import limits, verdict_text

    within = judge(EAGER, FLOOR, [4.0, 4.0, 4.0 + 5 * ULP, 4.0 + ULP, 4.0, 4.0 + 2 * ULP])
    max_limit, mean_limit = limits(within)
    assert max_limit == 1.5 * within["floor_max_abs_loss_diff"]
    assert mean_limit == 1.5 * within["floor_mean_abs_loss_diff"]
    text = verdict_text(within)
    assert text.startswith("within the floor")
    assert f"limit {max_limit:.2g} (1.5 x the floor's largest" in text
    assert f"limit {mean_limit:.2g} (1.5 x the floor's mean" in text
    over = verdict_text(judge(EAGER, FLOOR, [4.0, 4.0 + 70 * ULP, 4.0 + 70 * ULP, 4.0, 4.0, 4.0]))
    assert over.startswith("OUTSIDE the floor") and "> limit" in over and "at steps 1, 2" in over
    often = verdict_text(judge(EAGER, FLOOR, [4.0 + 3 * ULP] * 6))  # every step under the limit, the mean over
    assert often.startswith("OUTSIDE") and "<= limit" in often.split(";")[0] and "> limit" in often.split(";")[1]


def test_the_floor_plot_draws_the_limits_the_verdict_judges_by():
    """The fast path's parity panel: a horizontal line at 1.5 x the floor's largest and one at
    1.5 x the floor's mean, and the verdict with those limits as its title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from qlora_nb_utils.plots import plot_fast_path
    from qlora_nb_utils.training.parity import limits, verdict_text

    run = [4.0, 4.0 + 70 * ULP, 4.0 + 70 * ULP, 4.0, 4.0, 4.0]
    fast = {"name": "fast", **judge(EAGER, FLOOR, run)}
    steps = list(range(len(EAGER)))
    results = {"model": "tiny", "device": {"name": "cpu"}, "runs": [fast],
               "history": {"fast": {"step": steps, "loss": run}, "fast-eager": {"step": steps, "loss": EAGER}}}
    fig = plot_fast_path(results)
    try:
        panel = fig.axes[1]
        lines = {line.get_label(): line.get_ydata() for line in panel.get_lines()}
        max_limit, mean_limit = limits(fast)
        assert list(lines["limit: 1.5 x floor max"]) == [max_limit, max_limit]
        assert list(lines["mean limit: 1.5 x floor mean"]) == [mean_limit, mean_limit]
        assert list(lines["mean |fast - fast-eager|"]) == [fast["mean_abs_loss_diff"]] * 2
        assert max(fast["diffs"]) > max_limit  # the run's points above the drawn limit: the verdict's OUTSIDE
        assert panel.get_title().replace("\n", " ") == verdict_text(fast)
        assert "OUTSIDE" in fig._suptitle.get_text()
    finally:
        plt.close(fig)
