"""pytest configuration of the fused_ops suite.

Devices: the ``device`` fixture runs a test on "cpu" and "cuda"; without a
GPU the "cuda" variants are reported as skipped (see fused_test_utils).

Seeds: every test runs under its own seed, seeded into torch (CPU and CUDA)
and ``random`` by the autouse ``seed`` fixture, so each test draws fresh
inputs that differ from test to test and from run to run.  The per-test seed
is ``(base + crc32(node id)) mod 2**63``; the base is drawn afresh by each
pytest invocation unless FUSED_OPS_TEST_SEED is set.  The base seed is
printed in the report header and the per-test seed in the report of every
failing test, so

    FUSED_OPS_TEST_SEED=<base> python -m pytest 'tests/...::test_x[...]'

reproduces a failure exactly.
"""

import os
import random
import zlib

import pytest
import torch

from fused_test_utils import DEVICE_PARAMS, DEVICES  # noqa: F401  (re-exported)

_ENV = "FUSED_OPS_TEST_SEED"
BASE_SEED = int(os.environ[_ENV]) if os.environ.get(_ENV) else random.SystemRandom().randrange(2**31)


def pytest_report_header(config):
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    return [
        f"fused_ops tests: torch {torch.__version__}, {cuda}, devices {DEVICES}",
        f"fused_ops tests: base seed {BASE_SEED} (reproduce with {_ENV}={BASE_SEED})",
    ]


def seed_for_nodeid(nodeid):
    return (BASE_SEED + zlib.crc32(nodeid.encode())) % 2**63


@pytest.fixture(autouse=True)
def seed(request):
    """Seeds torch and ``random`` with this test's seed and returns it."""
    s = seed_for_nodeid(request.node.nodeid)
    request.node.user_properties.append(("seed", s))
    request.node.user_properties.append(("base_seed", BASE_SEED))
    torch.manual_seed(s)  # also seeds every CUDA device
    random.seed(s)
    return s


@pytest.fixture(params=DEVICE_PARAMS)
def device(request):
    return request.param


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        props = dict(item.user_properties)
        report.sections.append(
            (
                "fused_ops seed",
                f"per-test seed {props.get('seed', seed_for_nodeid(item.nodeid))}; "
                f"rerun with {_ENV}={BASE_SEED}",
            )
        )
