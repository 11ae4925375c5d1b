"""Where `mimir --version` finds the commit when there is no git checkout beside the package: the
file a build writes (mimir_megatron/version.py). The checkout and wheel cases, with git, are in
tests/system/test_bare_install.py."""

from __future__ import annotations

from mimir_megatron.version import BUILD_COMMIT_MODULE, Commit, _record, commit

SHA = "0123456789abcdef0123456789abcdef01234567"


def test_a_package_without_a_checkout_reads_the_recorded_commit(tmp_path):
    package = tmp_path / "site-packages" / "mimir_megatron"
    package.mkdir(parents=True)
    assert commit(package) is None
    (package / BUILD_COMMIT_MODULE).write_text(f"COMMIT = {SHA!r}\nDIRTY = True\n")
    assert commit(package) == Commit(SHA, dirty=True)
    assert str(commit(package)) == f"{SHA} with uncommitted changes"


def test_a_build_without_a_checkout_keeps_the_commit_an_sdist_brought(tmp_path):
    unpacked_sdist, build_lib = tmp_path / "mimir_megatron-0.1.0", tmp_path / "build" / "mimir_megatron"
    unpacked_sdist.mkdir()
    build_lib.mkdir(parents=True)
    (build_lib / BUILD_COMMIT_MODULE).write_text(f"COMMIT = {SHA!r}\nDIRTY = False\n")  # copied from the sdist
    _record(build_lib, unpacked_sdist)
    assert commit(build_lib) == Commit(SHA, dirty=False)


def test_a_build_from_nowhere_records_an_unknown_commit(tmp_path):
    _record(tmp_path / "mimir_megatron", tmp_path)
    assert (tmp_path / "mimir_megatron" / BUILD_COMMIT_MODULE).is_file()
    assert commit(tmp_path / "mimir_megatron") is None

