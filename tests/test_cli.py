"""The command line: every subcommand's help prints (argparse formats help
strings with %, so a stray percent sign in any option's help breaks --help)
in plain text, without reStructuredText's quotes; ``--version`` says what a
bug report needs."""

import pytest

from clawcomm.cli import main

COMMANDS = [
    ["bench"],
    ["experiment", "compression"],
    ["train"],
    ["flight"],
    ["simulate"],
    ["plan"],
    ["tokenize"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_subcommand_prints_its_help(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: clawcomm " + " ".join(command))
    assert "``" not in out, [line for line in out.splitlines() if "``" in line]


def test_version(capsys):
    import clawcomm

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"clawcomm {clawcomm.__version__} (torch ") and "engine " in out, out
