"""The soak's short form: one round with every kind of fault, back to back, in a seeded order (tests/soak.py; its
long form draws faults at random for an hour)."""

from __future__ import annotations

import random
from pathlib import Path

from tests.conftest import OwnDatabase
from tests.soak import FAULTS, Soak


def test_every_fault_at_once(tmp_path: Path, tiny_model_dir: Path, own_postgres: OwnDatabase) -> None:
    rng = random.Random(11)
    schedule = rng.sample(list(FAULTS), len(FAULTS))
    soak = Soak(tmp_path, tiny_model_dir, own_postgres, num_workers=2, num_rows=60, rng=rng, schedule=schedule)
    done = soak.round()
    # every kind landed while work was left (a kill or pause with no worker alive becomes a restart)
    assert sum(done.faults.values()) == len(FAULTS) and {"restart", "stop", "drop", "cancel_retry"} <= set(done.faults)
