"""CI runs the README's own set-up commands (.ci/readme_commands.py), so the two cannot drift apart."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _commands_module():
    spec = importlib.util.spec_from_file_location("readme_commands", ROOT / ".ci" / "readme_commands.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ci_runs_the_readme_commands():
    quickstart, tests = _commands_module().setup_commands((ROOT / "README.md").read_text())
    assert "pip install" in quickstart and " -e " not in quickstart and quickstart.endswith("memplan train")
    assert "pytest" in tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert "readme_commands.py 1" in ci and "readme_commands.py 2" in ci
    assert quickstart not in ci and tests not in ci  # read from the README, never copied into CI


@pytest.mark.parametrize("readme", [
    "# x\n## Set up\n```bash\npip install . && memplan train\n```\n## Commands\n",
    "# x\n## Set up\n```bash\na\nb\n```\n```bash\nc\n```\n## Commands\n",
    "# x\n## Install\n```bash\na\n```\n```bash\nb\n```\n",
])
def test_a_readme_without_two_one_line_commands_is_refused(readme):
    with pytest.raises(SystemExit):
        _commands_module().setup_commands(readme)


@pytest.mark.parametrize("library", ["litgpt", "torchtune"])
def test_ci_builds_each_librarys_environment_from_its_extra_by_the_readmes_command(library):
    command = _commands_module().library_command((ROOT / "README.md").read_text(), library)
    assert f"-e '.[{library}]'" in command and f".venv-{library}/bin/python -m pytest" in command
    assert "-m libs " in command  # the library's tests, marked in one way (pyproject's markers)
    assert "tests/runs/test_walk_matrices.py" in command  # its slow matrices too
    assert "transformers" not in command and "[test]" not in command  # an environment of its own
    ci = (ROOT / ".ci" / "run").read_text()
    assert "readme_commands.py\" \"$lib\"" in ci and "for lib in litgpt torchtune" in ci
    assert command not in ci


def test_a_readme_without_one_command_for_a_library_is_refused():
    readme = "# x\n## Tests\n```\npython3 -m venv .venv-litgpt && a\npython3 -m venv .venv-litgpt && b\n```\n"
    with pytest.raises(SystemExit):
        _commands_module().library_command(readme, "litgpt")
    with pytest.raises(SystemExit):
        _commands_module().library_command(readme, "torchtune")
