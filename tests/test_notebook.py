"""Profile selection for the notebooks' first cell."""

import pytest

from qlora_nb_utils.notebook import pick_profile

PROFILES = {"ci": {"steps": 3}, "gpu": {"steps": 30}}


def test_env_var_picks_the_profile_and_returns_a_copy():
    name, params = pick_profile(PROFILES, env={"QLORA_NB_PROFILE": "gpu"})
    assert (name, params) == ("gpu", {"steps": 30})
    params["steps"] = 1
    assert PROFILES["gpu"]["steps"] == 30


def test_default_follows_cuda(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert pick_profile(PROFILES, env={})[0] == "ci"
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert pick_profile(PROFILES, env={})[0] == "gpu"


def test_unknown_profile_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"\['ci', 'gpu'\]"):
        pick_profile(PROFILES, env={"QLORA_NB_PROFILE": "tpu"})


def test_profiles_must_define_ci_and_gpu():
    with pytest.raises(ValueError, match="gpu"):
        pick_profile({"ci": {}}, env={})
