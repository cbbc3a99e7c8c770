"""The soak's short form: one round of every fault at once (tests/soak.py; its long form runs for an hour)."""

from __future__ import annotations

import random
from pathlib import Path

from tests.conftest import OwnDatabase
from tests.soak import Soak


def test_every_fault_at_once(tmp_path: Path, tiny_model_dir: Path, own_postgres: OwnDatabase) -> None:
    soak = Soak(tmp_path, tiny_model_dir, own_postgres, num_workers=2, num_rows=60, rng=random.Random(11))
    done = soak.round()
    assert sum(done.faults.values()) >= 5, done.faults  # the round lasted long enough to be hit
