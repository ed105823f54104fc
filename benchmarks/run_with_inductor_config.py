"""Run pretrain_gpt.py with Inductor config values set first: an A/B of an Inductor option on the same run.

    python benchmarks/run_with_inductor_config.py combo_kernels=True -- <pretrain_gpt.py flags>

Each NAME=VALUE sets `torch._inductor.config.NAME` (VALUE a Python literal) before the script starts, in this
process (Inductor hands its config to its compile workers)."""
import ast
import runpy
import sys
from pathlib import Path


def apply(settings, config) -> None:
    for kv in settings:
        name, sep, value = kv.partition("=")
        if not sep:
            raise SystemExit(f"expected NAME=VALUE before --, got {kv!r}")
        if not hasattr(config, name):
            raise SystemExit(f"torch._inductor.config has no option {name!r}")
        try:
            setattr(config, name, ast.literal_eval(value))
        except (ValueError, SyntaxError):
            raise SystemExit(f"{name}: {value!r} is not a Python literal (True, 8, 'x')") from None


def main() -> None:
    args = sys.argv[1:]
    if "--" not in args:
        raise SystemExit("usage: run_with_inductor_config.py NAME=VALUE ... -- <pretrain_gpt.py flags>")
    i = args.index("--")
    import torch._inductor.config as config
    apply(args[:i], config)
    sys.argv = ["pretrain_gpt.py", *args[i + 1:]]
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "pretrain_gpt.py"), run_name="__main__")


if __name__ == "__main__":
    main()
