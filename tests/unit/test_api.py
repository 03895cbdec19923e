"""The public surface: drop-in names and signatures, and an import without side effects."""
import inspect
import json
import multiprocessing
import subprocess
import sys

import pytest

import fibrl

EXTRAS = {"init", "meta"}


def test_all_is_the_stdlib_surface_plus_extras():
    assert set(fibrl.__all__) == set(multiprocessing.__all__) | EXTRAS
    for name in fibrl.__all__:
        assert hasattr(fibrl, name), name


def _is_factory(name):
    obj = getattr(multiprocessing, name)
    return callable(obj) and not (isinstance(obj, type) and issubclass(obj, BaseException))


@pytest.mark.parametrize("name", sorted(n for n in multiprocessing.__all__ if _is_factory(n)))
def test_signatures_follow_the_stdlib(name):
    ours, theirs = getattr(fibrl, name), getattr(multiprocessing, name)
    expected = inspect.signature(theirs).parameters
    got = inspect.signature(ours).parameters
    for pname, param in expected.items():
        assert pname in got, f"{name}: missing parameter {pname}"
        mine = got[pname]
        assert mine.kind == param.kind or param.kind is param.VAR_KEYWORD, (name, pname)
        if param.default is not param.empty and param.default != {}:
            assert mine.default == param.default, (name, pname)
    for pname, param in got.items():
        if pname not in expected:
            assert param.kind in (param.KEYWORD_ONLY, param.VAR_KEYWORD), \
                f"{name}: extra option {pname} must be keyword-only"


def test_exception_types_are_the_stdlib_ones():
    assert fibrl.ProcessError is multiprocessing.ProcessError
    assert fibrl.TimeoutError is multiprocessing.TimeoutError
    assert fibrl.BufferTooShort is multiprocessing.BufferTooShort
    assert issubclass(fibrl.AuthenticationError, multiprocessing.AuthenticationError)


PROBE = """
import json, logging, sys, threading, psutil
before = set(sys.modules)
import fibrl
heavy = [m for m in ("docker", "kubernetes", "gymnasium", "torch", "pynng", "numpy")
         if m in sys.modules]
print(json.dumps({
    "threads": threading.active_count(),
    "heavy": heavy,
    "sockets": len(psutil.Process().net_connections()),
    "handlers": len(logging.getLogger().handlers) + len(logging.getLogger("fibrl").handlers),
}))
"""


def test_import_has_no_side_effects(tmp_path):
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         cwd=tmp_path, timeout=60, check=True).stdout
    facts = json.loads(out)
    assert facts == {"threads": 1, "heavy": [], "sockets": 0, "handlers": 0}


def test_main_rebuilt_from_source_runs_as_mp_main(monkeypatch):
    from fibrl import bootstrap

    main = sys.modules["__main__"]
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.delitem(sys.modules, "__mp_main__", raising=False)
    script = (b"def f():\n    return 7\n"
              b"if __name__ == '__main__':\n    raise SystemExit('ran the guarded part')\n")
    preparation, source = bootstrap._visible_main(
        {"init_main_from_path": "/absent/train.py", "sys_argv": ["train.py"],
         "fibrl_main_source": script})
    assert "init_main_from_path" not in preparation and "fibrl_main_source" not in preparation
    bootstrap._main_from_source(*source)
    rebuilt = sys.modules["__main__"]
    assert rebuilt is sys.modules["__mp_main__"] and rebuilt.__name__ == "__mp_main__"
    assert rebuilt.f() == 7 and rebuilt.__file__ == "/absent/train.py"


def test_main_that_cannot_be_rebuilt_is_explained(monkeypatch, capsys):
    from fibrl import bootstrap

    main = sys.modules["__main__"]
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.delitem(sys.modules, "__mp_main__", raising=False)
    bootstrap._main_from_source("/absent/train.py", b"import sibling_module_not_in_the_image\n")
    assert sys.modules["__main__"] is main and "__mp_main__" not in sys.modules
    err = capsys.readouterr().err
    assert "could not rebuild __main__" in err and "sibling_module_not_in_the_image" in err


def test_a_visible_main_script_is_left_to_spawn(tmp_path):
    from fibrl import bootstrap

    script = tmp_path / "train.py"
    script.write_text("x = 1\n")
    preparation, source = bootstrap._visible_main(
        {"init_main_from_path": str(script), "fibrl_main_source": b"x = 1\n"})
    assert preparation == {"init_main_from_path": str(script)} and source is None
