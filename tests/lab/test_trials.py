"""lab/trials.py: a trial's process-wide setting, as each lab tool makes it."""

from qlora_nb_utils.compile.patches import nf4_dequant


def test_the_nf4_row_threshold_trial_sets_the_cuda_threshold_only(monkeypatch):
    from lab.trials import nf4_min_rows

    monkeypatch.setattr(nf4_dequant, "_cuda_rows", nf4_dequant._cuda_rows)  # put back after the test
    assert nf4_min_rows(0) == 0
    assert nf4_dequant.own_rows("cuda") == 0 and nf4_dequant.own_rows("cpu") == 0
    assert nf4_min_rows(768) == 768 and nf4_dequant.own_rows("cuda") == 768
