"""setup.py keeps the compiled objects between installs: pip gives every build a new temporary
folder, so without this each ``pip install`` (the README's second command right after its
first) recompiled every source. Checked on setup.py's own command classes, configured as
pip's editable install configures them, without compiling anything."""
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_objects_go_to_build_ext_whatever_temporary_folder_pip_gives(tmp_path, monkeypatch):
    from distutils.core import run_setup

    import setuptools  # noqa: F401  (provides distutils on Python >= 3.12)

    monkeypatch.delenv("MEMKERN_BUILD_EXT", raising=False)
    monkeypatch.setenv("MEMKERN_BUILD_CUDA", "0")
    dist = run_setup(os.path.join(REPO, "setup.py"), stop_after="init")
    if not dist.ext_modules:
        pytest.skip("setup.py builds no extension here (no C++ compiler)")
    # What setuptools' editable_wheel (pip install -e) does: a fresh temporary build_temp.
    dist.get_command_obj("build").build_temp = str(tmp_path / "pip-build-temp")
    build_ext = dist.get_command_obj("build_ext")
    build_ext.ensure_finalized()
    assert build_ext.build_temp == os.path.join(REPO, "build", "ext")
    assert build_ext.use_ninja  # ninja decides what is out of date
