"""Config precedence, parsing and validation."""
import dataclasses
import os
import subprocess
import sys

import pytest

from fibrl.config import Config, resolve
from fibrl.errors import ConfigError


def test_defaults():
    config = resolve(environ={}, cwd=None)
    assert config == Config()
    assert config.backend == "local"


def test_precedence_kwargs_over_env_over_file(tmp_path):
    (tmp_path / ".fibrlconfig").write_text("[fibrl]\nbackend = docker\nimage = fromfile\ncpu = 2\n")
    env = {"FIBRL_IMAGE": "fromenv", "FIBRL_DEBUG": "false"}
    config = resolve({"backend": "local"}, environ=env, cwd=str(tmp_path))
    assert config.backend == "local"      # kwargs beat the file
    assert config.image == "fromenv"      # env beats the file
    assert config.cpu == 2.0              # the file beats defaults, parsed to float
    assert config.debug is False


@pytest.mark.parametrize("text,value", [("false", False), ("0", False), ("no", False),
                                        ("true", True), ("1", True), ("On", True)])
def test_bool_parsing(text, value):
    assert resolve(environ={"FIBRL_DEBUG": text}, cwd=None).debug is value


def test_test_suite_switches_are_not_config_keys():
    # FIBRL_TEST_KUBECONFIG (tests/conftest.py) is read by the test suite, while every
    # process of the run, workers included, resolves its config from the same environment
    config = resolve(environ={"FIBRL_TEST_KUBECONFIG": "/tmp/admin.kubeconfig"}, cwd=None)
    assert config == Config()


def test_unknown_keys_suggest_the_close_ones(tmp_path):
    with pytest.raises(ConfigError) as info:
        resolve({"bakend": "local"}, environ={}, cwd=None)
    text = str(info.value)
    assert "unknown fibrl config key 'bakend'" in text
    assert "did you mean 'backend'?" in text
    assert "kubernetes_namespace" not in text      # not the whole list of keys
    assert "docs/configuration.md" in text
    with pytest.raises(ConfigError) as info:       # nothing close: every key, compactly
        resolve({"zzz": 1}, environ={}, cwd=None)
    text = str(info.value)
    assert "valid keys: auth_timeout, backend," in text
    assert "docker_{mount_cwd, mount_readonly, network, workdir}" in text
    assert "kubernetes_namespace" not in text and "namespace" in text
    with pytest.raises(ConfigError, match="FIBRL_"):
        resolve(environ={"FIBRL_NOPE": "1"}, cwd=None)
    (tmp_path / ".fibrlconfig").write_text("colour = red\n")
    with pytest.raises(ConfigError, match="colour"):
        resolve(environ={}, cwd=str(tmp_path))


def test_bad_values_are_explained():
    with pytest.raises(ConfigError, match="must be float"):
        resolve(environ={"FIBRL_CPU": "lots"}, cwd=None)
    with pytest.raises(ConfigError, match="backend 'mesos' is not known"):
        resolve({"backend": "mesos"}, environ={}, cwd=None)
    with pytest.raises(ConfigError, match="start_timeout must be > 0"):
        resolve({"start_timeout": 0}, environ={}, cwd=None)


def test_config_is_frozen_and_replace_validates():
    config = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.backend = "docker"
    assert config.replace(backend="docker").backend == "docker"
    with pytest.raises(ConfigError):
        config.replace(backend="nope")


def test_init_sets_the_default_context():
    import fibrl

    before = fibrl.get_context().config
    try:
        assert fibrl.init(image="x:1").image == "x:1"
        assert fibrl.get_context().config.image == "x:1"
        assert fibrl.get_start_method() == "local"
    finally:
        fibrl.init(**{k: getattr(before, k) for k in before.__dataclass_fields__})


def test_debug_logs_fibrl_events_to_stderr_in_parent_and_workers(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(
        "import fibrl\n"
        "def noop():\n"
        "    import logging\n"
        "    logging.getLogger('fibrl.test').debug('hello from the worker')\n"
        "if __name__ == '__main__':\n"
        "    p = fibrl.Process(target=noop); p.start(); p.join(60)\n"
        "    print('exit', p.exitcode)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FIBRL_")}
    runs = {}
    for flag in ("true", "false"):
        env["FIBRL_DEBUG"] = flag
        runs[flag] = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path,
                                    capture_output=True, text=True, timeout=120)
    assert runs["true"].stdout.strip() == "exit 0", runs["true"].stderr
    assert "[DEBUG/" in runs["true"].stderr and "connected back" in runs["true"].stderr
    assert "authenticated" in runs["true"].stderr
    assert "/Process-1/" in runs["true"].stderr and "hello from the worker" in runs["true"].stderr
    assert "[DEBUG/" not in runs["false"].stderr, runs["false"].stderr


def test_file_errors_name_the_file_and_line(tmp_path):
    path = tmp_path / ".fibrlconfig"
    path.write_text("[fibrl]\n# comment\nimage = x\ncpu = lots\n")
    with pytest.raises(ConfigError, match=rf"cpu.*{path}:4.*must be float"):
        resolve(environ={}, cwd=str(tmp_path))
    path.write_text("image = x\n\ncolour = red\n")
    with pytest.raises(ConfigError, match=rf"colour.*{path}:3"):
        resolve(environ={}, cwd=str(tmp_path))
    path.write_text("backend = mesos\n")
    with pytest.raises(ConfigError, match=rf"'mesos' is not known \(set in {path}:1\)"):
        resolve(environ={}, cwd=str(tmp_path))
    path.write_text("image = x\nstart_timeout = -1\n")
    with pytest.raises(ConfigError, match=rf"start_timeout must be > 0.*{path}:2"):
        resolve(environ={}, cwd=str(tmp_path))
