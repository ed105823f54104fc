"""The CUDA extension loader's guard against a build lock left by a killed build (megacoat/kernels/cuda_ext.py):
torch's JIT build waits for `<build dir>/lock` forever, silently, and a killed build leaves it behind."""
import os
import time

import pytest

from megacoat.kernels import cuda_ext


def _lock(tmp_path, age_s):
    path = tmp_path / "lock"
    path.write_text("")
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


def test_no_lock_no_wait(tmp_path):
    assert cuda_ext.wait_for_build_lock(str(tmp_path), sleep=lambda s: pytest.fail("waited without a lock")) is None


def test_stale_lock_is_removed_at_once(tmp_path):
    path = _lock(tmp_path, cuda_ext.STALE_BUILD_LOCK_S + 60)
    with pytest.warns(UserWarning, match="removed the CUDA extension build lock"):
        said = cuda_ext.wait_for_build_lock(str(tmp_path), sleep=lambda s: pytest.fail("waited for a stale lock"),
                                            may_remove=True)
    assert not path.exists() and "killed" in said


def test_young_lock_is_waited_for_until_its_build_ends(tmp_path):
    path = _lock(tmp_path, 30)
    sleeps = []

    def sleep(s):  # the other build finishes during the second wait
        sleeps.append(s)
        if len(sleeps) == 2:
            path.unlink()

    with pytest.warns(UserWarning, match="another process is building"):
        said = cuda_ext.wait_for_build_lock(str(tmp_path), sleep=sleep)
    assert len(sleeps) == 2 and "waiting" in said and not path.exists()


def test_young_lock_that_never_goes_away_is_removed_once_stale(tmp_path):
    path = _lock(tmp_path, 30)
    now = [time.time()]

    def sleep(s):  # a killed build's lock: nobody removes it; time passes
        now[0] += 600

    with pytest.warns(UserWarning) as record:
        said = cuda_ext.wait_for_build_lock(str(tmp_path), clock=lambda: now[0], sleep=sleep, may_remove=True)
    assert not path.exists() and "removed" in said
    assert [str(w.message).split(" the CUDA")[0] for w in record] == ["megacoat: waiting for", "megacoat: removed"]


def test_only_local_rank_0_removes_a_stale_lock(tmp_path):
    """Two ranks removing the same stale lock could delete the lock of the build the first then starts."""
    path = _lock(tmp_path, cuda_ext.STALE_BUILD_LOCK_S + 60)
    waits = []

    def sleep(s):  # local rank 0 removes it meanwhile
        waits.append(s)
        path.unlink()

    with pytest.warns(UserWarning, match="waiting for"):
        cuda_ext.wait_for_build_lock(str(tmp_path), sleep=sleep, may_remove=False)
    assert waits == [5.0]


def test_a_lock_that_cannot_be_removed_raises(tmp_path, monkeypatch):
    """(the loader catches it and runs the reference) rather than claiming removal and hanging in torch"""
    _lock(tmp_path, cuda_ext.STALE_BUILD_LOCK_S + 60)

    def refuse(path):
        raise PermissionError(path)

    monkeypatch.setattr(cuda_ext.os, "remove", refuse)
    with pytest.raises(PermissionError):
        cuda_ext.wait_for_build_lock(str(tmp_path), may_remove=True)


def test_build_directory_is_torchs(monkeypatch, tmp_path):
    """torch's own build folder: $TORCH_EXTENSIONS_DIR/<name>, else its default root plus a per-Python, per-CUDA
    folder (the guard must look where torch puts the lock)."""
    from torch.utils import cpp_extension
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert cuda_ext.build_directory("fused_adamw") == os.path.join(str(tmp_path), "megacoat_fused_adamw")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setattr(cpp_extension, "get_default_build_root", lambda: str(tmp_path / "root"))
    got = cuda_ext.build_directory("fused_adamw")
    assert got.startswith(str(tmp_path / "root")) and got.endswith("megacoat_fused_adamw")
    assert got != os.path.join(str(tmp_path / "root"), "megacoat_fused_adamw")  # torch's py/cuda folder between
