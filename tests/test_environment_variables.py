"""Every environment variable megacoat reads (megacoat/, tools/, pretrain_gpt.py, setup.py) is in the README's
"Environment variables" table, and the launcher's variables are read in one module.

Found in the source, not listed by hand: in a file that touches the environment (`environ`, `getenv`), every
string literal that is a variable name (upper case, digits, underscores) counts as one it reads; and every
access to `os.environ` / `os.getenv` (or a mapping named `env`) must name its variable by a literal or a
module constant, so that none escapes the count."""
import ast
import glob
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIABLE = re.compile(r"^[A-Z][A-Z0-9_]{2,}$")
LAUNCHER_MODULE = os.path.join("megacoat", "parallel", "launch_env.py")
LAUNCHER = re.compile(r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|SLURM_\w+)$")


def library_files():
    files = glob.glob(os.path.join(ROOT, "megacoat", "**", "*.py"), recursive=True)
    files += glob.glob(os.path.join(ROOT, "tools", "**", "*.py"), recursive=True)
    return sorted(files) + [os.path.join(ROOT, "pretrain_gpt.py"), os.path.join(ROOT, "setup.py")]


def _is_environment(node) -> bool:
    """os.environ, environ, or a mapping passed around as `env`."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ"
    return isinstance(node, ast.Name) and node.id in ("environ", "env")


def _keys(tree):
    """(key expression, line) of every access to the environment: env.get(k) / pop / setdefault, env[k],
    k in env, os.getenv(k)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in ("get", "pop", "setdefault") and _is_environment(f.value):
                yield node.args[0], node.lineno
            elif (isinstance(f, ast.Attribute) and f.attr == "getenv") or (isinstance(f, ast.Name) and f.id == "getenv"):
                yield node.args[0], node.lineno
        elif isinstance(node, ast.Subscript) and _is_environment(node.value):
            yield node.slice, node.lineno
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                and any(_is_environment(c) for c in node.comparators):
            yield node.left, node.lineno


def _constants(tree):
    """Module-level NAME = "..." or NAME = ("...", ...) assignments, and loop variables over them."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                continue
            if isinstance(value, str) or (isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value)):
                found[node.targets[0].id] = value
    for node in ast.walk(tree):  # `for k in CONSTANT` / `(... for k in CONSTANT)`
        if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name) \
                and isinstance(node.iter, ast.Name) and node.iter.id in found:
            found[node.target.id] = found[node.iter.id]
    return found


def read_variables():
    """{variable: [files]} of the library, and the accesses whose variable cannot be told."""
    variables, unknown = {}, []
    for path in library_files():
        src = open(path).read()
        if "environ" not in src and "getenv" not in src:
            continue
        tree = ast.parse(src)
        rel = os.path.relpath(path, ROOT)
        names = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                 and VARIABLE.match(n.value)}
        constants = _constants(tree)
        for key, line in _keys(tree):
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                continue  # a literal: counted above
            if isinstance(key, ast.Name) and key.id in constants:
                value = constants[key.id]
                names.update([value] if isinstance(value, str) else value)
                continue
            unknown.append(f"{rel}:{line}")
        for name in names:
            variables.setdefault(name, []).append(rel)
    return variables, unknown


def readme_table():
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme.split("## Environment variables\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row.split(" | ")[0])}


def test_every_variable_the_library_reads_is_in_the_readme_table():
    variables, unknown = read_variables()
    assert not unknown, (f"environment accesses whose variable cannot be told (use a literal or a module constant): "
                         f"{unknown}")
    assert {"MEGACOAT_NO_CUDA_EXT", "RANK", "SLURM_PROCID", "PYTORCH_CUDA_ALLOC_CONF"} <= set(variables)  # it finds them
    missing = {name: files for name, files in variables.items() if name not in readme_table()}
    assert not missing, f"read by the library but not in README.md's 'Environment variables' table: {missing}"


def test_the_launchers_variables_are_read_in_one_module():
    variables, _ = read_variables()
    elsewhere = {name: files for name, files in variables.items()
                 if LAUNCHER.match(name) and files != [LAUNCHER_MODULE]}
    assert not elsewhere, f"the launcher's environment is read outside {LAUNCHER_MODULE}: {elsewhere}"


@pytest.mark.parametrize("code,found", [
    ('import os\nx = os.environ.get("MEGACOAT_NEW_SWITCH")\n', {"MEGACOAT_NEW_SWITCH"}),
    ('import os\nNAMES = ("A_ONE", "A_TWO")\nx = any(os.environ.get(k) for k in NAMES)\n', {"A_ONE", "A_TWO"}),
    ('import os\ndef f(name):\n    return os.getenv(name)\n', None),
])
def test_the_scan_sees_a_new_variable(tmp_path, monkeypatch, code, found):
    """What would fail the first test: a new switch, one behind a constant, one the scan cannot tell."""
    module = tmp_path / "megacoat" / "new.py"
    module.parent.mkdir()
    module.write_text(code)
    monkeypatch.setattr(sys.modules[__name__], "library_files", lambda: [str(module)])
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    variables, unknown = read_variables()
    if found is None:
        assert unknown == ["megacoat/new.py:3"]
    else:
        assert set(variables) == found and not unknown
