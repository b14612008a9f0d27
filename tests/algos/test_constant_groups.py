"""GPG's M and CPGD's G_nz count constant groups by equality of the group's rewards (issue 38): the
float64 group [0.7, 0.7, 0.7] has a computed std of 1.4e-16, which a ``std == 0`` test misses."""

import pytest
import torch

from trainer.algos.advantages import compute_cpgd_outcome_advantage, compute_gpg_outcome_advantage
from trainer.algos.utils import group_constant, group_stats

REWARDS = [0.7, 0.7, 0.7, 0.5, 0.0]  # a constant group of three, a mixed group of two
INDEX = torch.tensor([0, 0, 0, 1, 1])


def _tls():
    tls = torch.zeros(5, 3, dtype=torch.float64)
    tls[:, 2] = torch.tensor(REWARDS, dtype=torch.float64)
    return tls, torch.ones(5, 3)


def test_the_std_misses_it_and_equality_does_not():
    r = torch.tensor(REWARDS, dtype=torch.float64)
    assert group_stats(r, INDEX)[1][0].item() > 0  # floating point: not 0
    assert group_constant(r, INDEX).tolist() == [True, True, True, False, False]


def test_gpg_alpha_counts_the_constant_group():
    tls, mask = _tls()
    adv, _ = compute_gpg_outcome_advantage(token_level_rewards=tls, response_mask=mask, index=INDEX)
    # alpha = B / (B - M) = 5 / 2; the mixed group's R - mean = +-0.25 -> +-0.625 (std == 0 would give +-0.25)
    assert adv[:, 0].tolist() == pytest.approx([0.0, 0.0, 0.0, 0.625, -0.625], abs=1e-12)


def test_cpgd_clip_filter_counts_groups_by_equality():
    tls, mask = _tls()
    adv, _ = compute_cpgd_outcome_advantage(token_level_rewards=tls, response_mask=mask, index=INDEX,
                                            weight_factor_in_cpgd="clip_filter_like_weight")
    # one varied group: min(B / G_nz, 3) = min(5 / 1, 3) = 3 -> +-0.75 (a std test counts two: 2.5 -> +-0.625)
    assert adv[3:, 0].tolist() == pytest.approx([0.75, -0.75], abs=1e-12)
