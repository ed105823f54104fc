"""benchmarks/run_with_inductor_config.py: NAME=VALUE settings applied to Inductor's config, bad ones refused."""
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from run_with_inductor_config import apply  # noqa: E402


def test_settings_are_parsed_as_literals():
    config = types.SimpleNamespace(combo_kernels=False, max_autotune=False, name="x", n=1)
    apply(["combo_kernels=True", "n=8", "name='y'"], config)
    assert config.combo_kernels is True and config.n == 8 and config.name == "y" and config.max_autotune is False


@pytest.mark.parametrize("bad,msg", [("combo_kernels", "NAME=VALUE"), ("no_such_option=1", "no option"),
                                     ("combo_kernels=yes please", "not a Python literal")])
def test_bad_settings_are_refused(bad, msg):
    config = types.SimpleNamespace(combo_kernels=False)
    with pytest.raises(SystemExit, match=msg):
        apply([bad], config)
    assert config.combo_kernels is False
