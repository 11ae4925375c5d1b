"""The skip policy: under CI an unexpected skip fails the run; expected ones and xfails do not."""

import pytest

SUITE = '''
import pytest

def test_ok():
    pass

def test_cuda():
    pytest.skip("needs CUDA")

def test_missing_tool():
    pytest.skip("shellcheck is not installed")

@pytest.mark.xfail(reason="known")
def test_known():
    assert False
'''
MODULE_SKIP = 'import pytest\npytest.importorskip("no_such_module_h13b")\n'


@pytest.fixture
def suite(pytester, monkeypatch):
    allow = pytester.path / "allow.txt"
    allow.write_text("# comment\nneeds CUDA\n")
    monkeypatch.setenv("MIMIR_EXPECTED_SKIPS", str(allow))
    pytester.makeconftest("import skip_policy\n\ndef pytest_configure(config):\n"
                          "    skip_policy.install(config)\n")
    pytester.makepyfile(test_suite=SUITE)
    return pytester


def test_unexpected_skip_fails_under_ci(suite, monkeypatch):
    monkeypatch.setenv("CI", "true")
    result = suite.runpytest("-rs")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*unexpected skips (fail under CI)*",
                                 "*test_missing_tool: Skipped: shellcheck is not installed"])
    assert "test_cuda:" not in result.stdout.str()


def test_outside_ci_skips_are_only_listed(suite, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    result = suite.runpytest("-rs")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*unexpected skips*", "*test_missing_tool*"])


def test_expected_skips_pass_under_ci_and_module_skips_count(suite, monkeypatch):
    monkeypatch.setenv("CI", "1")
    assert suite.runpytest("-k", "cuda or ok or known").ret == pytest.ExitCode.OK
    suite.makepyfile(test_needs_module=MODULE_SKIP)
    result = suite.runpytest("test_needs_module.py")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*test_needs_module.py: *no_such_module_h13b*"])
