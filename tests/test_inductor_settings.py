"""Inductor settings of the compiled layers."""
import os

import pytest

torch = pytest.importorskip("torch")
import torch._inductor.config as inductor_config  # noqa: E402

from megacoat.model.inductor_settings import STATIC_USER_KERNELS, launch_user_kernels_statically  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(inductor_config, "static_launch_user_defined_triton_kernels"),
                                reason="this torch's Inductor has no static launch of user-defined kernels")


def test_static_launch_of_user_kernels_is_turned_on(monkeypatch):
    monkeypatch.delenv(STATIC_USER_KERNELS, raising=False)
    with inductor_config.patch(static_launch_user_defined_triton_kernels=False):  # restored on exit
        assert launch_user_kernels_statically()
        assert os.environ[STATIC_USER_KERNELS] == "1" and inductor_config.static_launch_user_defined_triton_kernels


def test_the_users_setting_is_left_alone(monkeypatch):
    monkeypatch.setenv(STATIC_USER_KERNELS, "0")
    with inductor_config.patch(static_launch_user_defined_triton_kernels=False):
        assert not launch_user_kernels_statically()
        assert os.environ[STATIC_USER_KERNELS] == "0" and not inductor_config.static_launch_user_defined_triton_kernels
