"""The suite's ``alone`` marker (tests/conftest.py): under pytest-xdist, a test marked so
runs with no other test beside it. Checked on a real xdist run of three tests, two of
them ``alone``, each recording when it ran."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_MODULE = '''
import json, os, time
import pytest

def _ran(name):
    start = time.monotonic()
    time.sleep(1.0)
    with open(os.environ["ALONE_LOG"], "a") as log:
        log.write(json.dumps([name, start, time.monotonic()]) + "\\n")

@pytest.mark.alone
def test_first_alone():
    _ran("first alone")

@pytest.mark.alone
def test_second_alone():
    _ran("second alone")

def test_ordinary():
    _ran("ordinary")
'''


@pytest.mark.timeout(120)
def test_an_alone_test_runs_with_no_other_test_beside_it(tmp_path):
    # (under tests/, so that tests/conftest.py is this run's conftest)
    where = tempfile.mkdtemp(prefix="_alone_", dir=TESTS)
    try:
        with open(os.path.join(where, "test_generated_alone.py"), "w") as module:
            module.write(_MODULE)
        log = tmp_path / "ran.jsonl"
        env = dict(os.environ, ALONE_LOG=str(log))
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "3",
                               "-p", "no:cacheprovider", where],
                              cwd=os.path.dirname(TESTS), env=env, capture_output=True,
                              text=True, timeout=100)
    finally:
        shutil.rmtree(where)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted(name for name, _, _ in ran) == ["first alone", "ordinary", "second alone"]
    for name, start, end in ran:
        if name.endswith("alone"):
            beside = [other for other, s, e in ran if other != name and s < end and e > start]
            assert not beside, f"{name} ran beside {beside}: {ran}"
