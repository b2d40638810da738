"""systemd/dsuf.service is a valid unit that runs `dsuf serve` the way operations expect."""

from __future__ import annotations

import argparse
import configparser
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsuf.serve import add_serve_arguments

UNIT = Path(__file__).resolve().parents[1] / "systemd" / "dsuf.service"
ENV = UNIT.with_name("dsuf.env")


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read_string(UNIT.read_text())
    return parser


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verifies_the_unit_without_a_warning(tmp_path):
    dsuf = Path(sys.executable).with_name("dsuf")
    assert dsuf.is_file(), "the dsuf console script must be installed next to the interpreter"
    text = UNIT.read_text().replace("/opt/dsuf/.venv/bin/dsuf", str(dsuf))
    (tmp_path / "dsuf.service").write_text(text)
    proc = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "dsuf.service")], capture_output=True, text=True)
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), proc.stdout + proc.stderr


def test_the_unit_restarts_on_failure_after_redis_with_an_environment_file_and_limits():
    u = unit()
    service = u["Service"]
    assert "redis-server.service" in u["Unit"]["After"].split()
    assert service["ExecStart"].endswith("dsuf serve")
    assert service["EnvironmentFile"].lstrip("-") == "/etc/dsuf/dsuf.env"
    assert service["Restart"] == "on-failure" and service["KillSignal"] == "SIGTERM"
    assert int(service["TimeoutStopSec"]) > 30  # longer than the default drain grace
    assert int(service["LimitNOFILE"]) >= 65536 and service["LimitMEMLOCK"] == "infinity"


def test_every_variable_in_the_example_environment_is_a_serve_option():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    known = {a.dest.upper() for a in parser._actions}
    names = re.findall(r"^#?\s*DSUF_([A-Z_]+)=", ENV.read_text(), re.M)
    assert names and all(name in known for name in names), sorted(set(names) - known)
