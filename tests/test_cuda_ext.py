"""The CUDA extension loader (megacoat/kernels/cuda_ext.py): its guard against a build lock left by a killed
build (torch's JIT build waits for `<build dir>/lock` forever, silently, and a killed build leaves it behind),
the messages around a first-use compilation (the compile itself mocked), and its flags and sources."""
import ast
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
        said = cuda_ext.wait_for_build_lock(str(tmp_path), sleep=lambda s: pytest.fail("waited for a stale lock"))
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
        said = cuda_ext.wait_for_build_lock(str(tmp_path), clock=lambda: now[0], sleep=sleep)
    assert not path.exists() and "removed" in said
    assert [str(w.message).split(" the CUDA")[0] for w in record] == ["megacoat: waiting for", "megacoat: removed"]


def test_a_stale_lock_replaced_meanwhile_is_waited_for(tmp_path, monkeypatch):
    """Two processes find the same stale lock; the first removes it and its build takes a new one while the
    second waits for the guard. The second must then wait for that build, not remove its lock."""
    path = _lock(tmp_path, cuda_ext.STALE_BUILD_LOCK_S + 60)
    real = cuda_ext._exclusive

    def first_process_wins(guard):  # before the second gets the guard: removed, and a new build's lock made
        path.unlink()
        _lock(tmp_path, 0)
        return real(guard)

    monkeypatch.setattr(cuda_ext, "_exclusive", first_process_wins)
    waits = []

    def sleep(s):  # the new build finishes
        waits.append(s)
        path.unlink()

    with pytest.warns(UserWarning, match="another process is building"):
        said = cuda_ext.wait_for_build_lock(str(tmp_path), sleep=sleep)
    assert waits == [5.0] and "waiting" in said


def test_a_lock_that_cannot_be_removed_raises(tmp_path, monkeypatch):
    """(the loader catches it and runs the reference) rather than claiming removal and hanging in torch"""
    _lock(tmp_path, cuda_ext.STALE_BUILD_LOCK_S + 60)

    def refuse(path):
        raise PermissionError(path)

    monkeypatch.setattr(cuda_ext.os, "remove", refuse)
    with pytest.raises(PermissionError):
        cuda_ext.wait_for_build_lock(str(tmp_path))


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


# ------------------------------------------------------------------------------------------- first-use build
@pytest.fixture
def first_use(monkeypatch, tmp_path):
    """A machine with a GPU and nvcc but no build of the extensions: torch's JIT compile is mocked (records its
    arguments, takes `seconds`, or raises `error`); the build directory is tmp_path/<name>."""
    import torch
    from torch.utils import cpp_extension

    calls = []
    behaviour = {"seconds": 0.0, "error": None}
    clock = [1000.0]

    def fake_load(**kw):
        calls.append(kw)
        clock[0] += behaviour["seconds"]
        if behaviour["error"]:
            raise behaviour["error"]
        return "module"

    monkeypatch.setattr(cuda_ext, "cuda_available", lambda: True)
    monkeypatch.setattr(cuda_ext, "installed_build", lambda name: None)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path / "cuda"))
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(cuda_ext, "build_directory", lambda name: str(tmp_path / name))
    monkeypatch.setattr(cuda_ext, "_clock", lambda: clock[0])
    monkeypatch.delenv("MEGACOAT_NO_CUDA_EXT", raising=False)
    cuda_ext.load_extension.cache_clear()
    yield calls, behaviour
    cuda_ext.load_extension.cache_clear()


def test_first_use_build_says_what_it_compiles_and_how_long_it_took(first_use, capsys, tmp_path):
    calls, behaviour = first_use
    behaviour["seconds"] = 42.4
    assert cuda_ext.load_extension("fused_adamw") == "module"
    err = capsys.readouterr().err.splitlines()
    expected = cuda_ext.EXTENSIONS["fused_adamw"].about_s
    assert err == [f"megacoat: compiling CUDA kernels fused_adamw (csrc/fused_adamw.cu, csrc/fused_adamw_binding.cpp) "
                   f"for this GPU (first use, about {expected} s; cached in {tmp_path / 'fused_adamw'})",
                   "megacoat: compiled CUDA kernels fused_adamw in 42 s"]
    (kw,) = calls
    assert kw["name"] == "megacoat_fused_adamw" and kw["with_cuda"]
    assert [os.path.basename(p) for p in kw["sources"]] == ["fused_adamw.cu", "fused_adamw_binding.cpp"]
    # one target, this GPU's machine code; no PTX for others, no fast math (the kernels are bit-exact)
    assert [f for f in kw["extra_cuda_cflags"] if "arch" in f] == ["-gencode=arch=compute_90a,code=sm_90a"]
    assert "--use_fast_math" not in kw["extra_cuda_cflags"] and "-G" not in kw["extra_cuda_cflags"]


def test_a_failed_first_use_build_warns_and_falls_back(first_use, capsys):
    calls, behaviour = first_use
    behaviour["seconds"], behaviour["error"] = 7.0, RuntimeError("nvcc: error: something")
    with pytest.warns(UserWarning, match=r"building CUDA kernel 'sdp4bit' failed after 7 s \(RuntimeError: nvcc: "
                      r"error: something\); using the PyTorch reference"):
        assert cuda_ext.load_extension("sdp4bit") is None
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("megacoat: compiling CUDA kernels sdp4bit (csrc/sdp4bit_encode.cu, ")
    assert cuda_ext.load_extension("sdp4bit") is None and len(calls) == 1  # tried once per process


def test_a_current_cached_build_loads_without_messages(first_use, capsys, tmp_path):
    calls, _ = first_use
    built = tmp_path / "fp8_gemm" / "megacoat_fp8_gemm.so"
    built.parent.mkdir()
    built.write_text("")
    newest = max(os.path.getmtime(p) for p in
                 [os.path.join(cuda_ext.CSRC, "fp8_gemm.cpp")] + [os.path.join(cuda_ext.CSRC, h) for h in
                                                                   os.listdir(cuda_ext.CSRC) if h.endswith((".h", ".cuh"))])
    os.utime(built, (newest + 1, newest + 1))
    assert cuda_ext.load_extension("fp8_gemm") == "module"
    assert capsys.readouterr().err == "" and calls[0]["extra_ldflags"] == ["-lcublasLt"]
    os.utime(built, (newest - 1, newest - 1))  # a source changed since: torch rebuilds, and it is said
    cuda_ext.load_extension.cache_clear()
    cuda_ext.load_extension("fp8_gemm")
    assert "compiling CUDA kernels fp8_gemm" in capsys.readouterr().err


def test_no_cuda_ext_forces_the_references(first_use, monkeypatch):
    calls, _ = first_use
    monkeypatch.setenv("MEGACOAT_NO_CUDA_EXT", "1")
    assert cuda_ext.load_extension("fused_adamw") is None and calls == []


@pytest.mark.parametrize("capability,target", [((9, 0), "sm_90a"), ((8, 0), "sm_80"), ((10, 0), "sm_100")])
def test_arch_flags_are_the_gpus_own(capability, target):
    (flag,) = cuda_ext.arch_flags(capability)
    assert flag == f"-gencode=arch=compute_{target[3:]},code={target}"


def test_setup_builds_the_sources_the_loader_compiles():
    """setup.py's ahead-of-time build and the first-use build compile the same files, all present."""
    tree = ast.parse(open(os.path.join(os.path.dirname(cuda_ext.CSRC), "setup.py")).read())
    (node,) = [n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "CUDA_EXTENSIONS"]
    in_setup = ast.literal_eval(node.value)
    assert in_setup == {f"megacoat._{name}": [f"csrc/{s}" for s in ext.sources]
                        for name, ext in cuda_ext.EXTENSIONS.items()}
    for ext in cuda_ext.EXTENSIONS.values():
        assert all(os.path.exists(os.path.join(cuda_ext.CSRC, s)) for s in ext.sources)
