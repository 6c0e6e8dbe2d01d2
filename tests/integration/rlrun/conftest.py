from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def micro():
    from tests.integration.rlrun.micro import micro_models

    return micro_models()
