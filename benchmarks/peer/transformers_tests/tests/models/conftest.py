"""Same inputs and weights in the pristine and the rewritten run: transformers' ``ids_tensor`` /
``floats_tensor`` draw from an unseeded module-level ``random.Random`` and models initialise from
torch's global generator, so every test starts from the same seeds."""

import random

import pytest
import torch


@pytest.fixture(autouse=True)
def _peer_seed():
    from tests import test_modeling_common

    test_modeling_common.global_rng.seed(0)
    random.seed(0)
    torch.manual_seed(0)
    yield
